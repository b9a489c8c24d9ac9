"""What a smaller per-cell cap would save and what it would change, replayed from a finished ``search.converge`` run.

Issue 34 asks for a converging search whose sweep costs at most 1.5x the fixed design's wall. The lever left is the
per-cell cap (``search.trials_per_cell``): 39 of 45 searched cells of grid ``healers`` and 23 of 50 of the main grid
reach the default converge spec's cap of 8. This replays smaller caps exactly, without rerunning: a cell's wave is
decided from the family's first ``family_waves`` waves and the cell's own earlier trials only
(orchestrator/search/converge.py), so a run with cap K would have tried exactly the first K search trials of this
run, in the same order. For every grid and cap K it prints:

- the search trials and trial-seconds (``trial_seconds`` of each trial run) that cap K would not have run, also as a
  share of the whole sweep's trial-seconds (the wall follows them: ~93 % of 2 slots are busy in both designs);
- the cells whose quoted configuration (rule 4's plateau pick, ``lattice.plateau_pick``; ``--best`` for the best
  draw) would differ, and by how much the full run's pick leads the cut one, in mean selection accuracy over the
  two picks' search draws (pp). Those cells would also get other re-evaluations, which no replay can know.

Per grid with several seeds, the *siblings*: cells that differ only in their seed search the same landscape
independently (the seed orders the calibration batches), so how often they quote the same configuration measures
the search's own noise inside one run; and whether one search pooled over the siblings, replayed from its first k
trials of each, would quote what all of their trials pooled quote (a shared search with fewer trials: a lower bound,
since a real one would place its trials on the pooled evidence).

And, per grid, the noise the search's rules assume against the noise a draw has: the sample std of each cell's
re-evaluations (one configuration, different healing seeds) over the binomial std of one draw, sqrt(p (1 - p) / n)
at least ``min_noise`` (``lattice.draw_sd``), which rules 1-4 use.

    python benchmarks/bench_cap_replay.py RUN_DIR [--caps 4 5 6 7] [--json OUT.json]
"""
from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pandas as pd

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from orchestrator.search import lattice  # noqa: E402
from orchestrator.spec.schema import Converge  # noqa: E402


def load(run_dir: Path) -> pd.DataFrame:
    from analysis.runs import load_trials

    meta = json.loads((run_dir / "sweep.json").read_text())
    df = load_trials(meta["tracking_uri"], meta["sweep_id"], meta.get("experiment") or "healsweep")
    return df[df["status"] == "FINISHED"]


def points(rows: pd.DataFrame) -> list[tuple[float, int]]:
    """Each trial's (lr, length): optimizer steps, or epochs where the search tried epochs."""
    return [(float(lr), int(n)) for lr, n in zip(rows["lr"], rows["steps"].fillna(rows["epochs"]))]


def by_point(rows: pd.DataFrame, column: str) -> dict[tuple[float, int], list[float]]:
    """(lr, length) -> ``column`` of the trials tried there."""
    out: dict[tuple[float, int], list[float]] = {}
    for k, v in zip(points(rows), rows[column].astype(float)):
        out.setdefault(k, []).append(float(v))
    return out


def means_of(rows: pd.DataFrame) -> dict[tuple[float, int], float]:
    """(lr, length) -> mean selection accuracy of the trials tried there."""
    return {k: float(np.mean(v)) for k, v in by_point(rows, "selection_acc").items()}


def quoted_point(search: pd.DataFrame, min_noise: float, best: bool) -> tuple:
    """The (lr, length) a cell with these search trials quotes: rule 4's plateau pick (or its best draw)."""
    means = means_of(search)
    first = {k: int(min(v)) for k, v in by_point(search, "optuna_trial").items()}
    if best:  # the best draw, ties to the cheaper length, then the first trial (SearchDesign.winner)
        top = {k: max(v) for k, v in by_point(search, "selection_acc").items()}
        return min(means, key=lambda k: (-top[k], k[1], first[k]))
    n = float(search["n_selection"].max())
    return lattice.plateau_pick(means, first, lambda top, v: not lattice.resolved_worse(top, v, n, min_noise, 1.0))


