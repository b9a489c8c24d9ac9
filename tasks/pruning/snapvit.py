"""The registered ``snapvit`` pruner: one cached SnapViT ranking per (model, calibration set, settings, seed);
every sparsity is a threshold (prefix) of it, so the masks of a grid are nested and the search runs once.

Cache: content-addressed by sha256 of the model's state_dict bytes, the calibration images' bytes, the unit
layout, the resolved settings and the seed. Kept in process memory (a few entries) and, when the prune context
carries ``diagnostics["ranking_dir"]`` (the sweep's mask stage sets <store>/rankings, or <store.uri>/rankings when
the store is remote), as <ranking_dir>/<key>.safetensors (tensors + JSON metadata; never pickle).
"""
from __future__ import annotations

import hashlib
import json
import os
import tempfile
from collections import OrderedDict
from pathlib import Path
from typing import Any, Mapping

import torch
import torch.nn as nn
from safetensors import safe_open
from safetensors.torch import save_file

import tasks.pruning.snapvit_math as snapvit
from tasks.atomic import atomic_write
from tasks.models.adapter import ModelAdapter, get_adapter
from tasks.pruning.base import PRUNERS, PruneContext, Pruner
from tasks.pruning.snapvit_authors import keep_from_scores
from tasks.store import KEY_RE, StoreError, content_key

RANKING_FORMAT = "snapvit-ranking/1"
_MEMORY: "OrderedDict[str, snapvit.Ranking]" = OrderedDict()
_MEMORY_SIZE = 8


