"""Mask generators (docs/methods.md#pruning-patterns-and-scopes), registered by name.

A mask is {parameter name -> bool tensor of the parameter's shape}, True = keep. Generators see only the
prunable region of each scope entry (a whole tensor, or a row range such as the Q/K rows of qkv) and return
region masks; ``expand_masks`` places them into full-shape masks (True outside the region).
Counts are exact: a tensor of n prunable weights at sparsity s loses exactly floor(s*n + 0.5) of them.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

import torch
import torch.nn as nn

from tasks.registry import Registry
from tasks.store.masks import content_digest
from tasks.models.adapter import ModelAdapter, ScopeEntry


@dataclass
class PruneContext:
    """What a mask generator may look at besides the weights: the model, its scope, unlabeled calibration
    images (for methods that collect activation statistics) and precomputed stage outputs (diagnostics)."""

    model: nn.Module
    adapter: ModelAdapter
    entries: list[ScopeEntry]
    calib_images: torch.Tensor | None = None  # (N, C, H, W), unlabeled
    diagnostics: Mapping[str, Any] = field(default_factory=dict)


def _keep_all_but_smallest(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Bool mask of scores' shape that drops exactly the k smallest (ties: lower flat index first)."""
    flat = scores.flatten()
    order = torch.argsort(flat, stable=True)
    keep = torch.ones_like(flat, dtype=torch.bool)
    keep[order[:k]] = False
    return keep.view_as(scores)


class Pruner:
    """Base class: ``fixed_sparsity`` is not None for patterns that define their own sparsity (N:M)."""

    name = ""
    settings_schema: dict[str, type] = {}
    uses_calibration = False  # True: masks depend on calibration images (their count is part of the mask key)
    seeded_mask = False  # True: the mask depends on the seed (a seeded search): another seed prunes other weights
    quick_settings: dict[str, Any] = {}  # cheap settings for contract tests where the defaults are slow searches

    def check(self, settings: Mapping[str, Any]) -> None:
        for k, v in settings.items():
            if k not in self.settings_schema:
                raise ValueError(f"unknown setting {k!r} for pruner {self.name!r}; allowed: "
                                 f"{', '.join(self.settings_schema) or 'none'}")
            if not isinstance(v, self.settings_schema[k]) or isinstance(v, bool):
                raise ValueError(f"pruner {self.name!r} setting {k!r} must be {self.settings_schema[k].__name__}")

    def resolved_settings(self, settings: Mapping[str, Any]) -> dict[str, Any]:
        """``settings`` with every default filled in: what mask/diagnostics keys and MLflow params record, so a
        changed default never reuses masks computed under the old one (docs/methods.md#run-identity)."""
        return dict(settings)

    def fixed_sparsity(self, settings: Mapping[str, Any]) -> float | None:
        return None

    def check_model(self, model: nn.Module, adapter: ModelAdapter, scope: str, settings: Mapping[str, Any]) -> None:
        """Raise ValueError (naming model, pruner and why) when this pruner cannot serve the model/scope."""

    def tolerance(self, model: nn.Module, entries: list[ScopeEntry]) -> float:
        """Largest |removed weights - sparsity * prunable weights| rounding may cause: half a weight per tensor
        (structured pruners round per channel group and override this)."""
        return 0.5 * len(entries)

    def structured_metrics(self, model: nn.Module, masks: Mapping[str, torch.Tensor], example: torch.Tensor,
                           rounds: int = 20) -> dict[str, float]:
        """Efficiency figures of the physically shrunk model (structured pruners; ``rounds``: timed latency
        rounds at most); default: none."""
        return {}

    def pattern(self, sparsity: float, settings: Mapping[str, Any]) -> str:
        """Human label of the pattern, used as the `pattern` tag in MLflow and reports."""
        return f"{sparsity:g}"

    def __call__(self, weights: Mapping[str, torch.Tensor], sparsity: float, *, seed: int,
                 ctx: PruneContext | None = None, **settings: Any) -> dict[str, torch.Tensor]:
        """weights: {param: prunable region tensor}; returns {param: bool keep-mask of the region's shape}."""
        raise NotImplementedError