def searched(df: pd.DataFrame) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(search trials of the cells that were re-evaluated, their re-evaluations)."""
    again = df[df["stage"] == "reevaluate"]
    return df[(df["stage"] == "search") & df["cell_id"].isin(set(again["cell_id"]))], again


def replay(df: pd.DataFrame, caps: list[int], min_noise: float, best: bool) -> dict:
    """grid -> {cells, search trials, search trials per cell -> cells, cap -> {saved trials, saved trial-s, share of
    the sweep's trial-s, picks changed, their leads (pp)}}."""
    total = float(df["trial_seconds"].sum())
    s, _ = searched(df)
    out: dict = {}
    for grid, g in s.groupby("grid"):
        cells = {cid: c.sort_values("optuna_trial") for cid, c in g.groupby("cell_id")}
        full = {cid: quoted_point(c, min_noise, best) for cid, c in cells.items()}
        per = Counter(len(c) for c in cells.values())
        row = {"cells": len(cells), "search_trials": int(len(g)), "trials_per_cell": dict(sorted(per.items()))}
        for k in caps:
            cut = g[g["optuna_trial"] >= k]
            changed = []
            for cid, c in cells.items():
                part = quoted_point(c[c["optuna_trial"] < k], min_noise, best)
                if full[cid] != part:
                    m = means_of(c)
                    changed.append(round(100 * (m[full[cid]] - m[part]), 2))
            row[k] = {"saved_trials": int(len(cut)), "saved_trial_s": round(float(cut["trial_seconds"].sum()), 1),
                      "saved_share": round(float(cut["trial_seconds"].sum()) / total, 3),
                      "picks_changed": len(changed), "lead_pp": sorted(changed, reverse=True)}
        out[str(grid)] = row
    return out


def noise(df: pd.DataFrame, min_noise: float) -> dict:
    """grid -> the re-evaluations' seed std over the binomial std of one draw (cells with >= 2 re-evaluations)."""
    out = {}
    r = df[df["stage"] == "reevaluate"]
    for grid, g in r.groupby("grid"):
        ratios = []
        for _, c in g.groupby("cell_id"):
            v = c["selection_acc"].astype(float).to_numpy()  # (k,) one configuration, k healing seeds
            if len(v) >= 2:
                ratios.append(float(np.std(v, ddof=1)) / lattice.draw_sd(float(v.mean()), float(c["n_selection"].max()),
                                                                          min_noise))
        a = np.array(ratios)
        out[str(grid)] = {"cells": len(a), "median": round(float(np.median(a)), 2),
                          "p90": round(float(np.percentile(a, 90)), 2), "max": round(float(a.max()), 2),
                          "over_2x": int((a > 2).sum())}
    return out


IDENTITY = ["grid", "model", "pruner", "sparsity", "scope", "pattern", "calib_size", "healer"]


def siblings(df: pd.DataFrame, min_noise: float, ks=(3, 4, 5, 6)) -> dict:
    """grid -> {groups of >= 2 sibling cells, how many distinct configurations their re-evaluations heal: count,
    pooled first-k-each pick == pooled all pick: count per k}."""
    s, again = searched(df)
    out: dict = {}
    for grid, g in s.groupby("grid"):
        distinct, same = Counter(), Counter()
        groups = [x for _, x in g.fillna({"scope": "", "pattern": ""}).groupby(IDENTITY[1:]) if x["seed"].nunique() > 1]
        for x in groups:
            distinct[len(set(points(again[again["cell_id"].isin(set(x["cell_id"]))])))] += 1
            full = quoted_point(x, min_noise, False)
            for k in ks:
                same[k] += quoted_point(x[x["optuna_trial"] < k], min_noise, False) == full
        if groups:
            out[str(grid)] = {"groups": len(groups), "distinct_quoted": dict(sorted(distinct.items())),
                              "pooled_first_k_same": {k: same[k] for k in ks}}
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("run_dir", type=Path, help="a finished sweep's run directory (search.converge)")
    ap.add_argument("--caps", type=int, nargs="+", default=[4, 5, 6, 7])
    ap.add_argument("--min-noise", type=float, default=Converge().min_noise)
    ap.add_argument("--best", action="store_true", help="compare best draws, not rule 4's plateau picks")
    ap.add_argument("--json", type=Path)
    a = ap.parse_args(argv)
    df = load(a.run_dir)
    total = float(df["trial_seconds"].sum())
    res = {"run_dir": str(a.run_dir), "trials": int(len(df)), "trial_s": round(total, 1),
           "replay": replay(df, a.caps, a.min_noise, a.best), "siblings": siblings(df, a.min_noise),
           "noise": noise(df, a.min_noise)}
    print(f"{a.run_dir}: {res['trials']} trials, {total:.0f} trial-s")
    for grid, row in res["replay"].items():
        print(f"grid {grid}: {row['cells']} searched cells, {row['search_trials']} search trials, "
              f"search trials per cell -> cells: {row['trials_per_cell']}")
        for k in a.caps:
            r = row[k]
            print(f"  cap {k}: saves {r['saved_trials']} trials, {r['saved_trial_s']:.0f} trial-s "
                  f"({100 * r['saved_share']:.1f} % of the sweep); picks changed {r['picks_changed']} of {row['cells']}"
                  f"; full run's pick leads by (pp) {r['lead_pp']}")
    for grid, sib in res["siblings"].items():
        print(f"grid {grid}: {sib['groups']} groups of sibling cells (only the seed differs); distinct configurations "
              f"their re-evaluations heal -> groups: {sib['distinct_quoted']}; one search pooled over the siblings, "
              f"first k trials of each, quotes what all pooled quote (k -> groups): {sib['pooled_first_k_same']}")
    for grid, n in res["noise"].items():
        print(f"grid {grid}: re-evaluations' seed std / binomial std of a draw, {n['cells']} cells: median "
              f"{n['median']}, p90 {n['p90']}, max {n['max']}; over 2x in {n['over_2x']}")
    if a.json:
        a.json.write_text(json.dumps(res, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
