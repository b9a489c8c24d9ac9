"""The sharded dense stage: which target shards each model's key lacks (``tasks.store.ensure_targets`` decides:
verify, repair, resume, append, under a key lock), and the store's disk budget policy (refuse | recompute).
Computing shards (Ray tasks, one per missing shard, in parallel on every node present, nodes that join mid-stage
included; or in this process when the work is small) is orchestrator/sweep/dense_work.py: torch and the models,
imported only when a key lacks rows or a budget is priced (``_work``). Over a warm store this stage checks every
shard's sha256 and imports no torch."""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Mapping

import ray

from tasks.store import StoreError, TargetStore, ensure_targets

log = logging.getLogger("healsweep.store")


def _work():
    """orchestrator/sweep/dense_work.py (torch, the models), imported where the dense stage has work to do."""
    from orchestrator.sweep import dense_work

    return dense_work


@dataclass
class DenseReport:
    computed: dict[str, int] = field(default_factory=dict)  # model -> rows computed now
    shards: dict[str, int] = field(default_factory=dict)  # model -> shards computed now
    events: list[str] = field(default_factory=list)  # integrity events (damaged shards recomputed)
    nodes: dict[str, int] = field(default_factory=dict)  # Ray node id -> shards its tasks computed now
    loads: dict[str, int] = field(default_factory=dict)  # model -> times Ray tasks loaded it (and read its data)


def dense_stage(spec, models: Mapping, rows: Mapping[str, int], store_uri: str | Path, cache_dir: Path,
                progress: bool = True, *, max_workers: int | None = None, skip: tuple[str, ...] = (),
                report: DenseReport | None = None, in_driver: bool | None = None) -> dict[str, int]:
    """Make every model's key (except ``skip``) hold at least ``rows[model]`` rows; compute only what is
    missing or damaged. Returns {model: dense forward images computed now}; ``report`` gets the details.
    ``in_driver``: compute in this process (True) or as Ray tasks (False); default: in this process
    when the work is small (``dense_work.LOCAL_MAX_IMAGE_PARAMS``) and no GPU is asked for dense tasks."""
    store = TargetStore(store_uri)
    rep = report if report is not None else DenseReport()
    cpus = int(ray.cluster_resources().get("CPU", 1)) if ray.is_initialized() else 1
    for m, info in models.items():
        rep.computed[m] = rep.shards[m] = 0
        if m in skip:
            continue

        run_shards = partial(_run_shards, in_driver=in_driver, n_rows=rows[m], spec=spec, model=m,
                             key=info.store_key, store_uri=str(store_uri), cache_dir=cache_dir, cpus=cpus,
                             max_workers=max_workers, progress=progress, report=rep)
        res = ensure_targets(store, info.store_key, rows[m], spec.store.shard_size, run_shards,
                             meta={"model": m, "model_digest": info.digest, "calibration": info.calib_digest,
                                   "shard_size": spec.store.shard_size, "blocks": list(info.blocks)},
                             dtype=spec.store.dtype,  # the calibration order: read only when a manifest is written
                             calibration_rows=partial(_calibration_rows, m, cache_dir, spec.data_seed,
                                                      spec.load_kwargs(m)))
        rep.computed[m], rep.shards[m] = res.computed_rows, len(res.computed_shards)
        rep.events += res.events
    return dict(rep.computed)


def _run_shards(plan, **kw):
    """Called by ensure_targets only when shards are missing: ``dense_work.run_shards`` (small work in this
    process, else Ray tasks)."""
    yield from _work().run_shards(plan, **kw)


def _calibration_rows(model: str, cache_dir: Path, data_seed: int, load_kw: dict | None = None) -> list[int]:
    """Dataset index of each calibration item (``dense_work.calibration_rows``: a reference model's dataset without
    the model); asked for only when a key's manifest is written."""
    return _work().calibration_rows(model, cache_dir, data_seed, load_kw)


# ---------------------------------------------------------------------------------------------- budget
def _rows_held(store: TargetStore, key: str) -> int:
    """Rows a key's manifest records; 0 when it has none or a damaged one (the dense stage quarantines and
    rebuilds it: counted as all new)."""
    try:
        man = store.manifest(key)
    except StoreError:
        return 0
    return man["num_rows"] if man else 0


def _draws_said(n: int) -> str:
    return f" (and its {n} other calibration draw{'s' * (n > 1)})" if n else ""


class StoreBudgetError(Exception):
    """The targets a sweep needs do not fit ``store.budget_gb`` and ``store.on_budget`` is refuse."""


def budget_modes(spec, models: Mapping, rows: Mapping[str, int], store_uri: str | Path, cache_dir: Path,
                 draw_keys: Mapping[str, list[str]] | None = None) -> dict[str, str]:
    """{model: "store" | "recompute"} under ``spec.store.budget_gb``; StoreBudgetError (one line) when over
    budget and ``on_budget`` is refuse. Keys already holding enough rows cost nothing new. A budget prices a row
    with the model (``dense_work.row_bytes``); without one nothing is loaded. ``draw_keys``: {model: the target
    keys of its other calibration draws} (search.calib_draws): the sweep's too, priced with its own key."""
    modes = {m: "store" for m in models}
    budget = spec.store.budget_gb
    if budget is None:
        return modes
    store = TargetStore(store_uri)
    keys = {m: [info.store_key, *(draw_keys or {}).get(m, [])] for m, info in models.items()}
    ours = {k for ks in keys.values() for k in ks}
    used = sum(store.key_bytes(k) for k in store.keys() if k not in ours)
    for m in models:
        need = sum(max(rows[m], _rows_held(store, k)) for k in keys[m]) * _work().row_bytes(
            m, cache_dir, spec.data_seed, spec.store.dtype, spec.load_kwargs(m))
        if (used + need) / 1e9 <= budget:
            used += need
            continue
        if spec.store.on_budget == "refuse":
            raise StoreBudgetError(
                f"store.budget_gb: dense targets of {m}{_draws_said(len(keys[m]) - 1)} need {need / 1e9:.3g} GB and "
                f"the store already holds "
                f"{used / 1e9:.3g} GB, over the budget of {budget:g} GB; raise store.budget_gb, free space with "
                f"`healsweep store gc`, or set store.on_budget: recompute")
        modes[m] = "recompute"
        log.warning("store budget: %s targets (%.3g GB) do not fit; its trials recompute targets on the fly",
                    m, need / 1e9)
    return modes
