"""Regret of the default search against an oracle: for a handful of cells (both reference models, magnitude pruning,
sparsity 0.85 and 0.9, both calibration sizes: 8 cells, the
issue #24 cells), every point of a dense (lr, steps) grid is healed
(``search.design: grid``; its winner re-evaluated on the same fresh healing seeds as every design), and the sweep's
quoted number is compared with the oracle's:

    regret(cell) = oracle's quoted accuracy - the sweep's quoted accuracy    (pp; > 0: the search missed something)

The sweep's numbers come from its own run(s) of the same cells (cell ids are content keys, the same in any spec):
``--runs DIR [DIR ...]`` reads finished sweeps (e.g. the two runs of bench_retest.py), else the default spec's
search is run here on these cells alone.

    python benchmarks/bench_regret.py --runs runs/retest/seed0 runs/retest/seed1 --out runs/regret
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks._sweeps import REPO, quoted, run_spec, uptime  # noqa: E402


SPARSITIES = [0.85, 0.9]   # the cells where issue #24 measured the old search missing most


def cells_spec(default: dict, name: str, search: dict) -> dict:
    """The default spec restricted to magnitude x starfish on the regret cells (same models, data, heal settings)."""
    heal = [h for h in default["healers"] if (h if isinstance(h, str) else h["name"]) == "starfish"]
    return {"name": name, "dataset": default.get("dataset", "digits"), "data_seed": default.get("data_seed", 0),
            "models": default["models"], "sparsities": SPARSITIES, "calib_sizes": default["calib_sizes"],
            "pruners": ["magnitude"], "healers": heal, "seeds": [0], "heal": default.get("heal", {}),
            "store": default.get("store", {}), "resources": default.get("resources", {}),
            "search": {**default["search"], **search}}


def run(spec: dict, out: Path, store: str, cache: str, reuse: bool) -> Path:
    run_dir, secs = run_spec(spec, out / spec["name"], store, cache, reuse)
    print(f"{spec['name']}: {secs:.0f} s", flush=True)
    return run_dir


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--spec", default=str(REPO / "configs" / "default.yaml"), help="whose models, data and search")
    ap.add_argument("--runs", nargs="*", default=[], help="finished sweeps holding these cells (default: run one)")
    ap.add_argument("--lattice", type=int, nargs=2, default=[9, 5], help="oracle grid: lr points, steps points")
    ap.add_argument("--out", default=str(REPO / "runs" / "regret"))
    ap.add_argument("--store", default=str(REPO / ".healsweep" / "store"))
    ap.add_argument("--cache", default=str(REPO / ".healsweep" / "models"))
    ap.add_argument("--reuse", action="store_true", help="read run directories that already hold a report")
    a = ap.parse_args(argv)
    default = yaml.safe_load(Path(a.spec).read_text())
    out = Path(a.out)
    print("uptime:", uptime(), flush=True)
    oracle = quoted(run(cells_spec(default, "oracle", {"design": "grid", "lattice": list(a.lattice)}), out, a.store,
                        a.cache, a.reuse))
    sweeps = [Path(r) for r in a.runs] or [run(cells_spec(default, "sweep", {}), out, a.store, a.cache, a.reuse)]
    print("uptime:", uptime())
    print(f"oracle: {a.lattice[0]} x {a.lattice[1]} grid of (lr, steps) per cell, winner re-evaluated")
    print("cell          model          sparsity calib  oracle %  " + "  ".join(f"run{i} %  regret" for i in range(len(sweeps))))
    regrets = []
    for s in sweeps:
        q = quoted(s)
        regrets.append({c: 100 * (oracle.loc[c, "healed_acc"] - q.loc[c, "healed_acc"]) for c in oracle.index
                        if c in q.index})
    for c in oracle.index:
        r = oracle.loc[c]
        row = f"{c}  {r['model']:<14} {r['pattern']:<8} {int(r['calib_size']):<5}  {100 * r['healed_acc']:7.2f}  "
        for s, reg in zip(sweeps, regrets):
            row += (f"  {100 * quoted(s).loc[c, 'healed_acc']:6.2f}  {reg[c]:+6.2f}" if c in reg else "   (absent)   ")
        print(row)
    allr = np.array([v for reg in regrets for v in reg.values()])
    if len(allr):
        print(f"regret over {len(allr)} cell runs: median {np.median(allr):.2f} pp, max {allr.max():.2f} pp, "
              f"mean {allr.mean():.2f} pp (negative: the sweep's quoted number above the oracle's, i.e. noise)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
