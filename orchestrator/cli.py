"""healsweep command line: run a sweep, write its report, validate a spec."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

DEFAULT_HOME = Path(".healsweep")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="healsweep",
        description="Prune and heal vision models over grids of model x sparsity x calibration size x pruner x "
                    "healer, on Ray Tune with a per-cell Optuna search, logged to MLflow, with reports.")
    sub = p.add_subparsers(dest="cmd", required=True)
    run = sub.add_parser("run", help="validate a sweep spec, run it and write its report",
                         description="Validate SPEC, train/load the reference models, cache dense block targets "
                                     "in the store (Ray tasks), run every trial (Ray Tune + Optuna), log to MLflow "
                                     "and write DIR/report.html and DIR/report.md.")
    run.add_argument("spec", help="sweep spec (YAML), e.g. configs/default.yaml")
    run.add_argument("--out", metavar="DIR", help="run directory (default: runs/<spec name>)")
    run.add_argument("--store", metavar="DIR", default=str(DEFAULT_HOME / "store"),
                     help="target/mask store root, shared across sweeps (default: %(default)s)")
    run.add_argument("--cache", metavar="DIR", default=str(DEFAULT_HOME / "models"),
                     help="reference model cache (default: %(default)s)")
    run.add_argument("--address", help="Ray cluster address ('auto', 'ray://host:10001'); default: a local Ray")
    run.add_argument("--num-cpus", type=int, help="CPUs for the local Ray instance (default: all)")
    run.add_argument("--no-report", action="store_true", help="skip writing the report at the end")
    run.add_argument("--quiet", action="store_true", help="no progress bars")
    rep = sub.add_parser("report", help="write DIR/report.html and DIR/report.md from MLflow")
    rep.add_argument("dir", help="run directory of a sweep (holds sweep.json)")
    val = sub.add_parser("validate", help="validate a sweep spec and print its grid size")
    val.add_argument("spec")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    from orchestrator.spec import SpecError, load_spec

    try:
        if args.cmd == "report":
            from analysis.report import write_report

            d = Path(args.dir)
            if not (d / "sweep.json").is_file():
                print(f"healsweep: error: {d}: not a run directory (no sweep.json)", file=sys.stderr)
                return 2
            paths = write_report(d)
            print(f"report: {paths['html']}\n        {paths['md']}")
            return 0
        spec = load_spec(args.spec)
    except SpecError as e:
        print(f"healsweep: error: {e}", file=sys.stderr)
        return 2
    if args.cmd == "validate":
        from tasks.pruners import PRUNERS

        n = 0
        for p in spec.pruners:
            n += 1 if PRUNERS.get(p.name).fixed_sparsity(p.settings) is not None else len(spec.sparsities)
        cells = len(spec.models) * n * len(spec.calib_sizes) * len(spec.healers) * len(spec.seeds)
        print(f"{args.spec}: ok: {cells} cells x {spec.search.trials_per_cell} trials = "
              f"{cells * spec.search.trials_per_cell} trials")
        return 0
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


if __name__ == "__main__":
    sys.exit(main())