PRUNERS: Registry[Pruner] = Registry("pruner", instances=True)


# --- applying masks --------------------------------------------------------------------------------

def region(param: torch.Tensor, entry: ScopeEntry) -> torch.Tensor:
    """The prunable view of a parameter (a row slice for row-range entries)."""
    return param if entry.rows is None else param[entry.rows[0] : entry.rows[1]]


def make_masks(model: nn.Module, entries: list[ScopeEntry], pruner: str, sparsity: float, *, seed: int,
               settings: Mapping[str, Any] | None = None, ctx: PruneContext | None = None) -> dict[str, torch.Tensor]:
    """Run a registered pruner on a model's scope and return full-shape masks (True = keep)."""
    params = dict(model.named_parameters())
    missing = [e.param for e in entries if e.param not in params]
    if missing:
        raise KeyError(f"scope names parameters the model does not have: {missing[:3]}")
    p = PRUNERS.get(pruner)
    settings = dict(settings or {})
    p.check(settings)
    fixed = p.fixed_sparsity(settings)
    region_masks = p({e.param: region(params[e.param], e) for e in entries},
                     fixed if fixed is not None else sparsity, seed=seed, ctx=ctx, **settings)
    return expand_masks(model, entries, region_masks)


def expand_masks(model: nn.Module, entries: list[ScopeEntry], region_masks: Mapping[str, torch.Tensor]
                 ) -> dict[str, torch.Tensor]:
    """Full-shape masks of the scope entries, plus full-shape masks a structured pruner returns for other
    parameters (the biases of removed units). Those are applied and checked like the rest, stay frozen while
    healing (outside the scope) and do not count towards ``achieved_sparsity`` (scope weights only)."""
    params = dict(model.named_parameters())
    out = {}
    for e in entries:
        full = torch.ones_like(params[e.param], dtype=torch.bool)
        region(full, e).copy_(region_masks[e.param])
        out[e.param] = full
    for k, m in region_masks.items():  # companion masks outside the scope (a removed unit's bias): full shape
        if k not in out:
            if k not in params or m.shape != params[k].shape:
                raise ValueError(f"companion mask {k!r} must have the full shape of a model parameter")
            out[k] = m.to(torch.bool).clone()
    return out


def train_masks(model: nn.Module, entries: list[ScopeEntry], masks: Mapping[str, torch.Tensor]
                ) -> dict[str, torch.Tensor]:
    """Entries a healer may change: surviving weights inside the prunable region."""
    params = dict(model.named_parameters())
    out = {}
    for e in entries:
        inside = torch.zeros_like(params[e.param], dtype=torch.bool)
        region(inside, e).fill_(True)
        out[e.param] = inside & masks[e.param]
    return out


@torch.no_grad()
def apply_masks(model: nn.Module, masks: Mapping[str, torch.Tensor]) -> None:
    params = dict(model.named_parameters())
    for k, m in masks.items():
        params[k].mul_(m.to(params[k].device, params[k].dtype))


@torch.no_grad()
def mask_violations(model: nn.Module, masks: Mapping[str, torch.Tensor]) -> int:
    """Number of masked (pruned) entries that are not exactly zero."""
    params = dict(model.named_parameters())
    return int(sum(int((params[k][~m.to(params[k].device)] != 0).sum()) for k, m in masks.items()))


def mask_digest(masks: Mapping[str, torch.Tensor]) -> str:
    """What a mask is, not how it was made (tasks/store/masks.py ``content_digest``: name, shape and kept entries).
    The mask key names the recipe (pruner, settings, seed); two keys with one digest prune the same weights. A
    pruner whose mask depends on the seed (SnapViT's seeded search) gives the seeds of one question different
    digests (analysis/reported.py widens their noise by it)."""
    return content_digest({k: v.detach().to("cpu", torch.bool).numpy() for k, v in masks.items()})


def achieved_sparsity(entries: list[ScopeEntry], masks: Mapping[str, torch.Tensor]) -> float:
    """Fraction of prunable-region weights that are masked."""
    total = pruned = 0
    for e in entries:
        r = region(masks[e.param], e)
        total += r.numel()
        pruned += int((~r).sum())
    return pruned / max(total, 1)
