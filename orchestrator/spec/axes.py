"""The search lattice's axes (docs/methods.md#search-design): log-spaced lr and training-length values. A leaf of
pure functions, here so that the spec's checks count the points a design can try (orchestrator/search/lattice.py
builds the designs' lattice on them)."""
from __future__ import annotations

import math


def log_axis(lo: float, hi: float, k: int, integer: bool = False) -> list[float]:
    """``k`` log-spaced values from ``lo`` to ``hi`` (both included); integers rounded and de-duplicated."""
    if k < 1:
        raise ValueError(f"an axis needs at least one point, got {k}")
    if k == 1 or lo == hi:
        vals = [math.sqrt(lo * hi)]
    else:
        vals = [lo * (hi / lo) ** (i / (k - 1)) for i in range(k)]  # (k,)
    if integer:
        out: list[float] = []
        for v in vals:
            r = int(round(v))
            if not out or r != out[-1]:
                out.append(r)
        return out
    return list(dict.fromkeys(float(f"{v:.6g}") for v in vals))  # printable, the same on every machine; distinct


def axis_sizes(lr: tuple[float, float], length: tuple[int, int], lattice: tuple[int, int]) -> tuple[int, int]:
    """The distinct values of the lr and length axes: ``lattice`` at most, fewer when a box's bounds are equal or
    integer lengths round to the same value (epochs [1, 3] on 5 points: 1, 2, 3)."""
    return len(log_axis(lr[0], lr[1], lattice[0])), len(log_axis(length[0], length[1], lattice[1], integer=True))
