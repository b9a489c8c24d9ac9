"""Retest: the same spec three times and how much of what the report quotes moves, in EVERY grid.

- run A: the spec as given;
- run B: ``search.sampler_seed`` + 1 (same masks, models, dense targets and re-evaluation seeds: a search that
  converges gives the same numbers);
- run C: the healing seeds shifted (main grid: each seed + ``--shift-main`` (7: 0 -> 7); other grids: + their
  number of seeds (0, 1, 2 -> 3, 4, 5)): new draws of the healing (batch order, re-evaluation seeds) and of a
  seeded mask (SnapViT), same questions. The search points come from the sampler seed: under design ``shared`` run
  C usually tries A's points again (an N:M spec, 2026-12-01: every cell drew A's lattice points), so A vs C
  measures the healing's noise and A vs B the search's;
- run D (``--runs A D``): ``calib_seed`` + 1, another draw of the calibration images at every size (same models,
  seeds and search; new dense targets, and new masks where a pruner reads calibration images): what a report says
  of a tiny calibration set should hold for another set of that size. The noise a report claims includes the draw
  only with ``search.calib_draws`` (the default spec's 2: re-evaluations on other draws, none of which run D shares);
  benchmarks/bench_calib_draw.py measures the draw's spread at fixed hyperparameters.

For A vs B, A vs C and A vs D, per grid (``benchmarks/_retest.py``): per-cell |delta| of the quoted accuracy (median,
p90, max) and how often the claimed noise covers it (|delta| <= 2 hypot(noise_A, noise_B)); orderings between
cells of one seed resolved in opposite directions; paper-claim verdicts that change (and "holds" vs
"reversed"); best pruner x healer lines; band classes (recoverable / transition / collapse) that differ, and
those a run called resolved; and per run the share of winners on a search-box edge other than the
healing budget. Writes ``retest.json`` (every figure) and ``retest.txt`` (what is printed) under ``--out``.

    python benchmarks/bench_retest.py configs/default.yaml --out runs/retest
    python benchmarks/bench_retest.py configs/default.yaml --reuse --out runs/retest   # re-read finished runs

Runs go through the real console script (``healsweep run``), quiet; ``uptime`` is printed before and after.
"""
from __future__ import annotations

import argparse
import copy
import datetime
import io
import json
import math
import sys
from contextlib import redirect_stdout
from pathlib import Path

import numpy as np
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks import _retest  # noqa: E402
from benchmarks._sweeps import REPO, quoted, run_spec, uptime  # noqa: E402


def variant(spec: dict, run: str, seed_step: int, shift_main: int) -> dict:
    s = copy.deepcopy(spec)
    s["name"] = f"{spec.get('name', 'retest')}-{run}"
    if run == "B":
        search = s.setdefault("search", {})  # a spec may leave the search to its defaults
        search["sampler_seed"] = int(search.get("sampler_seed", 0)) + seed_step
    if run == "C":
        s["seeds"] = [int(x) + shift_main for x in s.get("seeds", [0])]
        for g in s.get("grids") or []:
            if g.get("seeds"):
                g["seeds"] = [int(x) + len(g["seeds"]) for x in g["seeds"]]
    if run == "D":
        s["calib_seed"] = int(s.get("calib_seed", 0)) + 1
    return s


def bounds_of(run_dir: Path) -> tuple[dict | None, dict, dict, set]:
    """(search bounds per grid, widened boxes per cell, lr range each cell's search tried, cells whose search
    stopped at the dense model's accuracy)."""
    from analysis.runs import load_trials
    from analysis.search_space import search_bounds, widened_cells
    from analysis.search_stops import RECOVERED, search_stops

    meta = json.loads((run_dir / "sweep.json").read_text())
    trials = load_trials(meta["tracking_uri"], meta["sweep_id"], meta.get("experiment") or "healsweep")
    t = trials[trials["stage"].astype("object").fillna("search") == "search"] if "stage" in trials else trials
    t = t[t["lr"].astype(float) > 0]
    g = t.groupby("cell_id")["lr"]
    explored = {c: (float(lo), float(hi)) for c, lo, hi in zip(g.min().index, g.min().astype(float),
                                                                g.max().astype(float))}
    recovered = {c for c, r in search_stops(run_dir).items() if str(r["reason"]).startswith(RECOVERED)}
    return search_bounds(meta.get("spec")), widened_cells(meta), explored, recovered


def compare_grid(a, b, grid: str, bands_a: dict, bands_b: dict) -> dict:
    return {"moves": _retest.moves(a, b, grid), "fixed_moves": _retest.moves(a, b, grid, searched=False),
            "orderings": _retest.orderings(a, b, grid),
            "verdicts": _retest.verdicts(a, b, grid), "best": _retest.best(a, b, grid),
            "band_classes": _retest.band_classes(bands_a, bands_b, grid)}


def band_points(run_dir: Path) -> dict:
    """The band points the run's report wrote (``bands.json``; none when it has no bands)."""
    path = run_dir / "bands.json"
    return _retest.band_points(json.loads(path.read_text())) if path.is_file() else {}


