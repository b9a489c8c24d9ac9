"""Make a key hold at least n rows: verify what is there, recompute damaged shards, resume a crashed build,
append rows for a larger calibration size, publish the manifest last. Compute is injected (no Ray here)."""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Callable, Iterable, Sequence

from tasks.atomic import TMP_PREFIX
from tasks.store.core import TargetStore
from tasks.store.format import StoreError

log = logging.getLogger("healsweep.store")

Plan = list[tuple[int, int, int]]  # [(shard_index, row_start, row_stop)]
RunShards = Callable[[Plan], Iterable[dict]]  # computes and writes every planned shard, yields shard infos


@dataclass
class EnsureResult:
    key: str
    num_rows: int
    computed_shards: list[tuple[int, int, int]] = field(default_factory=list)
    events: list[str] = field(default_factory=list)  # integrity events (logged; for MLflow too)

    @property
    def computed_rows(self) -> int:
        return sum(b - a for _, a, b in self.computed_shards)


def ensure_targets(store: TargetStore, key: str, num_rows: int, shard_size: int, run_shards: RunShards, *,
                   meta: dict, dtype: str, calibration_rows: Sequence[int] | Callable[[], Sequence[int]] | None = None
                   ) -> EnsureResult:
    """Under the key's writer lock: keep sound shards, compute only what is missing or damaged, finalize.

    - complete key with >= num_rows rows: every shard is checked (size and sha256); damaged ones are moved to
      the quarantine and recomputed with their row range, and the manifest rewritten.
    - key with fewer rows (nested calibration sizes): rows [old, num_rows) are appended as new shards.
    - no manifest (first build or a crashed one): shards whose sidecar, size and sha256 match are kept (resume).
    - unreadable or inconsistent manifest (e.g. it claims rows no shard holds): quarantined, then as above.
    Each damaged file found is an integrity event (``EnsureResult.events``).
    ``calibration_rows`` (dataset index of every row, at least num_rows long) goes into the manifest; given as a
    function, it is called only when the manifest is written (a complete, sound key asks for nothing).
    """
    res = EnsureResult(key, num_rows)
    with store.lock(key):
        if store.fs.local:  # leftovers of writers killed mid-write (only we write this key while locked)
            for name in store.fs.listdir(key):
                if name.startswith(TMP_PREFIX):
                    store.fs.delete(f"{key}/{name}")
        m = _manifest_or_quarantine(store, key, res)
        if m is not None:
            todo = []
            for s, problem in store.verify(key):
                _event(res, f"store key {key}: shard {s['file']} (rows {s['row_start']}-{s['row_stop']}) {problem}; "
                            "quarantined, recomputing")
                store.quarantine(key, s["file"])
                todo.append((s["index"], s["row_start"], s["row_stop"]))
            bad = {t[0] for t in todo}
            keep = [s for s in m["shards"] if s["index"] not in bad]
            have = m["num_rows"]
            if have >= num_rows and not todo:
                store.touch(key)  # a use: gc by age or by recent use keeps it until this sweep's trials open it
                return res
            if num_rows > have:
                appended = store.shard_plan(num_rows, shard_size, have, max(s["index"] for s in m["shards"]) + 1)
                todo += (new := _missing(store, key, appended, res))
                keep += [store.shard_info(key, i) for i, a, b in appended if (i, a, b) not in new]
            total = max(have, num_rows)
        else:
            plan = store.shard_plan(num_rows, shard_size)
            todo = _missing(store, key, plan, res)
            keep = [store.shard_info(key, i) for i, a, b in plan if (i, a, b) not in todo]
            total = num_rows
        infos = list(run_shards(todo)) if todo else []
        res.computed_shards = list(todo)
        if len(infos) != len(todo):
            raise StoreError(f"store key {key}: {len(todo)} shards planned, {len(infos)} written")
        allinfo = keep + infos
        cal = calibration_rows() if callable(calibration_rows) else calibration_rows
        cal = None if cal is None else list(cal)[:total]
        if cal is not None and len(cal) < total:
            raise StoreError(f"calibration_rows has {len(cal)} entries, need {total}")
        store.finalize(key, meta=meta, block_shapes=allinfo[0]["block_shapes"], dtype=dtype, num_rows=total,
                       shard_infos=allinfo, calibration_rows=cal)
        store._mark_verified(key, {i["file"]: store._stamp(key, i) for i in infos})
        res.num_rows = total
    return res


def _event(res: EnsureResult, msg: str) -> None:
    log.warning(msg)
    res.events.append(msg)


def _manifest_or_quarantine(store: TargetStore, key: str, res: EnsureResult) -> dict | None:
    """The key's manifest; an unreadable or inconsistent one is moved to the quarantine (an event) -> None."""
    try:
        return store.manifest(key)
    except StoreError as e:
        where = store.quarantine(key, "manifest.json")
        _event(res, f"{e}; quarantined ({where}), rebuilding the key from its sound shards")
        return None


def _missing(store: TargetStore, key: str, plan: Plan, res: EnsureResult) -> Plan:
    """Planned shards to compute; a shard on disk whose sidecar records its rows but whose bytes fail the
    check is quarantined (an event); one without a sidecar is a crashed write (recomputed, no event)."""
    todo = store.missing_shards(key, plan, verify=True)
    for idx, a, b in todo:
        info = store.shard_info(key, idx)
        if info is not None and (info.get("row_start"), info.get("row_stop")) == (a, b):
            problem = store.check_shard(key, info, checksum=True)
            _event(res, f"store key {key}: shard {info.get('file')} (rows {a}-{b}) {problem}; quarantined, recomputing")
            try:
                store.quarantine(key, str(info.get("file")))
            except StoreError:  # a sidecar naming a foreign file: leave that file alone
                pass
    return todo
