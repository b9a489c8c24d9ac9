"""Patterns at one sparsity: where a grid prunes to the same sparsity in different patterns (unstructured
magnitude 0.5, N:M 2:4, CORP's 0.5-structured), which pattern heals best and by how much. The best lines compare
pruner × healer combos within one pattern; this is the question they leave out: what a pattern's structure costs
at equal sparsity. Each pattern is represented by its best combo (at that calibration size); leads are paired on
the seed and resolved as in the best lines (analysis/leads.py)."""
from __future__ import annotations

import math

import pandas as pd

from .leads import lead, ranked, values

__all__ = ["matched_lines"]


def matched_lines(gb: pd.DataFrame) -> list[str]:
    """One line per (sparsity, calibration size) that two or more patterns reach, e.g. "At sparsity 0.5 (calib 64), by pattern:
    magnitude 0.5 × starfish 99.7 % · nm 2:4 × starfish 97.2 % -2.50 pp (resolved: 2 noise units = ±1.20 pp)". gb: one row per
    cell of one grid (pattern, sparsity, calib_size, pruner, healer, seed, healed_acc, noise)."""
    if not {"sparsity", "pattern"} <= set(gb.columns):
        return []
    df = gb[gb["healed_acc"].notna() & gb["sparsity"].notna()].copy()
    df["_sp"] = df["sparsity"].astype(float).round(6)
    df["_combo"] = df["pruner"].astype(str) + " " + df["pattern"].astype(str) + " × " + df["healer"].astype(str)
    out = []
    for (sp, n), g in sorted(df.groupby(["_sp", "calib_size"], dropna=False),
                             key=lambda kv: (kv[0][0], float(kv[0][1]) if pd.notna(kv[0][1]) else math.inf)):
        if g["pattern"].astype(str).nunique() < 2:
            continue
        out.append(_line(sp, n, g))
    return out


def _line(sp: float, n, g: pd.DataFrame) -> str:
    # each label's best cell per seed: one pruner listed twice at a pattern (two settings, two scopes) shares a label
    g = g.sort_values("healed_acc", ascending=False).drop_duplicates(["_combo", "seed"])
    vn = values(g, "_combo", "seed")
    order, means = ranked(vn)
    pattern_of = dict(zip(g["_combo"], g["pattern"].astype(str)))
    best_of: dict[str, str] = {}
    for combo in order:  # best first: each pattern's first combo is its best
        best_of.setdefault(pattern_of[combo], combo)
    top, *rest = best_of.values()
    parts = [f"{top} {100 * means[top]:.1f} %"]
    for combo in rest:
        d = lead(vn, top, combo)  # told as COMBO's gap to the best: minus the lead
        gap = "(no shared seed)" if d.mean is None else f"{_signed(-100 * d.mean)} pp{d.interval(-1)} ({d.why()})"
        parts.append(f"{combo} {100 * means[combo]:.1f} % {gap}")
    calib = "–" if pd.isna(n) else str(int(n))
    return f"At sparsity {sp:g} (calib {calib}), by pattern: " + " · ".join(parts) + "."


def _signed(x: float) -> str:
    """x (pp) with its sign, as the best lines write it; "+0.00" for a gap that rounds to 0 (not "-0.00")."""
    return f"{x if abs(x) >= 0.005 else 0.0:+.2f}"
