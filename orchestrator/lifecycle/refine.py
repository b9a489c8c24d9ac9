"""Adaptive refinement: find the transition band of a finished sweep and run a fine sparsity grid inside it
as a continuation of the same sweep (same sweep id, parent run, store, Optuna journal and run directory).

Dense targets, masks and diagnostics are content-addressed, so everything the coarse sweep computed is reused;
only the new sparsities' masks and trials are computed. Pruners with a fixed sparsity (N:M) are not re-run.
"""
from __future__ import annotations

import json
import math
from collections import Counter, defaultdict
from dataclasses import replace
from pathlib import Path
from typing import Callable

from orchestrator.lifecycle.continuation import RefineError, read_run
from orchestrator.lifecycle.resume import prepare_resume
from orchestrator.rundir import faults
from orchestrator.rundir.files import JOURNAL_FILE, interrupted_round, lock_run_dir, write_sweep
from orchestrator.sweep.end import told_counts
from tasks.catalog import changes_with_draw

MIN_STEP = 1e-6  # fine sparsities are rounded to 1e-6


def refine_interval(records: list[dict]) -> tuple[float, float] | None:
    """Union over band records of the sparsity range holding each one's transition.

    Per record (points ascending): from the coarse point just below the first transition point to the one
    just above the last (the boundaries lie between coarse points); without transition points, between the
    last recoverable point and the first collapse point after it. None when no record has either.
    """
    lo, hi = math.inf, -math.inf
    for rec in records:
        pts = sorted(rec["points"], key=lambda p: p["sparsity"])
        s = [p["sparsity"] for p in pts]
        lab = [p["label"] for p in pts]
        idx = [i for i, x in enumerate(lab) if x == "transition"]
        if idx:
            a, b = max(0, idx[0] - 1), min(len(s) - 1, idx[-1] + 1)
        else:
            rec_i = [i for i, x in enumerate(lab) if x == "recoverable"]
            col_i = [i for i, x in enumerate(lab) if x == "collapse" and rec_i and i > rec_i[-1]]
            if not (rec_i and col_i):
                continue
            a, b = rec_i[-1], col_i[0]
        lo, hi = min(lo, s[a]), max(hi, s[b])
    return None if lo > hi else (lo, hi)


def fine_grid(lo: float, hi: float, step: float, existing) -> list[float]:
    """lo + k·step strictly inside (lo, hi), rounded to 1e-6, minus sparsities already run."""
    if not MIN_STEP <= step < 1:  # a smaller step only repeats points after the rounding (1e-300 hung, listing 4e299)
        raise RefineError(f"--step must be in [{MIN_STEP:g}, 1) (a sparsity step; fine sparsities are rounded to "
                          f"1e-6), got {step:g}")
    have = {round(float(x), 6) for x in existing}
    n = int(math.floor((hi - lo) / step + 1e-9))
    pts = [round(lo + k * step, 6) for k in range(1, n + 1)]
    return [x for x in pts if lo < x < hi and x < 1.0 and x not in have]


def plan_refinement(run_dir: Path, step: float) -> dict:
    """Read sweep.json + MLflow; return {"meta", "interval", "sparsities", "parent_run_id", "round", "step",
    "continues" (an interrupted round goes on), "ran" (its trials finished and failed so far), ...}."""
    from analysis.bands import BandSettings, bands
    from analysis.runs import best_per_cell

    meta, uri, info, trials = read_run(run_dir)
    if info["run_id"] is None:
        raise RefineError(f"{run_dir}: parent run of sweep {meta['sweep_id']} not found in MLflow")
    heal = trials.loc[trials["status"] == "FINISHED", "heal_seconds"].dropna() if "heal_seconds" in trials else ()
    common = {"meta": meta, "parent_run_id": info["run_id"], "tracking_uri": uri,
              "heal_seconds": [float(x) for x in heal]}
    if last := interrupted_round(meta):  # its sparsities count as run once a trial finished: the round goes on
        return {**common, "interval": tuple(last["interval"]), "sparsities": list(last["sparsities"]),
                "round": last["round"], "step": last["step"], "continues": True,
                "ran": {k: last.get(k, 0) for k in ("trials_finished", "trials_failed")}}
    best = best_per_cell(trials, info["objective"])  # winners picked by the sweep's search objective
    if "grid" in best:  # extra grids (e.g. a healer comparison) do not shape the main grid's refinement
        best = best[best["grid"].isna() | (best["grid"] == "main")]
    if best.empty:
        raise RefineError(f"{run_dir}: sweep {meta['sweep_id']} has no finished trials to refine")
    recs = bands(best, None, BandSettings(**(meta.get("analysis") or {}).get("bands", {})))
    interval = refine_interval(recs)
    if interval is None:
        raise RefineError(f"{run_dir}: no transition band found (every point is recoverable, or every point "
                          "collapsed); widen the coarse sparsities")
    done = set(best["sparsity"].dropna().tolist())
    sparsities = fine_grid(interval[0], interval[1], step, done)
    if not sparsities:
        raise RefineError(f"{run_dir}: transition band {interval[0]:g}–{interval[1]:g} already has every "
                          f"sparsity at step {step:g}")
    return {**common, "interval": interval, "sparsities": sparsities, "round": len(meta.get("refinements", [])) + 1,
            "step": step, "continues": False, "ran": {"trials_finished": 0, "trials_failed": 0}}


