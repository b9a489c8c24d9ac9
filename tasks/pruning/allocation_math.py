"""Layerwise sparsity allocation rules (docs/methods.md#relative-repairability-crbn-rr, the Relative Repairability
paper), as pure functions.

Every rule maps layers to per-layer sparsities; the registered pruners (tasks/pruning/allocation.py) turn those
into exact per-layer weight counts (``allocate_counts``) and magnitude-prune each layer to its count. The rules on
weights (global magnitude, LAMP) are here; the rules on numbers alone (uniform, ERK, the greedy solver, budget
fitting and exact counts) are tasks/allocation_rules.py, without torch (the report's allocations read them), and
re-exported here.

- ``uniform_sparsities``: every layer at the target.
- ``global_magnitude_sparsities``: one |w| threshold across layers (exact global count).
- ``erk_sparsities``: Erdos-Renyi-Kernel density ∝ sum(dims)/prod(dims), density capped at ``cap`` and floored
  at ``floor``; capped/floored layers are fixed and the rest rescaled, iterated until the budget is exact.
- ``lamp_sparsities``: LAMP score w² / Σ_{|v|≥|w|} v² within each layer, one global threshold on scores.
- ``greedy_allocate``: the repairability greedy solver on a candidate grid (raw shift, repair residual, RR).
"""
from __future__ import annotations

from typing import Mapping

import torch

from tasks.allocation_rules import (CANDIDATE_GRID, allocate_counts, erk_sparsities, fit_budget,  # noqa: F401
                                    greedy_allocate, n_pruned, uniform_sparsities)  # the rules on numbers alone


def _global_threshold_sparsities(scores: Mapping[str, torch.Tensor], target: float) -> dict[str, float]:
    """Drop exactly n_pruned(P, target) smallest scores over all layers (ties: earlier layer, lower flat index
    first); return each layer's resulting sparsity."""
    names = list(scores)
    flat = torch.cat([scores[k].detach().flatten().double() for k in names])  # (P,)
    k = n_pruned(flat.numel(), target)
    order = torch.argsort(flat, stable=True)
    dropped = torch.zeros_like(flat, dtype=torch.bool)
    dropped[order[:k]] = True
    out, start = {}, 0
    for name in names:
        n = scores[name].numel()
        out[name] = float(dropped[start : start + n].sum()) / max(n, 1)
        start += n
    return out


def global_magnitude_sparsities(weights: Mapping[str, torch.Tensor], target: float) -> dict[str, float]:
    return _global_threshold_sparsities({k: w.detach().abs() for k, w in weights.items()}, target)


def lamp_scores(w: torch.Tensor) -> torch.Tensor:
    """LAMP score of every weight of one layer: w² / Σ_{|v| ≥ |w|} v² (ties share the same denominator).

    w: any shape -> scores of the same shape, float64, in (0, 1]; the largest weight scores 1.
    """
    sq = w.detach().flatten().double() ** 2  # (n,)
    vals, order = torch.sort(sq, stable=True)  # ascending
    suffix = torch.flip(torch.cumsum(torch.flip(vals, [0]), 0), [0])  # suffix[i] = Σ_{j>=i} vals[j]
    _, inverse, counts = torch.unique_consecutive(vals, return_inverse=True, return_counts=True)
    starts = torch.cumsum(counts, 0) - counts  # first sorted index of each tie group
    denom = suffix[starts[inverse]]  # Σ over every v with v² >= this value (whole tie group included)
    sorted_scores = torch.where(denom > 0, vals / denom.clamp_min(1e-300), torch.zeros_like(vals))
    out = torch.empty_like(sq)
    out[order] = sorted_scores
    return out.view(w.shape)


def lamp_sparsities(weights: Mapping[str, torch.Tensor], target: float) -> dict[str, float]:
    return _global_threshold_sparsities({k: lamp_scores(w) for k, w in weights.items()}, target)
