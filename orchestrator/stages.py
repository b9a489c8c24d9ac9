"""Stages that run before the trials: reference models, the sharded dense pass (Ray tasks), masks."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

import ray
import torch
from tqdm.auto import tqdm

from orchestrator.plan import Cell, targets_identity
from orchestrator.spec import SweepSpec
from tasks.adapters import get_adapter
from tasks.masks import MaskStore
from tasks.models import load_model
from tasks.pruners import PruneContext, make_masks
from tasks.store import TargetStore, content_key
from tasks.targets import LOGITS, dense_targets


@dataclass(frozen=True)
class ModelInfo:
    name: str
    digest: str
    dense_acc: float
    scope: str
    blocks: tuple[str, ...]
    targets_key: str
    calib_digest: str


def prepare_models(spec: SweepSpec, cache_dir: Path, progress: bool = True) -> dict[str, ModelInfo]:
    """Load (training on first use) every model of the sweep in the driver; derive its target-store key."""
    out = {}
    for name in spec.models:
        lm = load_model(name, cache_dir, data_seed=spec.data_seed, progress=progress, **spec.load_kwargs(name))
        adapter = get_adapter(lm.model)
        blocks = [b for b, _ in adapter.blocks(lm.model)] + [LOGITS]
        calib_digest = lm.dataset.split_digest("calibration")
        key = content_key(targets_identity(name, lm.digest, lm.dataset.digest, calib_digest, blocks, spec.store.dtype))
        out[name] = ModelInfo(name, lm.digest, float(lm.info["dense_eval_acc"]),
                              spec.scope.get(name, adapter.default_scope), tuple(blocks), key, calib_digest)
    return out


@ray.remote
def dense_shard(model: str, cache_dir: str, data_seed: int, store_root: str, key: str, index: int,
                start: int, stop: int, dtype: str, threads: int, load_kw: dict | None = None) -> dict:
    """One Ray task: dense forward of calibration rows [start, stop) -> one shard of block targets."""
    torch.set_num_threads(max(1, threads))
    lm = load_model(model, cache_dir, data_seed=data_seed, progress=False, **(load_kw or {}))
    blocks = get_adapter(lm.model).blocks(lm.model)
    images = lm.dataset["calibration"].images[start:stop]
    targets = dense_targets(lm.model, blocks, images, dtype=getattr(torch, dtype))
    return TargetStore(store_root).write_shard(key, index, start, targets)


def dense_stage(spec: SweepSpec, models: Mapping[str, ModelInfo], rows: Mapping[str, int], store_root: Path,
                cache_dir: Path, progress: bool = True) -> dict[str, int]:
    """Make sure every model's target key holds at least ``rows[model]`` rows; compute only missing shards.

    Returns {model: dense forward images computed now} (0 for keys already complete).
    """
    store = TargetStore(store_root)
    computed = {m: 0 for m in models}
    jobs, stale = {}, []
    for m, info in models.items():
        manifest = store.manifest(info.targets_key)
        if manifest is not None and manifest["num_rows"] >= rows[m]:
            continue  # complete: no dense forward pass at all
        stale.append(m)
        for idx, start, stop in store.missing_shards(info.targets_key, rows[m], spec.store.shard_size):
            ref = dense_shard.options(num_cpus=spec.resources.cpus_per_dense_task).remote(
                m, str(cache_dir), spec.data_seed, str(store_root), info.targets_key, idx, start, stop,
                spec.store.dtype, int(spec.resources.cpus_per_dense_task), spec.load_kwargs(m))
            jobs[ref] = (m, stop - start)
    pending = list(jobs)
    with tqdm(total=sum(r for _, r in jobs.values()), desc="dense targets", unit="img", disable=not progress) as bar:
        while pending:
            done, pending = ray.wait(pending, num_returns=1)
            ray.get(done[0])  # re-raises a task's error here
            m, r = jobs[done[0]]
            computed[m] += r
            bar.update(r)
    for m in stale:  # manifest last, once every shard of the plan is in place
        info = models[m]
        infos = [store.shard_info(info.targets_key, i) for i, _, _ in store.shard_plan(rows[m], spec.store.shard_size)]
        store.finalize(info.targets_key, meta={"model": m, "model_digest": info.digest, "calibration": info.calib_digest,
                                               "shard_size": spec.store.shard_size},
                       block_shapes=infos[0]["block_shapes"], dtype=spec.store.dtype, num_rows=rows[m],
                       shard_infos=infos)
    return computed


def mask_stage(cells: list[Cell], models: Mapping[str, ModelInfo], mask_root: Path, cache_dir: Path,
               data_seed: int, load_kw: Mapping[str, dict] | None = None) -> dict[str, str]:
    """Compute each distinct mask once (content-addressed); return {cell_id: mask_key}."""
    masks = MaskStore(mask_root)
    out: dict[str, str] = {}
    loaded = {}
    for c in cells:
        ident = c.mask_identity(models[c.model].digest, models[c.model].calib_digest)
        key = content_key(ident)
        out[c.cell_id] = key
        if masks.has(key):
            continue
        if c.model not in loaded:
            loaded[c.model] = load_model(c.model, cache_dir, data_seed=data_seed, progress=False,
                                         **(load_kw or {}).get(c.model, {}))
        lm = loaded[c.model]
        adapter = get_adapter(lm.model)
        entries = adapter.scope(lm.model, c.scope)
        ctx = PruneContext(lm.model, adapter, entries, calib_images=lm.dataset["calibration"].images[: c.calib_size])
        m = make_masks(lm.model, entries, c.pruner, c.sparsity, seed=c.seed, settings=c.pruner_settings, ctx=ctx)
        masks.save(key, m, ident)
    return out
