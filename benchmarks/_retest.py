"""What bench_retest.py compares between two runs of one spec, grid by grid (pure pandas over ``quoted`` frames).

Cells of two runs are matched on (grid, model, pruner, pattern, calibration size, healer, seed rank): the seed's
rank among its grid's seeds, so that run C (seeds shifted: 0 -> 7, or 0, 1, 2 -> 3, 4, 5) pairs seed 7 with 0.
For every grid:

- ``moves``: per searched cell (lr > 0) |delta| of the quoted accuracy, and whether the claimed noise covers it
  (|delta| <= Z * hypot(noise_a, noise_b), ``analysis.reported``); ``fixed_moves``: the same for the cells no
  search healed (closed-form healers such as CR+BN, the unhealed baseline);
- ``orderings``: pairs of cells of one grid, model, calibration size, sparsity and seed whose difference a run
  calls resolved (``analysis.reported.resolved``), and those the other run resolves the opposite way;
- ``verdicts``: the paper-claim lines (``analysis.paired``), per group and pair, in both runs; "holds" in one and
  "reversed" in the other counts as a reversal;
- ``best``: the best pruner x healer lines (``analysis.findings.best_rows``) and whether they agree: a line claims
  its best combo with those it is not resolved from (``claim``), so a different argmax among tied combos is not a
  different claim;
- ``edges``: winners on a search-box edge other than the healing budget (length cap), per run;
- ``band_classes``: the report's band points (``bands.json``: recoverable / transition / collapse per model,
  pruner, healer, calibration size and sparsity, over the seeds' mean) whose class differs between the runs, and
  those of them that a run calls resolved (``analysis.bands.class_resolved``): a resolved class the other run
  contradicts. Closed-form healers (CR+BN) and the unhealed baseline are in it: ``moves`` sees searched cells only.
"""
from __future__ import annotations

import math
from itertools import combinations

import numpy as np
import pandas as pd

KEY = ["grid", "model", "pruner", "pattern", "calib_size", "healer", "seed_rank"]


def keyed(q: pd.DataFrame) -> pd.DataFrame:
    """``q`` (indexed by cell id) with a ``seed_rank`` column and indexed by ``KEY``."""
    q = q.reset_index().copy()
    q["seed_rank"] = q.groupby("grid")["seed"].rank(method="dense").astype(int) - 1
    q["calib_size"] = q["calib_size"].astype(float)
    q.index = pd.MultiIndex.from_frame(q[KEY], names=[f"k_{k}" for k in KEY])  # no column / level ambiguity
    return q.sort_index()


def moves(a: pd.DataFrame, b: pd.DataFrame, grid: str, searched: bool = True) -> dict:
    """``searched``: cells a search healed (lr > 0); else the others (closed-form healers, the unhealed baseline)."""
    from analysis.reported import Z

    pick = (lambda q: (q["grid"] == grid) & ((q["lr"] > 0) == searched))
    sa, sb = a[pick(a)], b[pick(b)]
    common = sorted(set(sa.index) & set(sb.index))
    d = np.array([abs(float(sa.loc[k, "healed_acc"]) - float(sb.loc[k, "healed_acc"])) for k in common]) * 100
    cover = np.array([Z * math.hypot(float(sa.loc[k, "noise"]), float(sb.loc[k, "noise"])) * 100
                      if pd.notna(sa.loc[k, "noise"]) and pd.notna(sb.loc[k, "noise"]) else 0.0 for k in common])
    covered = d <= cover + 1e-9
    worst = sorted(zip(d, cover, common), reverse=True)[:5]
    q = (lambda f: float(f(d)) if len(d) else math.nan)
    return {"cells": len(common), "median": q(np.median), "p90": q(lambda x: np.percentile(x, 90)), "max": q(np.max),
            "over2": int((d > 2).sum()), "over5": int((d > 5).sum()),
            "covered": int(covered.sum()), "coverage": float(covered.mean()) if len(d) else math.nan,
            "worst": [(round(float(x), 2), round(float(c), 2), "/".join(str(v) for v in k[1:])) for x, c, k in worst]}


def _signs(q: pd.DataFrame, grid: str) -> dict:
    """{(model, calib, pattern, seed rank, cell key 1, cell key 2): +1 / -1 / 0 (resolved up / down / not)}."""
    from analysis.reported import resolved

    out = {}
    g = q[q["grid"] == grid]
    for key, h in g.groupby(["model", "calib_size", "pattern", "seed_rank"]):
        rows = list(h.itertuples(index=False))
        for r, s in combinations(sorted(rows, key=lambda r: (r.pruner, r.healer)), 2):
            ok = resolved(float(r.healed_acc), float(r.noise), float(s.healed_acc), float(s.noise))
            out[(*key, (r.pruner, r.healer), (s.pruner, s.healer))] = (
                int(np.sign(r.healed_acc - s.healed_acc)) if ok else 0)
    return out


def orderings(a: pd.DataFrame, b: pd.DataFrame, grid: str) -> dict:
    sa, sb = _signs(a, grid), _signs(b, grid)
    common = set(sa) & set(sb)
    opposite = sorted(k for k in common if sa[k] and sb[k] and sa[k] != sb[k])
    return {"pairs": len(common), "resolved": (sum(bool(sa[k]) for k in common), sum(bool(sb[k]) for k in common)),
            "opposite": len(opposite), "examples": [str(k) for k in opposite[:5]]}


