"""The search space as a lattice, and the family surface the ``shared`` design pools its evidence on.

Pure functions (numpy and scipy's QMC only): no Optuna, no Ray. A point of the space is a pair of lattice
indices (i_lr, i_len) into log-spaced axes; a design proposes indices, the searcher turns them into values.

Why a lattice (docs/methods.md#search-design): two runs that differ only in their sampler seed should land on
*the same* configuration when the landscape has one good region, so that their re-evaluations (same healing
seeds) give the same number. Continuous draws never coincide, and a 5 % change of lr moves a healing run as
much as another seed does; a log lattice with steps of ~1.8x in lr is finer than anything the healing noise
resolves on these budgets, and makes "the same optimum" a well-defined event.
"""
from __future__ import annotations

import math
from typing import Callable, Hashable, Mapping, Sequence

import numpy as np

from orchestrator.spec.axes import log_axis  # noqa: F401 - the designs' axes (a spec-layer leaf: the checks count them)


def sobol_points(n: int, sizes: tuple[int, int], seed: int) -> list[tuple[int, int]]:
    """``n`` lattice points (i, j), i < sizes[0], j < sizes[1], from a scrambled Sobol sequence (``seed``):
    a space-filling first wave. The sequence is drawn in powers of two (its balance properties) and cut to n."""
    from scipy.stats import qmc

    m = max(1, math.ceil(math.log2(max(n, 1))))
    u = qmc.Sobol(d=2, scramble=True, seed=seed).random_base2(m)[:n]  # (n, 2) in [0, 1)
    idx = np.floor(u * np.asarray(sizes)).astype(int)  # (n, 2)
    return [(int(a), int(b)) for a, b in np.minimum(idx, np.asarray(sizes) - 1)]


def distinct(points: Sequence[tuple[int, int]], sizes: tuple[int, int],
             taken: Sequence[tuple[int, int]] = ()) -> list[tuple[int, int]]:
    """``points`` with repeats (of each other or of ``taken``) moved to the nearest free lattice point
    (lattice distance, then index order: deterministic)."""
    used = set(taken)
    out = []
    grid = [(i, j) for i in range(sizes[0]) for j in range(sizes[1])]
    for p in points:
        if p in used:
            free = [q for q in grid if q not in used]
            if not free:
                raise ValueError(f"no free lattice point left for {p} (lattice {sizes[0]}x{sizes[1]})")
            p = min(free, key=lambda q: ((q[0] - p[0]) ** 2 + (q[1] - p[1]) ** 2, q))
        used.add(p)
        out.append(p)
    return out


def centred(values: Sequence[float], groups: Sequence[str]) -> np.ndarray:
    """Each value minus the mean of its group (cell): what is left is the effect of the configuration, the cell's
    own level (how hard its sparsity is) removed. (n,) -> (n,). A group of one gives 0 (no within-cell evidence)."""
    v = np.asarray(values, dtype=float)  # (n,)
    g = np.asarray(groups)
    out = np.zeros_like(v)
    for name in dict.fromkeys(groups):
        sel = g == name
        out[sel] = v[sel] - v[sel].mean()
    return out


def features(points: np.ndarray, sizes: tuple[int, int]) -> np.ndarray:
    """Separable quadratic features of lattice points on the unit square: u, v, u², v² (an axis of one point adds
    none). No u·v term: with two points per cell, an interaction fitted from pooled within-cell differences
    bends the surface into a saddle whose high corners are extrapolations (measured on the default sweep: the
    ViT family of sampler seed 1 ranked lr 1e-2 with 4 steps first, 38 pp below the lattice's best cell;
    tests/orchestrator/test_search_contract.py). (n, 2) indices -> (n, k), k <= 4."""
    p = np.asarray(points, dtype=float).reshape(-1, 2)  # (n, 2)
    uv = [p[:, d] / (sizes[d] - 1) for d in range(2) if sizes[d] > 1]  # each (n,)
    cols = uv + [x ** 2 for x in uv]
    return np.stack(cols, axis=1) if cols else np.zeros((len(p), 0))  # (n, k)


