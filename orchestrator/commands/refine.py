"""healsweep refine DIR: run a fine sparsity grid inside the transition band of a finished sweep."""
from __future__ import annotations

import sys
from pathlib import Path

from orchestrator.commands.common import CliError, interrupted_exit, report_lines
from orchestrator.lifecycle.continuation import RefineError
from orchestrator.lifecycle.refine import (
    MAX_TRIALS,  # a light module: its heavy imports are inside functions
    duration,
    run_refinement,
)
from orchestrator.lifecycle.widen import run_widening
from orchestrator.raytune.cluster import ClusterError
from orchestrator.rundir import faults, interrupt
from orchestrator.rundir.files import ResumeError, holder_words, lock_holder, locked_error
from orchestrator.spec.checks import MAX_WIDEN_ROUNDS

STEP, WIDEN_FACTOR, WIDEN_ROUNDS = 0.005, 4.0, 1  # the defaults of --step, --widen-factor, --widen-rounds


def add_parser(sub):
    p = sub.add_parser("refine", help="refine a finished sweep: a fine sparsity grid in its transition band, or "
                                           "(--widen) a search past the boundary its winners sit on",
                       description="Read DIR/sweep.json and the sweep's MLflow runs, find the sparsity range "
                                   "where healed accuracy is in transition, run the fine grid inside it as a "
                                   "continuation of the same sweep (cached targets, masks and diagnostics are "
                                   "reused) and rewrite DIR/report.html, report.md and bands.json. Prints the number "
                                   "of new trials and a time estimate from this sweep's measured trial times; "
                                   "refuses more than --max-trials trials.")
    p.add_argument("dir", help="run directory of a finished sweep (holds sweep.json)")
    p.add_argument("--step", type=float, help=f"fine sparsity step (default: {STEP})")
    p.add_argument("--address", help="Ray cluster address; default: a local Ray")
    p.add_argument("--num-cpus", type=int, help="CPUs for the local Ray instance (default: all)")
    p.add_argument("--dry-run", action="store_true",
                   help="print the fine grid, its number of trials and a time estimate from this sweep's measured "
                        "trial times, and stop (not with --widen)")
    p.add_argument("--max-trials", type=int, metavar="N",
                   help=f"refuse a refinement of more than N trials (default: {MAX_TRIALS}; not with --widen)")
    p.add_argument("--widen", action="store_true",
                   help="instead of a fine sparsity grid: search past the search-space boundary for the cells whose "
                        "winner sits on it (orchestrator/lifecycle/widen.py; what search.widen does after a run)")
    p.add_argument("--widen-factor", type=float, metavar="F",
                   help=f"with --widen: move each hit edge of the search box by this factor (default: {WIDEN_FACTOR})")
    p.add_argument("--widen-rounds", type=int, metavar="N",
                   help=f"with --widen: at most N rounds (default: {WIDEN_ROUNDS})")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.set_defaults(func=main)
    return p


def _listing(xs: list[float], head: int = 4) -> str:
    shown = [f"{s:g}" for s in xs] if len(xs) <= 2 * head + 1 else \
        [*(f"{s:g}" for s in xs[:head]), "...", *(f"{s:g}" for s in xs[-head:])]
    return ", ".join(shown)


def _flags(args) -> None:
    """Refuse an option that does not apply to the chosen mode (it was ignored: ``--widen --dry-run`` ran a real
    round), then fill in the defaults."""
    if args.num_cpus is not None and args.num_cpus < 1:  # as `run` refuses it (Ray started and failed 22 s later)
        raise CliError(f"--num-cpus must be >= 1, got {args.num_cpus}")
    if args.widen:
        given = [f for f, v in (("--dry-run", args.dry_run), ("--step", args.step), ("--max-trials", args.max_trials))
                 if v not in (None, False)]
        if given:
            raise CliError(f"{given[0]} does not apply to --widen (a widening round has no fine grid, no trial limit "
                           f"and no dry run); leave it out")
    else:
        given = [f for f, v in (("--widen-factor", args.widen_factor), ("--widen-rounds", args.widen_rounds))
                 if v is not None]
        if given:
            raise CliError(f"{given[0]} applies only with --widen")
    for key, default in (("step", STEP), ("max_trials", MAX_TRIALS), ("widen_factor", WIDEN_FACTOR),
                         ("widen_rounds", WIDEN_ROUNDS)):
        if getattr(args, key) is None:
            setattr(args, key, default)