def count_trials(spec) -> dict[str, int]:
    """Grid name -> trials the spec runs, as `healsweep validate` counts them (``grids.cell_trials``): each searched
    cell's trials and its winner's re-evaluations (``max_per_cell``: it counted the search alone, 16 of a round's
    24), 1 for a healer that does not train (and 1 on each other calibration draw that can change it)."""

    from orchestrator.spec.grids import cell_trials
    from orchestrator.spec.plan import expand_cells, grid_searches
    from orchestrator.spec.registries import get, resolve_healer

    searches, out = grid_searches(spec), Counter()
    for c in expand_cells(spec, defaultdict(str)):  # scopes are not needed to count cells
        healer = resolve_healer(c.healer, c.healer_settings)
        out[c.grid] += cell_trials(searches[c.grid], spec.search.calib_draws, healer.trains,
                                   changes_with_draw(get("pruner", c.pruner), healer))
    return dict(out)


def trial_wall(plan: dict) -> tuple[float | None, str]:
    """Measured wall seconds per trial of this sweep -> (seconds, how it was measured). Tune wall over trials
    run, summed over the sweep's sessions (it includes the concurrency and per-trial overhead of this
    machine); without it, the mean heal_seconds of the finished trials (one at a time, no overhead)."""
    from mlflow import MlflowClient

    client = MlflowClient(plan["tracking_uri"])
    hist = {k: {m.step: m.value for m in client.get_metric_history(plan["parent_run_id"], k)}
            for k in ("tune_seconds", "trials_run")}
    steps = [s for s, n in hist["trials_run"].items() if n > 0 and s in hist["tune_seconds"]]
    if steps:
        wall, n = sum(hist["tune_seconds"][s] for s in steps), sum(hist["trials_run"][s] for s in steps)
        return wall / n, f"the sweep's Tune wall per trial, {wall:.0f} s / {n:.0f} trials"
    if plan["heal_seconds"]:
        h = plan["heal_seconds"]
        return sum(h) / len(h), f"mean heal_seconds of {len(h)} finished trials, one at a time"
    return None, "no finished trial to measure"


def duration(seconds: float) -> str:
    """42 s, 7 min, 1.5 h."""
    return f"{seconds:.0f} s" if seconds < 90 else f"{seconds / 60:.0f} min" if seconds < 5400 else f"{seconds / 3600:.1f} h"


def refine_spec(spec, sparsities: list[float]):
    """The coarse spec restricted to the fine sparsities and to pruners that follow the sweep's sparsity list
    (not N:M-style fixed patterns, not entries that carry their own ``sparsities``); extra grids are not refined."""
    from tasks.pruning import PRUNERS

    pruners = tuple(p for p in spec.pruners
                    if PRUNERS.get(p.name).fixed_sparsity(p.settings) is None and p.sparsities is None)
    if not pruners:
        raise RefineError("pruners: every pruner has a fixed sparsity (e.g. N:M); nothing to refine")
    return replace(spec, sparsities=tuple(sparsities), pruners=pruners, grids=())  # the main grid only


