"""Adaptive refinement: find the transition band of a finished sweep and run a fine sparsity grid inside it
as a continuation of the same sweep (same sweep id, parent run, store, Optuna journal and run directory).

Dense targets, masks and diagnostics are content-addressed, so everything the coarse sweep computed is reused;
only the new sparsities' masks and trials are computed. Pruners with a fixed sparsity (N:M) are not re-run.
"""
from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path


class RefineError(ValueError):
    """Why a sweep cannot be refined (one line)."""


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
    if step <= 0:
        raise RefineError(f"--step must be > 0, got {step}")
    have = {round(float(x), 6) for x in existing}
    n = int(math.floor((hi - lo) / step + 1e-9))
    pts = [round(lo + k * step, 6) for k in range(1, n + 1)]
    return [x for x in pts if lo < x < hi and x < 1.0 and x not in have]


def plan_refinement(run_dir: Path, step: float) -> dict:
    """Read sweep.json + MLflow; return {"meta", "interval", "sparsities", "parent_run_id", "round"}."""
    from analysis.bands import BandSettings, bands
    from analysis.runs import best_per_cell, load_sweep_info, load_trials

    sj = Path(run_dir) / "sweep.json"
    if not sj.is_file():
        raise RefineError(f"{run_dir}: not a run directory (no sweep.json)")
    meta = json.loads(sj.read_text(encoding="utf-8"))
    uri = meta.get("tracking_uri") or f"sqlite:///{(Path(run_dir) / 'mlflow.db').resolve()}"
    exp = meta.get("experiment") or "healsweep"
    trials = load_trials(uri, meta["sweep_id"], exp)
    best = best_per_cell(trials)
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
    info = load_sweep_info(uri, meta["sweep_id"], exp)
    if info["run_id"] is None:
        raise RefineError(f"{run_dir}: parent run of sweep {meta['sweep_id']} not found in MLflow")
    return {"meta": meta, "interval": interval, "sparsities": sparsities, "parent_run_id": info["run_id"],
            "round": len(meta.get("refinements", [])) + 1}


def refine_spec(spec, sparsities: list[float]):
    """The coarse spec restricted to the fine sparsities and to pruners that follow the sweep's sparsity list
    (not N:M-style fixed patterns, not entries that carry their own ``sparsities``); extra grids are not refined."""
    from tasks.pruning import PRUNERS

    pruners = tuple(p for p in spec.pruners
                    if PRUNERS.get(p.name).fixed_sparsity(p.settings) is None and p.sparsities is None)
    if not pruners:
        raise RefineError("pruners: every pruner has a fixed sparsity (e.g. N:M); nothing to refine")
    return replace(spec, sparsities=tuple(sparsities), pruners=pruners, grids=())  # the main grid only


def run_refinement(run_dir: Path, step: float = 0.005, *, address: str | None = None, progress: bool = True,
                   num_cpus: int | None = None, dry_run: bool = False) -> dict:
    """Plan, run the fine grid into the same sweep, record it in sweep.json and rewrite the report."""
    from orchestrator.spec import SpecError, parse_spec

    plan = plan_refinement(run_dir, step)
    meta = plan["meta"]
    try:
        spec = refine_spec(parse_spec(meta["spec"]), plan["sparsities"])
    except SpecError as e:
        raise RefineError(f"sweep.json spec: {e}") from None
    if dry_run:
        return plan
    from analysis.report import write_report
    from orchestrator.resume import JOURNAL_FILE, told_states
    from orchestrator.sweep import run_sweep

    def counts() -> tuple[int, int]:  # (finished, failed) trials of the whole sweep so far
        states = told_states(Path(run_dir) / JOURNAL_FILE).values() if (Path(run_dir) / JOURNAL_FILE).exists() else ()
        return (sum(st.name in ("COMPLETE", "PRUNED") for st in states), sum(st.name == "FAIL" for st in states))

    done_before, failed_before = counts()

    res = run_sweep(spec, Path(run_dir), Path(meta["store"]), Path(meta["cache"]), address=address,
                    progress=progress, report=False, num_cpus=num_cpus, refine_round=plan["round"])
    meta = json.loads((Path(run_dir) / "sweep.json").read_text(encoding="utf-8"))  # run_sweep updated it
    meta.setdefault("refinements", []).append(
        {"round": plan["round"], "step": step, "interval": list(plan["interval"]), "sparsities": plan["sparsities"],
         "trials_finished": res.trials_finished - done_before, "trials_failed": res.trials_failed - failed_before})
    (Path(run_dir) / "sweep.json").write_text(json.dumps(meta, indent=1, default=list), encoding="utf-8")
    plan.update(result=res, report=write_report(run_dir))
    return plan
