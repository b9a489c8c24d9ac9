"""Stages that run before the trials: models, the sharded dense pass (orchestrator.sweep.dense), masks.

A warm sweep (model facts cached, targets and masks in the store) needs no model here and imports no torch: the
model and mask computations import tasks.models, tasks.healing and tasks.pruning where they start (``model_info``,
``compute_masks``); what a warm driver does (content keys, ``MaskStore.has``) is torch-free."""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

from orchestrator.raytune import cluster
from orchestrator.raytune.resources import ray_task, task_device, task_gpus
from orchestrator.spec import SweepSpec
from orchestrator.spec.plan import Cell, targets_identity
from orchestrator.sweep.dense import dense_stage  # noqa: F401  (re-exported: the sharded dense stage)
from orchestrator.sweep.model_facts import ModelInfo, cached_model_info
from tasks.store import MaskStore, content_key

log = logging.getLogger(__name__)


def model_info(spec: SweepSpec, name: str, cache: str, progress: bool = False) -> ModelInfo:
    """Load one model of the sweep (verified weights; nothing is trained); derive its target-store key."""
    from tasks.healing import LOGITS
    from tasks.models import get_adapter, load_model_shared

    lm = load_model_shared(name, cache, data_seed=spec.data_seed, progress=progress, **spec.load_kwargs(name))
    adapter = get_adapter(lm.model)
    blocks = [b for b, _ in adapter.blocks(lm.model)] + [LOGITS]
    calib_digest = lm.dataset.split_digest("calibration")
    key = content_key(targets_identity(lm.digest, lm.dataset.digest, calib_digest, blocks, spec.store.dtype))
    return ModelInfo(name, lm.digest, float(lm.info["dense_eval_acc"]), spec.scope.get(name, adapter.default_scope),
                     tuple(blocks), key, calib_digest, adapter.default_granularity)


def prepare_models(spec: SweepSpec, cache: str | Path, progress: bool = True, on_workers: bool = False
                   ) -> dict[str, ModelInfo]:
    """Every model of the sweep. ``on_workers`` (a cluster given by --address): one Ray task per model on a
    worker (an external model's weights are read where the trials run, not by the driver); otherwise in this
    process (local Ray: same machine, no task start-up). Reference models load their shipped weights (in the code
    every node runs) or a checkpoint ``path``: nothing is trained, uploaded or downloaded."""
    if not on_workers:  # facts of a cached checkpoint come from orchestrator/sweep/model_facts.py: no model built
        return {n: cached_model_info(spec, n, lambda n=n: model_info(spec, n, str(cache), progress))
                for n in spec.models}
    import ray

    task = ray_task(_model_info_task, spec.resources.cpus_per_dense_task, spec.resources.gpus_per_dense_task)
    refs = [task.remote(spec, n, str(cache)) for n in spec.models]
    return dict(zip(spec.models, ray.get(refs)))


def _model_info_task(spec: SweepSpec, name: str, cache: str) -> ModelInfo:
    return model_info(spec, name, cache, progress=False)


@dataclass(frozen=True)
class MaskJob:
    """One mask to compute: the cell's pruning settings, its content key and identity, its RR table if any."""
    key: str
    ident: dict
    scope: str
    pruner: str
    sparsity: float
    seed: int
    settings: dict
    calib_size: int
    rr: dict | None = None


def compute_masks(model: str, cache: str, data_seed: int, load_kw: dict, jobs: list[MaskJob], mask_root: str,
                  ranking_dir: str, node: str = "driver", device: str = "cpu") -> list[dict]:
    """Load ``model`` once, compute every job's masks and write them to the mask store (a directory or a URI),
    each with its provenance (node id, seconds). The same code in the driver and in a mask task."""
    from tasks.models import get_adapter, load_model_shared
    from tasks.pruning import PruneContext, make_masks

    masks = MaskStore(mask_root)
    lm = load_model_shared(model, cache, data_seed=data_seed, progress=False, **load_kw)
    net = lm.model.to(device)
    adapter = get_adapter(net)
    out = []
    for j in jobs:
        t0 = time.perf_counter()
        entries = adapter.scope(net, j.scope)
        diag = {"rr": j.rr} if j.rr is not None else {}
        diag["ranking_dir"] = ranking_dir  # cached elastic rankings (snapvit)
        ctx = PruneContext(net, adapter, entries, calib_images=lm.dataset["calibration"].images[: j.calib_size]
                           .to(device), diagnostics=diag)
        m = make_masks(net, entries, j.pruner, j.sparsity, seed=j.seed, settings=j.settings, ctx=ctx)
        prov = {"node_id": node, "device": device, "seconds": round(time.perf_counter() - t0, 3)}
        masks.save(j.key, {k: v.cpu() for k, v in m.items()}, {**j.ident, "provenance": prov})
        out.append({"key": j.key, **prov})
    return out


def _mask_task(device_setting: str, *args) -> list[dict]:
    import ray
    import torch

    device = task_device(device_setting, ray.get_gpu_ids())  # a GPU only when the task was given one
    torch.set_num_threads(max(1, int(ray.get_runtime_context().get_assigned_resources().get("CPU", 1))))
    return compute_masks(*args, node=ray.get_runtime_context().get_node_id(), device=device)


