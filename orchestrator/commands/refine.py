"""healsweep refine DIR: run a fine sparsity grid inside the transition band of a finished sweep."""
from __future__ import annotations

from pathlib import Path

from orchestrator.commands.common import CliError, interrupted_exit
from orchestrator.lifecycle.continuation import RefineError
from orchestrator.lifecycle.refine import (
    MAX_TRIALS,  # a light module: its heavy imports are inside functions
    duration,
    run_refinement,
)
from orchestrator.lifecycle.widen import run_widening
from orchestrator.raytune.cluster import ClusterError
from orchestrator.rundir import faults
from orchestrator.rundir.files import ResumeError


def add_parser(sub):
    p = sub.add_parser("refine", help="refine a finished sweep's transition band with a fine sparsity grid",
                       description="Read DIR/sweep.json and the sweep's MLflow runs, find the sparsity range "
                                   "where healed accuracy is in transition, run the fine grid inside it as a "
                                   "continuation of the same sweep (cached targets, masks and diagnostics are "
                                   "reused) and rewrite DIR/report.html, report.md and bands.json. Prints the number "
                                   "of new trials and a time estimate from this sweep's measured trial times; "
                                   "refuses more than --max-trials trials.")
    p.add_argument("dir", help="run directory of a finished sweep (holds sweep.json)")
    p.add_argument("--step", type=float, default=0.005, help="fine sparsity step (default: %(default)s)")
    p.add_argument("--address", help="Ray cluster address; default: a local Ray")
    p.add_argument("--num-cpus", type=int, help="CPUs for the local Ray instance (default: all)")
    p.add_argument("--dry-run", action="store_true",
                   help="print the fine grid, its number of trials and a time estimate from this sweep's measured "
                        "trial times, and stop")
    p.add_argument("--max-trials", type=int, default=MAX_TRIALS, metavar="N",
                   help="refuse a refinement of more than N trials (default: %(default)s)")
    p.add_argument("--widen", action="store_true",
                   help="instead of a fine sparsity grid: search past the search-space boundary for the cells whose "
                        "winner sits on it (orchestrator/lifecycle/widen.py; what search.widen does after a run)")
    p.add_argument("--widen-factor", type=float, default=4.0, metavar="F",
                   help="with --widen: move each hit edge of the search box by this factor (default: %(default)s)")
    p.add_argument("--widen-rounds", type=int, default=1, metavar="N",
                   help="with --widen: at most N rounds (default: %(default)s)")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.set_defaults(func=main)
    return p


def _listing(xs: list[float], head: int = 4) -> str:
    shown = [f"{s:g}" for s in xs] if len(xs) <= 2 * head + 1 else \
        [*(f"{s:g}" for s in xs[:head]), "...", *(f"{s:g}" for s in xs[-head:])]
    return ", ".join(shown)


def main(args) -> int:

    if args.widen:
        return _widen(args)
    try:
        plan = run_refinement(Path(args.dir), args.step, address=args.address, progress=not args.quiet,
                              num_cpus=args.num_cpus, dry_run=args.dry_run, max_trials=args.max_trials)
    except (RefineError, ResumeError, ClusterError) as e:  # ResumeError: e.g. another live driver holds the run dir
        raise CliError(str(e)) from None
    except Exception as e:
        if not faults.follows_fault(e):  # else the fault's line, raised below, names the first write that failed
            raise

    faults.raise_stopped()  # a fault that stopped the round (a full disk): one line, exit 1 (orchestrator/rundir/faults.py)
    lo, hi = plan["interval"]
    n, t, per = len(plan["sparsities"]), plan["trials"], plan["seconds_per_trial"]
    print(f"transition band {lo:g}–{hi:g}: {n} new sparsit{'y' if n == 1 else 'ies'} ({_listing(plan['sparsities'])})")
    est = f"about {duration(t * per)} ({per:.1f} s per trial: {plan['estimate']})" if per else plan["estimate"]
    print(f"{t} new trial{'' if t == 1 else 's'}, {est}")
    if args.dry_run:
        if t > args.max_trials:
            print(f"above --max-trials {args.max_trials}: a run would be refused; raise it or use a coarser --step")
        return 0
    res = plan["result"]
    print(f"refine round {plan['round']}: {res.trials_finished} trials finished, {res.trials_failed} failed, "
          f"dense forward images {res.dense_forward_images}")
    print(f"report: {plan['report']['html']}")
    return interrupted_exit(res) or (0 if res.trials_failed == 0 else 1)


def _widen(args) -> int:

    if args.widen_rounds < 1:
        raise CliError(f"--widen-rounds must be >= 1, got {args.widen_rounds}")
    try:
        done = run_widening(Path(args.dir), args.widen_rounds, args.widen_factor, address=args.address,
                            progress=not args.quiet, num_cpus=args.num_cpus)
    except (RefineError, ResumeError, ClusterError) as e:
        raise CliError(str(e)) from None
    if not done:
        print("no winner sits on the search boundary: nothing to widen")
        return 0
    for d in done:
        res = d["result"]
        print(f"widen round {d['round']}: {len(d['cells'])} cells, {res.trials_finished} trials finished, "
              f"{res.trials_failed} failed")
    print(f"report: {done[-1]['report']['html']}")
    return interrupted_exit(done[-1]["result"]) or (0 if all(d["result"].trials_failed == 0 for d in done) else 1)
