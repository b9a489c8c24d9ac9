"""The store side of ``healsweep doctor`` (orchestrator/lifecycle/doctor.py): every target key of a run's local store checked
the way ``healsweep store verify`` checks it (manifest readable and tiling its rows, each shard's size and sha256:
tasks/store), keys without a manifest named (a dense pass that did not finish: the next run completes it), and
every mask file's header read. The repair reuses the store's own: a damaged shard or manifest goes to the store's
quarantine, a damaged mask to ``masks/.quarantine/``; ``healsweep run --resume`` recomputes exactly what is gone."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Callable


def targets_root(run_dir: Path, info: dict) -> str:
    """The run's target store (targets.json, else the spec's store.uri, else <store>/targets)."""
    try:
        return json.loads((run_dir / "targets.json").read_text())["store"]
    except (OSError, ValueError, KeyError, TypeError):
        return (info["spec"].get("store") or {}).get("uri") or str(Path(info["store"]) / "targets")


def targets_gap(run_dir: Path, info: dict) -> str | None:
    """A target key of this sweep that is present in its local store but not whole (no manifest, or a shard
    missing or of the wrong size: sizes only, no sha256), or None. A key gone entirely (``store gc``) is no gap:
    a finished sweep does not need it, a refine round recomputes it. -> the key's directory."""
    from tasks.store import KEY_RE, StoreError, TargetStore

    root = targets_root(run_dir, info)
    try:
        keys = json.loads((run_dir / "targets.json").read_text())["keys"].values()
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    if "://" in root or not Path(root).is_dir():
        return None
    store = TargetStore(root)
    for key in keys:
        if not isinstance(key, str) or not KEY_RE.match(key) or not store.fs.listdir(key):
            continue
        try:
            m = store.manifest(key)
        except StoreError:
            return store.fs.path(key)
        if m is None or any(store.check_shard(key, sh) for sh in m["shards"]):
            return store.fs.path(key)
    return None


def store_problems(run_dir: Path, info: dict, problem: Callable) -> list:
    from tasks.store import KEY_RE, StoreError, TargetStore

    root = targets_root(run_dir, info)
    if "://" in root or not Path(root).is_dir():
        return []  # a remote store (checked by `healsweep store verify`), or none yet
    store, out = TargetStore(root), []
    for key in sorted(n for n in store.fs.listdir() if KEY_RE.match(n)):
        try:
            m = store.manifest(key)
        except StoreError as e:
            out.append(problem(store.fs.path(f"{key}/manifest.json"), f"damaged ({e})",
                               f"nothing computed: target key {key}'s sound shards are reused, the rest recomputed "
                               "by healsweep run --resume", _quarantine(store, key, "manifest.json"), later=True))
            continue
        if m is None:  # incomplete: a dense pass that did not finish (a full disk, a kill)
            shards = [n for n in store.fs.listdir(key) if n.endswith(".arrow")]
            if shards:
                size = store.key_bytes(key) / (1 << 20)
                out.append(problem(store.fs.path(key), f"incomplete target key ({len(shards)} shard(s), {size:.1f} "
                                   "MiB, no manifest: a dense pass that did not finish)", "nothing: healsweep run "
                                   "--resume keeps its sound shards and computes the rest (or healsweep store gc "
                                   "deletes it)", later=True))
            continue
        for s, why in store.verify(key):
            gone = store.fs.size(f"{key}/{s['file']}") is None  # nothing to quarantine: the resume recomputes it
            out.append(problem(store.fs.path(f"{key}/{s['file']}"), "target shard missing" if gone else
                               f"target shard {why}", f"rows {s['row_start']}-{s['row_stop']} of target key {key} "
                               "(recomputed by healsweep run --resume)", _quarantine(store, key, s["file"]),
                               later=True))
    return out + _mask_problems(Path(info["store"]) / "masks", problem)


def _quarantine(store, key: str, name: str) -> Callable[[], str]:
    def fix() -> str:
        where = store.quarantine(key, name)
        return f"moved to {where}" if where else "already gone (recomputed by healsweep run --resume)"
    return fix


def _mask_problems(masks: Path, problem: Callable) -> list:
    """Every local mask read and checked (tasks/store/masks.py ``MaskStore.problem``: readable, its identity its
    key's, its content its digest); a damaged one is moved aside and computed again by the next sweep."""
    from tasks.store import MaskStore

    if not masks.is_dir():
        return []
    store, out = MaskStore(masks), []
    for key in store.keys():
        why = store.problem(key)
        if why is not None:
            f = store.path(key)
            out.append(problem(str(f), f"damaged mask ({why[:120]})", "nothing: recomputed by healsweep run "
                               "--resume", _move(f, masks / ".quarantine" / f.name), later=True))
    return out


def _move(src: Path, dst: Path) -> Callable[[], str]:
    def fix() -> str:
        dst.parent.mkdir(parents=True, exist_ok=True)
        src.replace(dst)
        return f"moved to {dst}"
    return fix