def tensor_digest(tensors: Mapping[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for k in sorted(tensors):
        t = tensors[k].detach().cpu().contiguous()
        h.update(f"{k}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()[:32]


def ranking_key(model: nn.Module, images: torch.Tensor, layout: snapvit.Layout, settings: Mapping[str, Any],
                seed: int) -> str:
    return content_key({"format": RANKING_FORMAT, "model": tensor_digest(model.state_dict()),
                        "images": tensor_digest({"x": images}), "layout": layout.describe(),
                        "settings": dict(settings), "seed": seed})


def _path(root: str | os.PathLike, key: str) -> Path:
    if not KEY_RE.match(key):
        raise StoreError(f"invalid ranking key {key!r}")
    root = Path(root).resolve()
    p = (root / f"{key}.safetensors").resolve()
    if p.parent != root:
        raise StoreError(f"ranking key {key!r} escapes the ranking directory")
    return p


def _remote(root: str | os.PathLike):
    """A StoreFS for a remote ranking root (``<store.uri>/rankings``: s3://, gs://, ...), else None."""
    s = os.fspath(root)
    if "://" not in s or s.startswith("file://"):
        return None
    from tasks.store.fs import StoreFS

    return StoreFS(s)


def save_ranking(root: str | os.PathLike, key: str, r: snapvit.Ranking) -> Path | str:
    fs = _remote(root)
    if fs is not None:  # written locally, then moved onto the store (atomic there too)
        with tempfile.TemporaryDirectory() as d:
            fs.write_atomic(_path(d, key).name, save_ranking(d, key, r).read_bytes())
        return fs.path(_path(".", key).name)
    final = _path(root, key)
    final.parent.mkdir(parents=True, exist_ok=True)
    meta = {"format": RANKING_FORMAT, "fitness": r.fitness, "history": r.history, "layout": r.layout}
    tensors = {"order": r.order.contiguous(), "scores": r.scores.contiguous(),
               "sensitivity": r.sensitivity.contiguous(), "weights": r.weights.contiguous()}
    return atomic_write(final, lambda tmp: save_file(tensors, tmp, metadata={"meta": json.dumps(meta)}))


def load_ranking(root: str | os.PathLike, key: str) -> snapvit.Ranking | None:
    fs = _remote(root)
    if fs is not None:
        raw = fs.read_bytes(_path(".", key).name)
        if raw is None:
            return None
        with tempfile.TemporaryDirectory() as d:
            Path(d, f"{key}.safetensors").write_bytes(raw)
            return load_ranking(d, key)
    p = _path(root, key)
    if not p.is_file():
        return None
    with safe_open(str(p), framework="pt") as f:
        meta = json.loads(f.metadata()["meta"])
        t = {k: f.get_tensor(k) for k in f.keys()}
    if meta.get("format") != RANKING_FORMAT:
        raise StoreError(f"{p}: not a {RANKING_FORMAT} artifact")
    return snapvit.Ranking(t["order"], t["scores"], t["sensitivity"], t["weights"], meta["fitness"],
                           meta["history"], meta["layout"])


def get_ranking(ctx: PruneContext, layout: snapvit.Layout, settings: Mapping[str, Any], seed: int
                ) -> snapvit.Ranking:
    """Memory -> disk -> compute (once) for this (model, calibration images, layout, settings, seed)."""
    key = ranking_key(ctx.model, ctx.calib_images, layout, settings, seed)
    if key in _MEMORY:
        _MEMORY.move_to_end(key)
        return _MEMORY[key]
    root = ctx.diagnostics.get("ranking_dir")
    r = load_ranking(root, key) if root else None
    if r is not None and r.layout != layout.describe():
        raise StoreError(f"ranking {key}: stored layout does not match the model")
    if r is None:
        r = snapvit.compute_ranking(ctx.model, layout, ctx.calib_images, settings, seed)
        if root:
            save_ranking(root, key, r)
    _MEMORY[key] = r
    while len(_MEMORY) > _MEMORY_SIZE:
        _MEMORY.popitem(last=False)
    return r


def clear_memory_cache() -> None:
    _MEMORY.clear()


@PRUNERS.register("snapvit")
class SnapViTPruner(Pruner):
    """Structured: whole MLP neurons and attention heads, one elastic ranking (docs/methods.md#snapvit).

    Sparsity = fraction of the scope's prunable weights removed (parameter count; whole units, so the achieved
    value is within half a unit of the request). Masks also cover the removed units' biases (fc1 entries,
    qkv rows), which lie outside the weight scope and do not count towards sparsity."""

    uses_calibration = True
    seeded_mask = True  # the elastic ranking comes from a seeded search (xNES)
    quick_settings = {"iterations": 2, "evaluations": 6, "fitness_sparsities": [0.25, 0.5], "fitness_images": 8}
    settings_schema = {"variant": str, "evaluations": int, "min_head_keep": float, "min_neuron_keep": float,
                       "global_crops": int, "local_crops": int,
                       "iterations": int, "popsize": int, "sigma0": float, "pca_dim": int, "fitness_images": int,
                       "fitness_sparsities": list, "grad_batch": int, "tau_t": float, "tau_s": float}

    def check(self, settings):
        super().check(settings)
        raw = {**snapvit.DEFAULTS, **settings}
        snapvit.check_settings({**raw, "grad_batch": raw["grad_batch"] or 1})

    def resolved_settings(self, settings):
        return snapvit.resolve_settings(settings)

    def check_model(self, model: nn.Module, adapter: ModelAdapter, scope: str, settings) -> None:
        if not {"qkv", "proj", "fc1", "fc2"} <= set(getattr(adapter, "parts", {})):
            raise ValueError(f"{type(model).__name__} is not a Vision Transformer; SnapViT removes attention "
                             "heads and MLP neurons")
        try:
            snapvit.vit_layout(model, adapter, adapter.scope(model, scope))
        except ValueError as e:
            raise ValueError(f"scope {scope!r}: {e}") from None

    def tolerance(self, model, entries) -> float:
        """Whole heads/neurons are removed: within half the largest unit's weights per scope tensor."""
        return 0.5 * len(entries) * int(snapvit.vit_layout(model, get_adapter(model), entries).unit_params().max())

    def __call__(self, weights, sparsity, *, seed, ctx=None, **settings):
        if ctx is None or ctx.calib_images is None or len(ctx.calib_images) == 0:
            raise ValueError("pruner 'snapvit' needs calibration images (PruneContext.calib_images)")
        layout = snapvit.vit_layout(ctx.model, ctx.adapter, ctx.entries)
        resolved = snapvit.resolve_settings(settings)
        r = get_ranking(ctx, layout, resolved, seed)
        if resolved["variant"] == "authors":  # separate head/neuron cuts of the floored scores
            keep = keep_from_scores(r.scores, layout, sparsity)
        else:
            keep = snapvit.keep_vector(r.order, layout.unit_params(), sparsity)
        masks = snapvit.unit_masks(ctx.model, layout, keep)
        missing = set(weights) - set(masks)
        if missing:
            raise ValueError(f"pruner 'snapvit': scope tensors outside any unit: {sorted(missing)[:3]}")
        return masks
