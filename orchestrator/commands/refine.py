"""healsweep refine DIR: run a fine sparsity grid inside the transition band of a finished sweep."""
from __future__ import annotations

from pathlib import Path

from orchestrator.commands.common import CliError


def add_parser(sub):
    p = sub.add_parser("refine", help="refine a finished sweep's transition band with a fine sparsity grid",
                       description="Read DIR/sweep.json and the sweep's MLflow runs, find the sparsity range "
                                   "where healed accuracy is in transition, run the fine grid inside it as a "
                                   "continuation of the same sweep (cached targets, masks and diagnostics are "
                                   "reused) and rewrite DIR/report.html, report.md and bands.json.")
    p.add_argument("dir", help="run directory of a finished sweep (holds sweep.json)")
    p.add_argument("--step", type=float, default=0.005, help="fine sparsity step (default: %(default)s)")
    p.add_argument("--address", help="Ray cluster address; default: a local Ray")
    p.add_argument("--num-cpus", type=int, help="CPUs for the local Ray instance (default: all)")
    p.add_argument("--dry-run", action="store_true", help="print the fine grid and stop")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.set_defaults(func=main)
    return p


def main(args) -> int:
    from orchestrator.cluster import ClusterError  # [cluster]
    from orchestrator.refine import RefineError, run_refinement

    try:
        plan = run_refinement(Path(args.dir), args.step, address=args.address, progress=not args.quiet,
                              num_cpus=args.num_cpus, dry_run=args.dry_run)
    except (RefineError, ClusterError) as e:
        raise CliError(str(e)) from None
    lo, hi = plan["interval"]
    n = len(plan["sparsities"])
    print(f"transition band {lo:g}–{hi:g}: {n} new sparsit{'y' if n == 1 else 'ies'} "
          f"({', '.join(f'{s:g}' for s in plan['sparsities'])})")
    if args.dry_run:
        return 0
    res = plan["result"]
    print(f"refine round {plan['round']}: {res.trials_finished} trials finished, {res.trials_failed} failed, "
          f"dense forward images {res.dense_forward_images}")
    print(f"report: {plan['report']['html']}")
    return 0 if res.trials_failed == 0 else 1
