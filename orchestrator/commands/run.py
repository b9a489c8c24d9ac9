"""healsweep run SPEC: validate, then run the sweep and write its report."""
from __future__ import annotations

import argparse
from pathlib import Path

from orchestrator.commands.common import DEFAULT_HOME, load_spec_or_exit


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("run", help="validate a sweep spec, run it and write its report",
                       description="Validate SPEC, train/load the reference models, cache dense block targets in "
                                   "the store (Ray tasks), run every trial (Ray Tune + per-cell Optuna), log to "
                                   "MLflow and write DIR/report.html and DIR/report.md.")
    p.add_argument("spec", help="sweep spec (YAML), e.g. configs/default.yaml")
    p.add_argument("--out", metavar="DIR", help="run directory (default: runs/<spec name>)")
    p.add_argument("--store", metavar="DIR", default=str(DEFAULT_HOME / "store"),
                   help="target/mask store root, shared across sweeps (default: %(default)s)")
    p.add_argument("--cache", metavar="DIR", default=str(DEFAULT_HOME / "models"),
                   help="reference model cache (default: %(default)s)")
    p.add_argument("--address", help="Ray cluster address ('auto', 'ray://host:10001'); default: a local Ray")
    p.add_argument("--num-cpus", type=int, help="CPUs for the local Ray instance (default: all)")
    p.add_argument("--no-report", action="store_true", help="skip writing the report at the end")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.add_argument("--offline", action="store_true",
                   help="no downloads (sets HF_HUB_OFFLINE=1): pretrained weights and datasets must be cached")
    p.set_defaults(func=main)
    return p


def main(args) -> int:
    if getattr(args, "offline", False):
        import os

        os.environ["HF_HUB_OFFLINE"] = os.environ["HF_DATASETS_OFFLINE"] = "1"  # inherited by Ray workers
    spec = load_spec_or_exit(args.spec)
    from orchestrator.sweep import run_sweep

    out = Path(args.out or Path("runs") / spec.name)
    res = run_sweep(spec, out, Path(args.store), Path(args.cache), address=args.address, progress=not args.quiet,
                    report=not args.no_report, num_cpus=args.num_cpus)
    print(f"sweep {res.sweep_id}: {res.trials_finished} trials finished, {res.trials_failed} failed, "
          f"dense forward images {res.dense_forward_images}, {res.seconds:.0f} s")
    print(f"mlflow: {res.tracking_uri}")
    if res.report:
        print(f"report: {res.report['html']}\n        {res.report['md']}")
    return 0 if res.trials_failed == 0 else 1
