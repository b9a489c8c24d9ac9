"""Orchestration overhead (issue 6), read back from MLflow through bench_sweep.figures:

1. sweep efficiency: Tune-phase wall time / (sum of trial compute / concurrency), goal <= 1.15 (start-up:
   models, Ray, dense stage, masks, reported separately as sweep_seconds - tune_seconds), with and without
   Tune actor reuse;
2. MLflow logging overhead per trial: driver time spent in the logging callbacks (enqueueing) and the
   background writer's time, both as a fraction of the mean trial time (goal <= 3%).

    python benchmarks/bench_orchestration.py --spec configs/tiny.yaml --cache .healsweep/models --num-cpus 2
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_sweep import figures  # noqa: E402


def logging_figures(run_dir: Path) -> dict:
    from mlflow import MlflowClient

    info = json.loads((run_dir / "sweep.json").read_text())
    client = MlflowClient(info["tracking_uri"])
    pm = client.get_run(info["parent_run_id"]).data.metrics
    return {k: pm[k] for k in ("mlflow_callback_seconds", "mlflow_writer_seconds", "mlflow_flush_seconds",
                               "trials_run")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--spec", default="configs/tiny.yaml")
    ap.add_argument("--cache", default=".healsweep/models")
    ap.add_argument("--num-cpus", type=int, default=2)
    a = ap.parse_args()
    from orchestrator.spec import load_spec
    from orchestrator.sweep.run import run_sweep

    spec = load_spec(a.spec)
    root = Path(tempfile.mkdtemp(prefix="healsweep-orch-bench-"))
    rows = []
    for reuse in (True, False):
        s = replace(spec, resources=replace(spec.resources, reuse_actors=reuse))
        d = run_sweep(s, root / f"reuse-{reuse}", root / "store", Path(a.cache), progress=False, report=False,
                      num_cpus=a.num_cpus).out_dir
        f, lg = figures(d), logging_figures(d)
        mean_trial = f["trial_compute_seconds"] / max(f["trials"], 1)
        rows.append((reuse, f, lg, mean_trial))
    print(f"{'reuse':<6}{'trials':>7}{'conc':>5}{'start-up s':>11}{'tune s':>8}{'Σtrial s':>10}{'ratio':>7}"
          f"{'cb ms/trial':>12}{'writer ms/trial':>16}{'cb %':>7}{'writer %':>9}")
    for reuse, f, lg, mean_trial in rows:
        n = max(lg["trials_run"], 1)
        cb, wr = 1000 * lg["mlflow_callback_seconds"] / n, 1000 * lg["mlflow_writer_seconds"] / n
        print(f"{str(reuse):<6}{f['trials']:>7}{f['concurrency']:>5}{f['sweep_seconds'] - f['tune_seconds']:>11.1f}"
              f"{f['tune_seconds']:>8.1f}{f['trial_compute_seconds']:>10.1f}{f['overhead_ratio']:>7.3f}"
              f"{cb:>12.2f}{wr:>16.1f}{100 * cb / 1000 / mean_trial:>7.3f}{100 * wr / 1000 / mean_trial:>9.2f}")


if __name__ == "__main__":
    main()