def _verdicts(q: pd.DataFrame, grid: str) -> dict:
    from analysis.ordering import claim_check
    from analysis.paired import _groups, _noise, _values

    out = {}
    g = q[q["grid"] == grid].reset_index(drop=True)
    g = g.assign(seed=g["seed_rank"], mask_key=None)  # seeds shifted in run C: pair on the rank
    for model, m in g.groupby("model"):
        for group, h in _groups(m):
            for a, b, ci, word in claim_check(_values(h), noise=_noise(h)):
                out[(model, str(group["pattern"]), float(group["calib_size"]), a, b)] = (word, round(100 * ci.mean, 2))
    return out


def verdicts(a: pd.DataFrame, b: pd.DataFrame, grid: str) -> dict:
    va, vb = _verdicts(a, grid), _verdicts(b, grid)
    common = sorted(set(va) & set(vb))
    changed = [(str(k), va[k], vb[k]) for k in common if va[k][0] != vb[k][0]]
    flips = [c for c in changed if {c[1][0], c[2][0]} == {"holds", "reversed"}]
    return {"verdicts": len(common), "changed": len(changed), "holds_vs_reversed": len(flips), "examples": changed[:9]}


def claim(row: dict) -> str:
    """What a best line claims: its best combo, with those it is not resolved from ('a ≈ b', by name)."""
    return " ≈ ".join(sorted([row["best"], *row.get("tied", [])]))


def best(a: pd.DataFrame, b: pd.DataFrame, grid: str) -> dict:
    from analysis.findings import best_rows

    def claims(q):
        out = {}
        for model, g in q[q["grid"] == grid].reset_index(drop=True).groupby("model"):
            for r in best_rows(g):
                out[(model, r["calib_size"], r["pattern"])] = (claim(r), r["resolved"], r["best"])
        return out
    ca, cb = claims(a), claims(b)
    common = sorted(set(ca) & set(cb))
    differ = [(str(k), ca[k][:2], cb[k][:2]) for k in common if ca[k][0] != cb[k][0]]
    # two claims contradict when they name no combo in common: each says the best is something the other excludes
    disjoint = [d for d in differ if not set(d[1][0].split(" ≈ ")) & set(d[2][0].split(" ≈ "))]
    return {"lines": len(common), "same": len(common) - len(differ), "contradicted_resolved": len(disjoint),
            "same_top": sum(ca[k][2] == cb[k][2] for k in common), "examples": differ[:5]}


def edge_share(q: pd.DataFrame, grid: str, bounds: dict | None, widened: dict, explored: dict | None = None,
               recovered: set | None = None) -> dict:
    """Searched winners on an edge other than the length cap (the declared healing budget), as the report flags
    them: the declared (or widened) box, less lr edges the cell's search tried past (``explored``), less cells
    whose search stopped at the dense model's accuracy (``recovered``: the report does not flag them)."""
    from analysis.findings import edges

    g = q[(q["grid"] == grid) & (q["lr"] > 0)]
    if not bounds:
        return {"winners": len(g), "edge": None}
    box = (lambda r: widened.get(r["cell_id"]) or bounds.get(grid) or bounds["main"])
    try:
        from analysis.search_space import searched_edges
    except ImportError:  # the analysis of a sweep from before search.converge
        searched_edges = (lambda r, b, e: edges(r, b))
    on = [r for _, r in g.iterrows()
          if r["cell_id"] not in (recovered or set())
          and set(searched_edges(r, box(r), (explored or {}).get(r["cell_id"]))) - {"length_cap"}]
    return {"winners": len(g), "edge": len(on), "share": len(on) / len(g) if len(g) else math.nan}


def band_points(bands_json: dict) -> dict:
    """{(grid, model, pruner, healer, calib, scope, granularity, sparsity): (class, resolved)} from a report's
    ``bands.json``."""
    out = {}
    for model, m in (bands_json.get("models") or {}).items():
        for r in m.get("bands") or []:
            for p in r["points"]:
                key = (r["grid"], model, r["pruner"], r["healer"], str(r["calib_size"]), r.get("scope", ""),
                       r.get("granularity", ""), float(p["sparsity"]))
                out[key] = (p["label"], bool(p.get("resolved", False)))
    return out


def band_classes(a: dict, b: dict, grid: str) -> dict:
    """``a``, ``b``: ``band_points`` of two runs. Points of ``grid`` in both; those whose class differs; those of
    them a run called resolved (a claim the other run contradicts), and those both runs called resolved."""
    common = sorted(k for k in set(a) & set(b) if k[0] == grid)
    differ = [k for k in common if a[k][0] != b[k][0]]
    claimed = [k for k in differ if a[k][1] or b[k][1]]
    return {"points": len(common), "resolved": (sum(a[k][1] for k in common), sum(b[k][1] for k in common)),
            "differ": len(differ), "contradicted": len(claimed),
            "both_resolved": sum(a[k][1] and b[k][1] for k in differ),
            "examples": [("/".join(str(v) for v in k[1:]), a[k], b[k]) for k in claimed[:5]]}