def _print_plan(plan: dict) -> None:
    """The fine grid, its trials and their time estimate: printed before the round runs (and flushed: piped, the
    plan came out after the round's own lines)."""
    lo, hi = plan["interval"]
    n, t, per = len(plan["sparsities"]), plan["trials"], plan["seconds_per_trial"]
    if plan.get("continues"):  # orchestrator/lifecycle/refine.py plan_refinement
        print(f"refine round {plan['round']} was interrupted: it goes on (step {plan['step']:g}; finished trials "
              "are not run again)")
    print(f"transition band {lo:g}–{hi:g}: {n} new sparsit{'y' if n == 1 else 'ies'} ({_listing(plan['sparsities'])})")
    est = f"about {duration(t * per)} ({per:.1f} s per trial: {plan['estimate']})" if per else plan["estimate"]
    print(f"{t} new trial{'' if t == 1 else 's'}, {est}", flush=True)


def main(args) -> int:
    _flags(args)
    if (held := lock_holder(Path(args.dir))) and not args.dry_run:  # refused before Ray starts, not after
        raise CliError(str(locked_error(Path(args.dir), held)))
    if held:  # the plan is read from what has finished so far
        what = "repairing its run directory" if held.endswith(" doctor") else "running this sweep"
        print(f"note: {holder_words(held)} is {what} now: this plan is from the trials finished so far")
    if args.widen:
        return _widen(args)
    try:
        plan = run_refinement(Path(args.dir), args.step, address=args.address, progress=not args.quiet,
                              num_cpus=args.num_cpus, dry_run=args.dry_run, max_trials=args.max_trials,
                              told=_print_plan)
    except (RefineError, ResumeError, ClusterError) as e:  # ResumeError: e.g. another live driver holds the run dir
        raise CliError(str(e)) from None
    except Exception as e:
        if not faults.follows_fault(e):  # else the fault's line, raised below, names the first write that failed
            raise

    faults.raise_stopped()  # a fault that stopped the round (a full disk): one line, exit 1 (orchestrator/rundir/faults.py)
    if args.dry_run:
        if plan["trials"] > args.max_trials:
            print(f"above --max-trials {args.max_trials}: a run would be refused; raise it or use a coarser --step")
        return 0
    res = plan["result"]
    print(f"refine round {plan['round']}: {plan['trials_finished']} trials finished, {plan['trials_failed']} failed "
          f"(the sweep: {res.trials_finished} and {res.trials_failed}), dense forward images {res.dense_forward_images}")
    print(report_lines(plan["report"]))
    if res.interrupted is not None:  # the round's own counts (the sweep's finished over the round's plan read "22 of 4")
        print(f"interrupted: {plan['trials_finished']} of refine round {plan['round']}'s {plan['round_trials']} trials "
              f"finished; continue it with healsweep refine {args.dir}", file=sys.stderr)
        return interrupt.exit_code(res.interrupted)
    return 0 if res.trials_failed == 0 else 1


def _widen(args) -> int:

    if not 1 <= args.widen_rounds <= MAX_WIDEN_ROUNDS:
        raise CliError(f"--widen-rounds must be in [1, {MAX_WIDEN_ROUNDS}] (as search.widen.rounds), "
                       f"got {args.widen_rounds}")
    try:
        with interrupt.catching():  # over every round: a Ctrl-C between two stops the next one before its trials
            done = run_widening(Path(args.dir), args.widen_rounds, args.widen_factor, address=args.address,
                                progress=not args.quiet, num_cpus=args.num_cpus)
            late = interrupt.received()  # after the last round (its report): said, not lost
    except (RefineError, ResumeError, ClusterError) as e:
        raise CliError(str(e)) from None
    if done and not done[-1].get("started", True):  # not recorded: nothing of it to resume
        print(f"interrupted before widening round {done[-1]['round']} started; run healsweep refine {args.dir} "
              f"--widen again for it", file=sys.stderr)
        return interrupt.exit_code(done[-1]["result"].interrupted)
    if not done:
        print("no winner sits on the search boundary, or only on the spec's own limits (lr 10, the longest healing): "
              "nothing to widen")
        return 0
    for d in (d for d in done if d.get("started", True)):
        res = d["result"]
        print(f"widen round {d['round']}: {len(d['cells'])} cells, {d['trials_finished']} trials finished, "
              f"{d['trials_failed']} failed (the sweep: {res.trials_finished} and {res.trials_failed})")
    print(report_lines(done[-1]["report"]))
    if late is not None and done[-1]["result"].interrupted is None:
        return interrupt.exit_code(late)
    return interrupted_exit(done[-1]["result"]) or (0 if all(d["result"].trials_failed == 0 for d in done) else 1)