def surface(points: Sequence[tuple[int, int]], values: Sequence[float], groups: Sequence[str],
            sizes: tuple[int, int], ridge: float = 1e-3) -> np.ndarray:
    """The family surface: a separable quadratic in (log lr, log length) (an lr effect plus a length effect, each
    quadratic: ``features``) fitted to every cell's results at once, each cell
    with its own level (fixed effects: features and values are centred within the cell, so only differences
    between configurations *inside* a cell inform the shape). Ridge ``ridge`` x n keeps it defined when the
    points do not span every term. Extrapolates to the lattice's edges and corners, where optima often sit.

    points (n, 2), values (n,), groups (n,) -> (sizes[0], sizes[1]) of predicted effects (larger is better)."""
    grid = np.array([(i, j) for i in range(sizes[0]) for j in range(sizes[1])])  # (a*b, 2)
    if not len(points):
        return np.zeros(sizes)
    x = features(np.asarray(points), sizes)  # (n, k)
    if x.shape[1] == 0:
        return np.zeros(sizes)
    xc = np.stack([centred(x[:, k], groups) for k in range(x.shape[1])], axis=1)  # (n, k)
    yc = centred(values, groups)  # (n,)
    beta = np.linalg.solve(xc.T @ xc + ridge * max(len(yc), 1) * np.eye(x.shape[1]), xc.T @ yc)  # (k,)
    return (features(grid, sizes) @ beta).reshape(sizes)  # (a, b)


def ranked(surf: np.ndarray) -> list[tuple[int, int]]:
    """Lattice points best first; ties to the cheaper length (lower j), then the lower lr (lower i)."""
    a, b = surf.shape
    return sorted(((i, j) for i in range(a) for j in range(b)), key=lambda q: (-round(float(surf[q]), 12), q[1], q[0]))


def residual_sd(points, values, groups, sizes) -> float:
    """Std of one draw around the family surface (within-cell residuals; dof: n - cells - terms); NaN if < 1 dof."""
    if not len(points):
        return math.nan
    x = features(np.asarray(points), sizes)  # (n, k)
    xc = np.stack([centred(x[:, k], groups) for k in range(x.shape[1])], axis=1) if x.shape[1] else x
    yc = centred(values, groups)  # (n,)
    beta = np.linalg.solve(xc.T @ xc + 1e-3 * len(yc) * np.eye(x.shape[1]), xc.T @ yc) if x.shape[1] else []
    r = yc - (xc @ beta if x.shape[1] else 0.0)  # (n,)
    dof = len(yc) - len(set(groups)) - x.shape[1]
    return float(math.sqrt(float(r @ r) / dof)) if dof >= 1 else math.nan


def plateau_centre(tied: Sequence[bool], anchor: int) -> tuple[int, int]:
    """The tried points of one length in lr order, ``tied[k]``: point k is not resolved worse than the cell's best;
    ``anchor``: the best point's position. -> (position of the centre of the run of tied points around the anchor,
    the run's length). An even run: of its two middle points the one nearer the anchor (a run of 2 keeps it).
    E.g. tied [F, T, T, T, T], anchor 4 -> (3, 4): the run 1..4, centre 2.5, 3 is nearer the anchor."""
    lo = hi = anchor
    while lo > 0 and tied[lo - 1]:
        lo -= 1
    while hi < len(tied) - 1 and tied[hi + 1]:
        hi += 1
    mid = (lo + hi) / 2
    return (int(mid) if mid == int(mid) else (math.ceil(mid) if anchor > mid else math.floor(mid))), hi - lo + 1


def draw_sd(p: float, n: float, floor: float) -> float:
    """The noise of one draw of an accuracy ``p`` over ``n`` images: its binomial std sqrt(p (1 - p) / n), at least
    ``floor``."""
    p = min(max(p, 0.0), 1.0)
    return max(floor, math.sqrt(p * (1 - p) / n))


def resolved_worse(a: float, b: float, n: float, floor: float, z: float = 2.0) -> bool:
    """Accuracy ``b`` resolved worse than accuracy ``a`` (both over ``n`` images; larger = better): a - b exceeds
    ``z`` noise units of the difference, hypot(draw_sd(a), draw_sd(b))."""
    return a - b > z * math.hypot(draw_sd(a, n, floor), draw_sd(b, n, floor))


def plateau_pick(means: Mapping[tuple[Hashable, int], float], first: Mapping[tuple[Hashable, int], int],
                 tied: Callable[[float, float], bool]) -> tuple[Hashable, int]:
    """The point a cell quotes (search.converge's ``pick``, orchestrator/search/pick.py): ``means``: tried point
    (lr key, ordered like the lr; length) -> its mean result over its draws (larger = better); ``first``: point ->
    the number of its first trial; ``tied(top, v)``: v is not resolved worse than the best mean ``top``.
    At the length of the best point, the centre of the run of tied points around it in lr order
    (``plateau_centre``); best points tied exactly at several lengths: the longest run, then the cheaper length,
    then the earlier trial."""
    top = max(means.values())
    runs = []
    for k in (k for k in means if means[k] >= top - 1e-12):  # the best point(s)
        row = sorted(p for p in means if p[1] == k[1])  # the points tried at its length, in lr order
        centre, size = plateau_centre([tied(top, means[p]) for p in row], row.index(k))
        runs.append((-size, k[1], first[k], row[centre]))
    return min(runs)[3]