class MaskResult(dict):
    """{cell_id: mask key}, with ``computed`` (one dict per mask computed now: key, node_id, device, seconds)
    and ``placement`` ("driver" | "tasks" | "cached")."""

    def __init__(self, keys: dict[str, str], computed: list[dict], placement: str, events: list[str] | None = None
                 ) -> None:
        super().__init__(keys)
        self.computed, self.placement = computed, placement
        self.events = list(events or [])  # damaged masks moved aside and computed again


def mask_stage(cells: list[Cell], models: Mapping[str, ModelInfo], mask_root: str | Path, cache: str | Path,
               data_seed: int, diagnostics: Mapping[str, Mapping] | None = None,
               load_kw: Mapping[str, dict] | None = None, *, ranking_dir: str | Path | None = None,
               in_driver: bool = True, resources: tuple[float, float] = (1, 0), device: str = "auto") -> MaskResult:
    """Compute each distinct missing mask once (content-addressed). ``in_driver``: in this process, else one Ray
    task per (model, pruner) with ``resources`` (cpus, gpus) per task; the masks are written to ``mask_root``
    (``<store.uri>/masks`` when remote) by whoever computes them, and the driver only checks they exist.
    ``diagnostics``: {cell_id: RR table}; ``load_kw``: {model: load_model kwargs}; ``ranking_dir``: where SnapViT
    rankings are cached (default: next to ``mask_root``)."""
    masks = MaskStore(mask_root)
    rank = str(ranking_dir or Path(str(mask_root)).parent / "rankings")
    keys: dict[str, str] = {}
    groups: dict[tuple[str, str], dict[str, MaskJob]] = {}
    checked: set[str] = set()  # reused masks found intact
    events: list[str] = []
    for c in cells:
        ident = c.mask_identity(models[c.model].digest, models[c.model].calib_digest)
        keys[c.cell_id] = key = content_key(ident)
        if key in checked:
            continue  # another healer of the same mask
        if masks.has(key) and _intact(masks, key, events):
            checked.add(key)
            masks.touch(key)  # its last use, for `healsweep store gc --older-than` (remote: a write per mask)
            continue
        rr = diagnostics.get(c.cell_id) if diagnostics else None
        groups.setdefault((c.model, c.pruner), {})[key] = MaskJob(
            key, ident, c.scope, c.pruner, c.sparsity, c.seed, dict(c.pruner_settings), c.calib_size, rr)
    args = [(m, str(cache), data_seed, dict((load_kw or {}).get(m, {})), list(jobs.values()), str(mask_root), rank)
            for (m, _), jobs in groups.items()]
    if not args:
        return MaskResult(keys, [], "cached", events)
    if in_driver:
        return MaskResult(keys, [r for a in args for r in compute_masks(*a)], "driver", events)
    import ray

    task = ray_task(_mask_task, resources[0], resources[1])
    done = ray.get([task.remote(device, *a) for a in args])
    missing = [k for part in done for k in (r["key"] for r in part) if not masks.has(k)]
    if missing:
        raise RuntimeError(f"mask tasks reported {len(missing)} mask(s) the store at {mask_root} does not hold")
    return MaskResult(keys, [r for part in done for r in part], "tasks", events)


def _intact(masks: MaskStore, key: str, events: list[str]) -> bool:
    """Whether a stored mask can be reused: read and checked (its identity is its key's, its content its digest);
    a damaged one is moved aside (an event) and computed again, as a damaged target shard is."""
    why = masks.problem(key)
    if why is None:
        return True
    where = masks.quarantine(key)
    msg = f"mask {key} damaged ({why}): {'moved to ' + where if where else 'deleted'}; computed again"
    log.warning(msg)
    events.append(msg)
    return False


def store_paths(uri: str | None, store_dir: Path, cache_dir: Path) -> dict[str, str]:
    """Where every stage reads and writes. With a remote ``store.uri`` (s3://, gs://, ...) everything a worker
    touches is under it: targets at the URI, ``masks/``, ``diagnostics/`` and ``rankings/`` beside them, and
    ``tune/`` (Ray Tune's storage: trial checkpoints, which a node without the run directory must be able to
    write) and ``healed/`` (the healed weights of a trial on such a node: tasks/store/healed.py). Otherwise the
    local store root (a file system every node mounts; Tune's storage is then DIR/tune, so on a cluster the run
    directory must be shared too). ``cache``: the local model cache (``healsweep models train`` writes there;
    loading reads shipped weights or a spec's checkpoint path)."""

    if cluster.is_remote(uri):
        sub = {n: cluster.store_subdir(uri, n) for n in ("masks", "diagnostics", "rankings", "tune", "healed")}
        return {"targets": uri, **sub, "cache": str(cache_dir)}
    return {"targets": uri or str(store_dir / "targets"), "masks": str(store_dir / "masks"),
            "diagnostics": str(store_dir / "diagnostics"), "rankings": str(store_dir / "rankings"),
            "cache": str(cache_dir)}


def masks_in_driver(on_cluster: bool, res) -> tuple[bool, str]:
    """The mask stage's placement, a named decision (logged as the parent run's ``mask_placement`` tag): on a
    cluster (--address) or when a GPU is asked, Ray tasks on the workers; on a local Ray without GPUs, in this
    process (same machine, same code path, no task start-up: issue #18's overhead)."""
    if on_cluster:
        return False, "as Ray tasks on the cluster's workers (--address)"
    if task_gpus(res) > 0:
        return False, "as Ray tasks (a GPU is asked for)"
    return True, "in the driver (local Ray, CPU only: a task would only add start-up time)"
