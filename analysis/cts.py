"""Calibration transition score (CTS, docs/methods.md#calibration-transition-score-and-bands, the Relative
Repairability paper §5.3) from RR diagnostics alone.

Inputs are the per-layer RR curves R_ℓ(s) on the candidate grid (the diagnostics table of a sweep);
no accuracy is read. Pure numpy; allocations are passed in as callables so this module never
needs the allocation solvers (``analysis.rr`` wires in ``tasks.allocation_rules``).

Definitions (all over an ascending list of target sparsities s_1 < ... < s_K):

- J_RR(A) = (1/L) Σ_ℓ R_ℓ(s_ℓ). R_ℓ is evaluated by **linear interpolation** on the candidate grid
  with the anchor R_ℓ(0) = 1 (nothing pruned: D_raw = D_repair = 0 so R = ε/ε) and clamped to the
  last grid value above the grid. The Relative Repairability paper's strict version recomputes R at off-grid sparsities; that needs
  the model and calibration data, so it is out of scope for the analysis side (RR allocations from the
  greedy solver lie on the grid exactly; only ERK's off-grid sparsities are interpolated).
- G(s) = J_RR(A_s^ERK) − J_RR(A_s^RR).
- T(s) = clip((J_RR(A_s^RR) − J_RR(A_low^RR)) / (J_RR(A_high^RR) − J_RR(A_low^RR) + ε), 0, 1).
- CTS(s) = G(s)·T(s). CTS̄ = 3-point moving average; at the two ends of the sweep the window is
  truncated (mean of the 2 available points), so CTS̄ has the same length as CTS.
- B = max CTS̄(s) over the low-sparsity anchors, defined as the targets s ≤ s_low (0 if there are none).
- Core (α = 0.7) / broad band (α = ``alpha_band``): the longest contiguous run of targets with
  CTS̄ ≥ B + α (max CTS̄ − B). Equal-length runs: the one with the larger peak CTS̄, then the lower
  sparsity. No core/band (None) when max CTS̄ − B ≤ ``tol`` (a flat curve, or nothing above baseline).
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Callable, Mapping, Sequence

import numpy as np

__all__ = ["CTSSettings", "interp_r", "j_rr", "smooth3", "longest_run", "band_interval",
           "cts_from_objectives", "compute_cts", "DEFAULT_TARGETS"]

# Target sparsities of the calibration sweep: 0.80 ... 0.975 in 0.5-point steps.
DEFAULT_TARGETS = tuple(round(0.80 + 0.005 * i, 4) for i in range(36))


@dataclass(frozen=True)
class CTSSettings:
    s_low: float = 0.90
    s_high: float = 0.975
    alpha_core: float = 0.7
    alpha_band: float = 0.4  # paper gives no value for the broad band
    eps: float = 1e-8
    tol: float = 1e-12
    targets: tuple[float, ...] = DEFAULT_TARGETS

    def to_dict(self) -> dict:
        return asdict(self)


def interp_r(r: np.ndarray, grid: Sequence[float], s: np.ndarray) -> np.ndarray:
    """R_ℓ(s_ℓ) per layer. r: (L, K) on ascending ``grid`` (K,); s: (L,) -> (L,)."""
    g = np.asarray(grid, dtype=np.float64)
    r = np.asarray(r, dtype=np.float64)
    s = np.asarray(s, dtype=np.float64)
    if r.ndim != 2 or r.shape[1] != g.size or s.shape != (r.shape[0],):
        raise ValueError(f"interp_r: shapes r {r.shape}, grid {g.shape}, s {s.shape} do not match")
    xs = np.concatenate([[0.0], g]) if g[0] > 0 else g
    out = np.empty(r.shape[0])
    for i in range(r.shape[0]):
        ys = np.concatenate([[1.0], r[i]]) if g[0] > 0 else r[i]
        out[i] = np.interp(s[i], xs, ys)  # clamps to ys[-1] above the grid
    return out


def j_rr(r: np.ndarray, grid: Sequence[float], layers: Sequence[str], alloc: Mapping[str, float]) -> float:
    """J_RR(A) = mean over layers of R_ℓ(A[ℓ]). r: (L, K) in the order of ``layers``."""
    s = np.array([float(alloc[name]) for name in layers])
    return float(interp_r(r, grid, s).mean())


def smooth3(x: Sequence[float]) -> np.ndarray:
    """3-point moving average; the ends average the 2 available points. (K,) -> (K,)."""
    x = np.asarray(x, dtype=np.float64)
    if x.size <= 1:
        return x.copy()
    out = np.empty_like(x)
    for i in range(x.size):
        out[i] = x[max(0, i - 1): i + 2].mean()
    return out


def longest_run(flags: Sequence[bool], score: Sequence[float]) -> tuple[int, int] | None:
    """Inclusive index range of the longest run of True; ties: larger max score, then earliest."""
    best, best_key, start = None, None, None
    flags = list(flags) + [False]
    for i, f in enumerate(flags):
        if f and start is None:
            start = i
        elif not f and start is not None:
            key = (i - start, max(score[start:i]))
            if best_key is None or key[0] > best_key[0] or (key[0] == best_key[0] and key[1] > best_key[1]):
                best, best_key = (start, i - 1), key
            start = None
    return best


def band_interval(s: Sequence[float], smoothed: Sequence[float], alpha: float, s_low: float,
                  tol: float = 1e-12) -> dict | None:
    """``{"lo", "hi", "threshold", "baseline"}`` of the longest run with CTS̄ ≥ B + α(max − B), or None."""
    s = np.asarray(s, dtype=np.float64)
    c = np.asarray(smoothed, dtype=np.float64)
    low = c[s <= s_low + 1e-12]
    base = float(low.max()) if low.size else 0.0
    peak = float(c.max()) if c.size else -math.inf
    if not c.size or peak - base <= tol:
        return None
    thr = base + alpha * (peak - base)
    run = longest_run(c >= thr - tol, c)
    if run is None:
        return None
    return {"lo": float(s[run[0]]), "hi": float(s[run[1]]), "threshold": thr, "baseline": base}


def cts_from_objectives(s: Sequence[float], j_rr_rr: Sequence[float], j_rr_erk: Sequence[float],
                        j_low: float, j_high: float, st: CTSSettings = CTSSettings()) -> dict:
    """G, T, CTS, CTS̄, core and band from J_RR values at ascending targets ``s`` (all (K,))."""
    s = np.asarray(s, dtype=np.float64)
    if np.any(np.diff(s) <= 0):
        raise ValueError("cts: target sparsities must be strictly ascending")
    jr, je = np.asarray(j_rr_rr, dtype=np.float64), np.asarray(j_rr_erk, dtype=np.float64)
    g = je - jr
    t = np.clip((jr - j_low) / (j_high - j_low + st.eps), 0.0, 1.0)
    cts = g * t
    sm = smooth3(cts)
    return {"s": s.tolist(), "J_rr": jr.tolist(), "J_erk": je.tolist(), "J_low": float(j_low),
            "J_high": float(j_high), "G": g.tolist(), "T": t.tolist(), "CTS": cts.tolist(),
            "CTS_smooth": sm.tolist(),
            "core": band_interval(s, sm, st.alpha_core, st.s_low, st.tol),
            "band": band_interval(s, sm, st.alpha_band, st.s_low, st.tol),
            "settings": st.to_dict()}


def compute_cts(r: np.ndarray, grid: Sequence[float], layers: Sequence[str],
                alloc_rr: Callable[[float], Mapping[str, float]],
                alloc_erk: Callable[[float], Mapping[str, float]],
                st: CTSSettings = CTSSettings()) -> dict:
    """CTS over ``st.targets`` from RR curves r (L, K) and the two allocation rules."""
    targets = sorted(set(float(x) for x in st.targets))
    jr = [j_rr(r, grid, layers, alloc_rr(x)) for x in targets]
    je = [j_rr(r, grid, layers, alloc_erk(x)) for x in targets]
    j_low = j_rr(r, grid, layers, alloc_rr(st.s_low))
    j_high = j_rr(r, grid, layers, alloc_rr(st.s_high))
    return cts_from_objectives(targets, jr, je, j_low, j_high, st)
