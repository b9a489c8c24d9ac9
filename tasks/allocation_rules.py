"""Layerwise sparsity allocation rules on numbers alone (layer sizes, shapes, cost tables): no tensors, no torch, so
the report's allocations (analysis/rr.py) are computed in a driver that never imported torch. The rules on weights
(global magnitude, LAMP) and the pruners that apply these are tasks/pruning/ (``allocation_math`` re-exports
everything here).

- ``uniform_sparsities``: every layer at the target.
- ``erk_sparsities``: Erdos-Renyi-Kernel density ∝ sum(dims)/prod(dims), density capped at ``cap`` and floored
  at ``floor``; capped/floored layers are fixed and the rest rescaled, iterated until the budget is exact.
- ``greedy_allocate``: the repairability greedy solver on a candidate grid (raw shift, repair residual, RR).
- ``fit_budget`` and ``allocate_counts``: an allocation scaled to the exact budget, then exact per-layer counts.
"""
from __future__ import annotations

import math
from typing import Mapping, Sequence

CANDIDATE_GRID = (0.70, 0.80, 0.85, 0.90, 0.925, 0.95, 0.975)
_TOL = 1e-12


def n_pruned(numel: int, sparsity: float) -> int:
    """Exact number of weights removed from ``numel`` at ``sparsity`` (round half up; as tasks.pruning)."""
    return int(math.floor(sparsity * numel + 0.5))


def uniform_sparsities(sizes: Mapping[str, int], target: float) -> dict[str, float]:
    return {k: float(target) for k in sizes}


def erk_sparsities(shapes: Mapping[str, tuple[int, ...]], target: float, floor: float = 0.025,
                   cap: float = 1.0) -> dict[str, float]:
    """ERK allocation with exact global budget Σ n_l d_l = (1 - target) Σ n_l (d = density = 1 - sparsity).

    raw_l = sum(shape)/prod(shape); d_l = ε·raw_l for free layers. Layers whose d_l would exceed ``cap`` are
    fixed at ``cap`` (first), else layers below ``floor`` are fixed at ``floor``; ε is re-solved on the rest.
    Each round fixes at least one layer, so this ends within L rounds. Raises ValueError when the floor/cap make
    the target unreachable.
    """
    if not 0.0 <= target <= 1.0:
        raise ValueError(f"target sparsity must be in [0, 1], got {target}")
    if not 0.0 <= floor <= cap <= 1.0:
        raise ValueError(f"ERK needs 0 <= floor <= cap <= 1, got floor={floor}, cap={cap}")
    n = {k: 1 for k in shapes}
    raw = {}
    for k, s in shapes.items():
        for d in s:
            n[k] *= int(d)
        raw[k] = sum(s) / n[k]
    budget = (1.0 - target) * sum(n.values())  # weights to keep
    fixed: dict[str, float] = {}
    while True:
        free = [k for k in shapes if k not in fixed]
        rest = budget - sum(n[k] * d for k, d in fixed.items())
        if not free:
            if abs(rest) > 1e-9 * max(budget, 1.0):
                raise ValueError(f"ERK cannot reach sparsity {target} with density floor {floor} and cap {cap}")
            break
        eps = rest / sum(n[k] * raw[k] for k in free)
        dens = {k: eps * raw[k] for k in free}
        over = [k for k in free if dens[k] > cap]
        under = [k for k in free if dens[k] < floor]
        if over:
            fixed.update({k: cap for k in over})
        elif under:
            fixed.update({k: floor for k in under})
        else:
            fixed.update(dens)
            break
    return {k: 1.0 - fixed[k] for k in shapes}


def greedy_allocate(cost: Mapping[str, Sequence[float]], sizes: Mapping[str, int], grid: Sequence[float],
                    target: float) -> dict[str, float]:
    """Repairability greedy solver (the Relative Repairability paper, Algorithm 1); returns grid values per layer.

    cost[layer][k] = g(layer, grid[k]). Every layer starts at grid[0]; while Σ n_l s_l / Σ n_l < target, promote
    the layer with the smallest q = (g(l, s_{k+1}) - g(l, s_k)) / ((s_{k+1} - s_k)·n_l) (negative q allowed).
    Ties in q: the layer that comes first in ``cost``'s iteration order. A target at or below grid[0] returns
    every layer at grid[0] (the solver never demotes). Raises ValueError if grid[-1] < target (unreachable).
    """
    grid = [float(g) for g in grid]
    if not grid or any(b <= a for a, b in zip(grid, grid[1:])) or grid[0] < 0 or grid[-1] > 1:
        raise ValueError(f"candidate grid must be strictly increasing within [0, 1], got {grid}")
    if target > grid[-1] + _TOL:
        raise ValueError(f"candidate grid {grid} cannot reach target sparsity {target} (its largest value is "
                         f"{grid[-1]})")
    names = list(cost)
    if set(names) != set(sizes):
        raise ValueError("cost and sizes must name the same layers")
    for k in names:
        if len(cost[k]) != len(grid):
            raise ValueError(f"layer {k}: {len(cost[k])} costs for {len(grid)} grid points")
    total = float(sum(sizes[k] for k in names))
    level = {k: 0 for k in names}
    pruned = sum(sizes[k] * grid[0] for k in names)
    while pruned / total < target - _TOL:
        best, best_q = None, None
        for k in names:
            i = level[k]
            if i + 1 >= len(grid):
                continue
            q = (float(cost[k][i + 1]) - float(cost[k][i])) / ((grid[i + 1] - grid[i]) * sizes[k])
            if best_q is None or q < best_q:
                best, best_q = k, q
        assert best is not None  # reachable: checked above
        pruned += sizes[best] * (grid[level[best] + 1] - grid[level[best]])
        level[best] += 1
    return {k: grid[level[k]] for k in names}


def fit_budget(sparsities: Mapping[str, float], sizes: Mapping[str, int], target: float) -> dict[str, float]:
    """Scale an allocation that overshoots the target (greedy steps are discrete; a target below the grid)
    by one common factor so that Σ n_l s_l = target·Σ n_l exactly; layer ratios are kept."""
    total = sum(sizes[k] * sparsities[k] for k in sparsities)
    want = target * sum(sizes[k] for k in sparsities)
    if total <= 0:
        return {k: float(target) for k in sparsities}
    if want > total + 1e-9 * max(want, 1.0):
        raise ValueError(f"allocation prunes {total:.0f} weights, fewer than the target's {want:.0f}")
    f = want / total
    return {k: s * f for k, s in sparsities.items()}


def allocate_counts(sizes: Mapping[str, int], sparsities: Mapping[str, float], total: int) -> dict[str, int]:
    """Integer pruned counts per layer summing exactly to ``total`` (largest remainder; ties: layer order)."""
    names = list(sizes)
    ideal = {k: min(max(sparsities[k], 0.0), 1.0) * sizes[k] for k in names}
    counts = {k: min(int(ideal[k]), sizes[k]) for k in names}
    left = total - sum(counts.values())
    by_rem = sorted(names, key=lambda k: -(ideal[k] - int(ideal[k])))  # stable: layer order on ties
    while left > 0:
        progressed = False
        for k in by_rem:
            if left == 0:
                break
            if counts[k] < sizes[k]:
                counts[k] += 1
                left -= 1
                progressed = True
        if not progressed:
            raise ValueError(f"cannot prune {total} weights from {sum(sizes.values())}")
    while left < 0:  # only from float noise: take back from the smallest remainders
        for k in reversed(by_rem):
            if left == 0:
                break
            if counts[k] > 0:
                counts[k] -= 1
                left += 1
    return counts
