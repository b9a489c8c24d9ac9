"""The first screen's band table: one row per pruner × healer × calibration size with the recoverable, transition
and collapse ranges of its points (hulls when the classes rise with sparsity, the sparsities of each class when they
step back), the grid step at the edges, the seed spread and the CTS band beside it."""
from __future__ import annotations

from dataclasses import dataclass


def fmt_range(lo: float | None, hi: float | None, below: float | None, above: float | None) -> str:
    """'80–90 %' with the grid gap to the neighbours: '(80±5)–90 %' is not readable, so the resolution is
    given separately; here a one-sided range reads '≤ 70 %' / '≥ 95 %' at the ends of the tested grid; "none in
    grid": no tested sparsity is in that class ("none tested" read as if no point had been tested)."""
    if lo is None:
        return "none in grid"
    a, b = f"{100 * lo:g}", f"{100 * hi:g}"
    if below is None and above is None:
        return f"{a}–{b} %" if lo != hi else f"{a} %"
    if below is None:
        return f"up to {b} %" if lo != hi else f"{b} % (lowest tested)"
    if above is None:
        return f"≥ {a} %"
    return f"{a}–{b} %" if lo != hi else f"{a} %"


@dataclass
class Range:
    pruner: str
    healer: str
    calib_size: str
    recoverable: str
    transition: str
    collapse: str
    resolution: str
    seeds: str
    unresolved: str  # sparsities whose band class is within noise of an edge (analysis/reported.py)
    cts: str


def _span(points: list[dict], label: str) -> tuple[float | None, float | None, float | None, float | None]:
    """(lo, hi, previous grid point, next grid point) of the hull of ``label`` points."""
    xs = [p["sparsity"] for p in points]
    hit = [i for i, p in enumerate(points) if p["label"] == label]
    if not hit:
        return None, None, None, None
    i, j = hit[0], hit[-1]
    return xs[i], xs[j], (xs[i - 1] if i > 0 else None), (xs[j + 1] if j + 1 < len(xs) else None)


def ranges(recs: list[dict], cts: dict | None) -> list[Range]:
    """One row per band record: the recoverable/transition/collapse hulls, the grid step at the transition's
    edges and the largest seed std."""
    band = (cts or {}).get("band")
    cts_txt = f"{100 * band['lo']:g}–{100 * band['hi']:g} %" if band else ("none" if cts else "n/a (no CTS)")
    out = []
    for r in recs:
        pts = r["points"]
        spans = {lab: _span(pts, lab) for lab in ("recoverable", "transition", "collapse")}
        xs = [p["sparsity"] for p in pts]
        steps = [round(100 * (b - a), 6) for a, b in zip(xs, xs[1:])]  # pp; 0.9 - 0.85 is not 0.95 - 0.9 in floats
        res = f"grid step {min(steps):g}–{max(steps):g} pp" if steps else "one point"
        if steps and min(steps) == max(steps):
            res = f"grid step {steps[0]:g} pp"
        n = [p["n_seeds"] for p in pts]
        sd = max(p["healed_std"] for p in pts)
        nn = f"n={max(n)}" if min(n) == max(n) else f"n={min(n)}–{max(n)}"
        seeds = "n=1 (no spread)" if max(n) == 1 else f"{nn}, max std {100 * sd:.1f} pp"
        loose = [f"{100 * p['sparsity']:g} %" for p in pts if not p.get("resolved", False)]
        unresolved = "none" if not loose else ", ".join(loose)
        cols = (fmt_range(*spans["recoverable"]), fmt_range(*spans["transition"]), _collapse(spans["collapse"]))
        if not monotone(pts):  # hulls would overlap ('collapse from 50 %' beside 'transition 70 %'): list them
            cols, res = tuple(_listed(pts, lab) for lab in BAND_ORDER), f"{res}; not monotone in sparsity"
        out.append(Range(r["pruner"], r["healer"], str(r["calib_size"]), *cols, res, seeds, unresolved, cts_txt))
    return out


BAND_ORDER = ("recoverable", "transition", "collapse")  # the order the classes take as sparsity rises


def monotone(points: list[dict]) -> bool:
    """Whether the classes of ``points`` (by sparsity) never step back (collapse, then transition, is a step
    back: a healed accuracy that rose with sparsity, or noise)."""
    rank = [BAND_ORDER.index(p["label"]) for p in points]
    return all(a <= b for a, b in zip(rank, rank[1:]))


def _listed(points: list[dict], label: str) -> str:
    """'50 %, 90 %': the sparsities of one class, for a row whose classes are not monotone."""
    xs = [f"{100 * p['sparsity']:g} %" for p in points if p["label"] == label]
    return ", ".join(xs) if xs else "none in grid"


def _collapse(span) -> str:
    lo = span[0]
    return "none in grid" if lo is None else f"from {100 * lo:g} %"
