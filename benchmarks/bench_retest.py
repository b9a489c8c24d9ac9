"""Retest: the same spec twice, differing only in ``search.sampler_seed`` (same masks, models and dense targets:
one store, one model cache), and how much of what the report quotes moves.

Prints, over the cells whose healer searches (lr > 0) of the chosen grids:
- per-cell |delta| of the quoted accuracy (``analysis.reported.cell_results``: the winner's re-evaluation mean):
  median, p90, max, how many cells move more than 2 pp and more than 5 pp, the share within 2 pp;
- band class agreement (recoverable: retention >= 0.9, else transition/collapse as the report classifies);
- best pruner x healer agreement per (grid, model, calibration size, sparsity), and whether every ordering one
  run calls *resolved* is the same (or not resolved) in the other;
- each run's wall time.

    python benchmarks/bench_retest.py configs/default.yaml --seeds 0 1 --out runs/retest
    python benchmarks/bench_retest.py configs/default.yaml --reuse --out runs/retest   # re-read finished runs

Runs go through the real console script (``healsweep run``), quiet; ``uptime`` is printed before and after.
"""
from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import numpy as np
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks._sweeps import REPO, quoted, run_spec, uptime  # noqa: E402


def run_seed(spec_path: Path, seed: int, out: Path, store: str, cache: str, reuse: bool) -> tuple[Path, float]:
    spec = yaml.safe_load(spec_path.read_text())
    spec.setdefault("search", {})["sampler_seed"] = seed
    spec["name"] = f"{spec.get('name', 'retest')}-seed{seed}"
    return run_spec(spec, out / f"seed{seed}", store, cache, reuse)


def band(row) -> str:
    from analysis.bands import BandSettings, chance_limit, classify

    st = BandSettings()
    lim = chance_limit(row["num_classes"], row["n_eval"], st.z) if "n_eval" in row else math.nan
    return classify(float(row["healed_acc"]), float(row["retention"]), lim, st)


def best_claims(df, grids) -> dict:
    """(grid, model, calib, pattern) -> (best combo, resolved?) from the report's own best-per-sparsity rows."""
    from analysis.findings import best_rows

    out = {}
    for (grid, model), g in df[df["grid"].isin(grids)].reset_index().groupby(["grid", "model"]):
        for r in best_rows(g):
            out[(grid, model, r["calib_size"], r["pattern"])] = (r["best"], r["resolved"])
    return out


def compare(a, b, grids) -> dict:
    """a, b: ``quoted`` frames (indexed by cell id) of the two runs."""
    sa = a[a["grid"].isin(grids) & (a["lr"] > 0)]
    sb = b[b["grid"].isin(grids) & (b["lr"] > 0)]
    cells = sorted(set(sa.index) & set(sb.index))
    d = np.array([abs(float(sa.loc[c, "healed_acc"]) - float(sb.loc[c, "healed_acc"])) for c in cells]) * 100
    bands_agree = sum(band(sa.loc[c]) == band(sb.loc[c]) for c in cells)
    ca, cb = best_claims(a, grids), best_claims(b, grids)
    shared = sorted(set(ca) & set(cb))
    same_best = sum(ca[k][0] == cb[k][0] for k in shared)
    contradicted = [k for k in shared if (ca[k][1] and cb[k][1] and ca[k][0] != cb[k][0])
                    or (ca[k][1] and cb[k][0] != ca[k][0]) or (cb[k][1] and ca[k][0] != cb[k][0])]
    worst = sorted(zip(d, cells), reverse=True)[:5]
    return {"cells": len(cells), "median": float(np.median(d)) if len(d) else math.nan,
            "p90": float(np.percentile(d, 90)) if len(d) else math.nan, "max": float(d.max()) if len(d) else math.nan,
            "over2": int((d > 2).sum()), "over5": int((d > 5).sum()), "within2": float((d <= 2).mean()) if len(d) else 0,
            "bands": f"{bands_agree} of {len(cells)}", "best": f"{same_best} of {len(shared)}",
            "resolved_claims": (sum(ca[k][1] for k in shared), sum(cb[k][1] for k in shared)),
            "contradicted": contradicted,
            "worst": [(round(float(x), 2), c, sa.loc[c, "model"], sa.loc[c, "pruner"], sa.loc[c, "pattern"],
                       int(sa.loc[c, "calib_size"])) for x, c in worst]}


def print_agreement(r: dict) -> None:
    """The last lines of a ``compare``: band class and best-method agreement, contradicted orderings, the largest
    moves."""
    print(f"band class agrees: {r['bands']}; best pruner x healer agrees: {r['best']}")
    print(f"orderings called resolved: {r['resolved_claims'][0]} / {r['resolved_claims'][1]}; "
          f"contradicted by the other run: {len(r['contradicted'])} {r['contradicted'][:5]}")
    print("largest moves (pp, cell, model, pruner, sparsity, calib):")
    for w in r["worst"]:
        print("  ", w)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("spec", nargs="?", default=str(REPO / "configs" / "default.yaml"))
    ap.add_argument("--seeds", type=int, nargs=2, default=[0, 1], help="the two search.sampler_seed values")
    ap.add_argument("--out", default=str(REPO / "runs" / "retest"))
    ap.add_argument("--store", default=str(REPO / ".healsweep" / "store"))
    ap.add_argument("--cache", default=str(REPO / ".healsweep" / "models"))
    ap.add_argument("--grids", nargs="+", default=["main"], help="grids compared (default: main)")
    ap.add_argument("--reuse", action="store_true", help="read run directories that already hold a report")
    a = ap.parse_args(argv)
    print("uptime:", uptime(), flush=True)
    runs = [run_seed(Path(a.spec), s, Path(a.out), a.store, a.cache, a.reuse) for s in a.seeds]
    print("uptime:", uptime())
    for (d, secs), s in zip(runs, a.seeds):
        print(f"sampler_seed {s}: {d} wall {secs:.0f} s")
    r = compare(quoted(runs[0][0]), quoted(runs[1][0]), a.grids)
    print(f"cells compared (grids {', '.join(a.grids)}, searched healers): {r['cells']}")
    print(f"|delta| of the quoted accuracy: median {r['median']:.2f} pp, p90 {r['p90']:.2f} pp, max {r['max']:.2f} pp")
    print(f"cells over 2 pp: {r['over2']}, over 5 pp: {r['over5']}; within 2 pp: {100 * r['within2']:.1f} %")
    print_agreement(r)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