def show(name: str, grid: str, r: dict) -> None:
    m, o, v, b = r["moves"], r["orderings"], r["verdicts"], r["best"]
    print(f"[{name}] grid {grid}: {m['cells']} searched cells; |delta| median {m['median']:.2f} pp, p90 "
          f"{m['p90']:.2f}, max {m['max']:.2f}; over 2 pp {m['over2']}, over 5 pp {m['over5']}; noise covers "
          f"{m['covered']} of {m['cells']} ({100 * m['coverage']:.1f} %)")
    print(f"    orderings resolved {o['resolved'][0]} / {o['resolved'][1]} of {o['pairs']}; opposite: {o['opposite']} "
          f"{o['examples'][:3]}")
    print(f"    paper-claim verdicts changed {v['changed']} of {v['verdicts']} (holds vs reversed: "
          f"{v['holds_vs_reversed']}); best lines same {b['same']} of {b['lines']} (the same top combo "
          f"{b.get('same_top', '?')}; claims naming no combo in common: {b['contradicted_resolved']})")
    f = r.get("fixed_moves")
    if f and f["cells"]:
        print(f"    cells no search healed (closed-form, none): {f['cells']}; |delta| median {f['median']:.2f} pp, max "
              f"{f['max']:.2f}; noise covers {f['covered']} of {f['cells']}")
        for w in f["worst"][:2]:
            if w[0] > w[1]:
                print("      uncovered move (pp, 2-noise pp, cell)", w)
    c = r.get("band_classes")
    if c and c["points"]:
        print(f"    band classes differ at {c['differ']} of {c['points']} points (resolved {c['resolved'][0]} / "
              f"{c['resolved'][1]}); a resolved class contradicted: {c['contradicted']} (both resolved: "
              f"{c['both_resolved']})")
        for ex in c["examples"][:3]:
            print("      band", ex)
    for ex in v["examples"][:4]:
        print("      verdict", ex)
    for w in m["worst"][:3]:
        print("      move (pp, 2-noise pp, cell)", w)


def report(runs: dict, out: Path) -> dict:
    q = {k: _retest.keyed(quoted(d)) for k, (d, _) in runs.items()}
    pts = {k: band_points(d) for k, (d, _) in runs.items()}
    grids = sorted(set(q["A"]["grid"]), key=lambda g: (g != "main", g))
    res = {"date": datetime.datetime.now().isoformat(timespec="seconds"), "uptime": uptime(),
           "walls_s": {k: w for k, (_, w) in runs.items()}, "runs": {k: str(d) for k, (d, _) in runs.items()},
           "grids": {}}
    for g in grids:
        res["grids"][g] = {"edges": {k: _retest.edge_share(q[k], g, *bounds_of(runs[k][0])) for k in q}}
        for other in [k for k in ("B", "C", "D") if k in q]:
            res["grids"][g][f"A_vs_{other}"] = compare_grid(q["A"], q[other], g, pts["A"], pts[other])
    for g, r in res["grids"].items():
        for name in [k for k in r if k.startswith("A_vs")]:
            show(name, g, r[name])
        print("    winners on a non-budget edge: " + "; ".join(
            f"{k} {e['edge']} of {e['winners']}" for k, e in r["edges"].items()))
    return res


# Two runs over chosen grids (what bench_cpu_kernels.py compares)
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
            out[(grid, model, r["calib_size"], r["pattern"])] = (_retest.claim(r), r["resolved"])
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
    ap.add_argument("--runs", nargs="+", default=["A", "B", "C"], choices=["A", "B", "C", "D"])
    ap.add_argument("--seed-step", type=int, default=1, help="run B: sampler_seed + this")
    ap.add_argument("--shift-main", type=int, default=7, help="run C: main-grid seeds + this")
    ap.add_argument("--out", default=str(REPO / "runs" / "retest"))
    ap.add_argument("--store", default=str(REPO / ".healsweep" / "store"))
    ap.add_argument("--cache", default=str(REPO / ".healsweep" / "models"))
    ap.add_argument("--reuse", action="store_true", help="read run directories that already hold a report")
    a = ap.parse_args(argv)
    out, spec = Path(a.out), yaml.safe_load(Path(a.spec).read_text())
    print("uptime:", uptime(), flush=True)
    runs = {}
    for r in a.runs:
        runs[r] = run_spec(variant(spec, r, a.seed_step, a.shift_main), out / r, a.store, a.cache, a.reuse)
        print(f"run {r}: {runs[r][0]} wall {runs[r][1]:.0f} s; uptime: {uptime()}", flush=True)
    buf = io.StringIO()
    with redirect_stdout(buf):
        res = report(runs, out)
    print(buf.getvalue(), end="")
    (out / "retest.json").write_text(json.dumps(res, indent=1, default=str))
    (out / "retest.txt").write_text(f"{res['date']}  uptime: {res['uptime']}\n" + buf.getvalue())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
