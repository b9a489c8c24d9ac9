"""Sweep-level figures, read back from MLflow (nothing here is a test):

1. dense forward images of a sweep vs the distinct (model, calibration set) images it needs (must be equal),
   and 0 on a rerun against the same store;
2. orchestration overhead: Tune-phase wall time vs (sum of trial compute) / concurrency (goal <= 1.15), plus
   the fixed start-up (models, Ray, dense stage, masks) reported separately.

    python benchmarks/bench_sweep.py                      # runs configs/default.yaml twice on a fresh store
    python benchmarks/bench_sweep.py --runs runs/a runs/b # reads finished run directories instead
"""
from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from mlflow import MlflowClient


def figures(run_dir: Path) -> dict:
    info = json.loads((run_dir / "sweep.json").read_text())
    client = MlflowClient(info["tracking_uri"])
    exp = client.get_experiment_by_name(info["experiment"])
    parent = client.search_runs([exp.experiment_id], f"tags.sweep_id = '{info['sweep_id']}' and "
                                                     "tags.`healsweep.role` = 'sweep'")[0]
    trials = client.search_runs([exp.experiment_id], f"tags.sweep_id = '{info['sweep_id']}' and "
                                                     "tags.`healsweep.role` = 'trial'", max_results=50000)
    spec = info["spec"]
    sizes = [*spec["calib_sizes"], *(n for g in spec.get("grids") or () for n in g.get("calib_sizes") or ())]
    distinct = len(spec["models"]) * max(sizes)  # one calibration set per model, largest size of any grid
    pm = parent.data.metrics
    compute = sum(t.data.metrics.get("trial_seconds", 0.0) for t in trials)
    return {"run": str(run_dir), "trials": len(trials), "dense_forward_images": int(pm["dense_forward_images"]),
            "distinct_images": distinct, "sweep_seconds": pm["sweep_seconds"], "tune_seconds": pm["tune_seconds"],
            "concurrency": int(pm["concurrency"]), "trial_compute_seconds": compute,
            "overhead_ratio": pm["tune_seconds"] / (compute / pm["concurrency"]) if compute else float("nan")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--spec", default="configs/default.yaml")
    ap.add_argument("--cache", default=".healsweep/models")
    ap.add_argument("--runs", nargs="+", type=Path, help="finished run directories to read instead of running")
    a = ap.parse_args()
    if a.runs:
        dirs = a.runs
    else:
        from orchestrator.spec import load_spec
        from orchestrator.sweep.run import run_sweep

        spec = load_spec(a.spec)
        root = Path(tempfile.mkdtemp(prefix="healsweep-bench-"))
        dirs = [run_sweep(spec, root / f"run{i}", root / "store", Path(a.cache), progress=False, report=False).out_dir
                for i in (1, 2)]
    print(f"{'run':<40}{'trials':>7}{'dense img':>10}{'distinct':>9}{'sweep s':>9}{'tune s':>8}{'conc':>5}"
          f"{'Σtrial s':>10}{'tune/(Σ/conc)':>14}")
    for d in dirs:
        f = figures(d)
        print(f"{f['run'][-40:]:<40}{f['trials']:>7}{f['dense_forward_images']:>10}{f['distinct_images']:>9}"
              f"{f['sweep_seconds']:>9.1f}{f['tune_seconds']:>8.1f}{f['concurrency']:>5}"
              f"{f['trial_compute_seconds']:>10.1f}{f['overhead_ratio']:>14.3f}")


if __name__ == "__main__":
    main()