def _record_round(run_dir: Path, plan: dict, counts: dict, interrupted: bool) -> None:
    """sweep.json ``refinements``: this round's record (replacing its earlier one), ``interrupted`` while it has not
    ended complete: the next ``healsweep refine DIR`` continues it (plan_refinement)."""
    meta = json.loads((run_dir / "sweep.json").read_text(encoding="utf-8"))  # run_sweep may have updated it
    rounds = meta.setdefault("refinements", [])
    if rounds and rounds[-1].get("round") == plan["round"]:
        rounds.pop()
    rounds.append({"round": plan["round"], "step": plan["step"], "interval": list(plan["interval"]),
                   "sparsities": plan["sparsities"], **counts, **({"interrupted": True} if interrupted else {})})
    write_sweep(run_dir, meta)  # whole or not at all


MAX_TRIALS = 200  # default budget of one refinement round (healsweep refine --max-trials)


def run_refinement(run_dir: Path, step: float = 0.005, *, address: str | None = None, progress: bool = True,
                   num_cpus: int | None = None, dry_run: bool = False, max_trials: int = MAX_TRIALS,
                   told: Callable[[dict], None] | None = None) -> dict:
    """Plan, run the fine grid into the same sweep, record it in sweep.json and rewrite the report. Plans of
    more than ``max_trials`` trials are refused (RefineError) unless ``dry_run``; the plan carries ``trials``,
    ``seconds_per_trial`` and ``estimate`` (how the time was measured) either way, and is handed to ``told``
    before anything runs (the CLI prints it first)."""
    from orchestrator.spec import SpecError, parse_spec

    if max_trials < 1:
        raise RefineError(f"--max-trials must be >= 1, got {max_trials}")
    plan = plan_refinement(run_dir, step)
    meta = plan["meta"]
    try:
        coarse = parse_spec(meta["spec"])
        one = refine_spec(coarse, plan["sparsities"][:1])
    except SpecError as e:
        raise RefineError(f"sweep.json spec: {e}") from None
    # every fine sparsity holds the same cells (the main grid, pruners that follow the sparsity list): counted on
    # one, not listed for each (a --step of 1e-6 listed ~400k sparsities' cells for ~75 s before the refusal)
    plan["round_trials"] = sum(count_trials(one).values()) * len(plan["sparsities"])
    ran = plan["ran"]  # the round's runs before this one (a continued round)
    plan["trials"] = max(0, plan["round_trials"] - ran["trials_finished"] - ran["trials_failed"])
    plan["seconds_per_trial"], plan["estimate"] = trial_wall(plan)
    if told is not None:
        told(plan)
    if dry_run:
        return plan
    if plan["trials"] > max_trials:
        per = plan["round_trials"] / len(plan["sparsities"])
        about = f", about {duration(plan['trials'] * plan['seconds_per_trial'])}" if plan["seconds_per_trial"] else ""
        ns, coarser = len(plan["sparsities"]), "" if plan["continues"] else ", or use a coarser --step"
        raise RefineError(f"{plan['trials']} new trials ({ns} sparsit{'y' if ns == 1 else 'ies'} x {per:g}{about}"
                          f"{', what is left of the interrupted round' if plan['continues'] else ''}) exceed "
                          f"--max-trials {max_trials}; raise it{coarser} (see --dry-run)")
    from analysis.report import write_report
    from orchestrator.sweep.run import run_sweep

    spec = refine_spec(coarse, plan["sparsities"])
    done_before, failed_before = told_counts(Path(run_dir) / JOURNAL_FILE)  # the whole sweep's, so far

    lock_run_dir(Path(run_dir))  # before its files are settled: no doctor --repair or second driver meanwhile
    prepare_resume(Path(run_dir))  # damaged files: one line; torn last lines dropped; journal agrees with the record
    _record_round(Path(run_dir), plan, ran, interrupted=True)  # until it ends: a fault, SIGKILL or a lost cluster
    res = run_sweep(spec, Path(run_dir), Path(meta["store"]), Path(meta["cache"]), address=address,  # leave it to
                    progress=progress, report=False, num_cpus=num_cpus, refine_round=plan["round"])  # continue
    counts = {"trials_finished": ran["trials_finished"] + res.trials_finished - done_before,
              "trials_failed": ran["trials_failed"] + res.trials_failed - failed_before}
    _record_round(Path(run_dir), plan, counts, interrupted=res.interrupted is not None or faults.stopped() is not None)
    plan.update(result=res, report=write_report(run_dir), **counts)  # counts: this round's, over its runs
    return plan
