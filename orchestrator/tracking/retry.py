"""``healsweep run --resume DIR --retry-failed``: the sweep's failed trials run again.

A trial ends FAILED when its healing raised after its retries (``resources.max_failures``), its node faults ran
out, or the disk filled; its record line (``trials.jsonl``) then holds state FAIL and its MLflow run's
``failure_reason``. A sweep that ended so is complete for ``run --resume`` (nothing asked is left). With
``--retry-failed`` the resume first drops those record lines and asks the trials again in the journal, with their
parameters (and a re-evaluation's healing seed): they run as they first would have, and their new runs replace the
failed ones in MLflow (the logger deletes a resumed trial's old run).

What is not retried:
- a trial that **diverged** (``failure_reason`` HealingDiverged): its configuration's result, told FAIL to the search
  on purpose; the same seed diverges again;
- failed trials of cells this run does not hold (a refine round's: ``healsweep refine`` runs those).

A failed **search** trial may, once it runs, become its cell's winner: the cell's recorded re-evaluations (which
healed the winner the search picked without it) are dropped too and asked again without their configuration; the
design derives it from the winner once every search trial of the cell is told (orchestrator/search/base.py
``ready``), on the same healing seeds: the same winner heals to the same numbers.

The journal is rewritten first, then the record (as doctor's ``--rerun-lost-weights``): a kill between the two
leaves a journal that disagrees with the record, which the next resume rebuilds from the record (the failed trials
stay failed; retry again).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Collection

from orchestrator.rundir import records
from orchestrator.rundir.files import JOURNAL_FILE
from orchestrator.tracking.rebuild import rebuild_journal

DIVERGED = "HealingDiverged"  # orchestrator/raytune/trainable.py: the failure_reason of a diverged trial
SEARCH, REEVALUATE = "search", "reevaluate"  # a record's optuna "stage" (orchestrator.search.records; importing it
# here would import Ray Tune into `healsweep run`'s first second)


@dataclass
class Retry:
    failed: dict[str, str] = field(default_factory=dict)  # trial id -> its failure reason: runs again
    again: list[str] = field(default_factory=list)  # re-evaluations of those cells' winners: derived again
    diverged: list[str] = field(default_factory=list)  # failed by divergence: kept
    elsewhere: list[str] = field(default_factory=list)  # failed in cells this run does not hold: kept

    @property
    def dropped(self) -> set[str]:
        return set(self.failed) | set(self.again)


def failure_reason(rec: dict) -> str:
    """A FAIL record's reason as its MLflow run had it (tag ``failure_reason``)."""
    tags = (rec.get("mlflow") or {}).get("tags") or {}
    return str(tags.get("failure_reason") or "no reason recorded")


def plan_retry(trials: dict[str, dict], cells: Collection[str] | None = None) -> Retry:
    """Which recorded trials a retry runs again (module docstring). ``cells``: the cell ids this run's design holds
    (None: every cell)."""
    r = Retry()
    for tid, rec in sorted(trials.items()):
        if rec["optuna"]["state"] != "FAIL":
            continue
        if cells is not None and rec.get("cell_id") not in cells:
            r.elsewhere.append(tid)
        elif failure_reason(rec).startswith(DIVERGED):
            r.diverged.append(tid)
        else:
            r.failed[tid] = failure_reason(rec)
    searched = {trials[t]["cell_id"] for t in r.failed if trials[t]["optuna"]["stage"] == SEARCH}
    r.again = [tid for tid, rec in sorted(trials.items()) if tid not in r.failed and rec.get("cell_id") in searched
               and rec["optuna"]["stage"] == REEVALUATE]
    return r


def retryable(out_dir: Path) -> int:
    """How many recorded trials ``--retry-failed`` would run again in any cell (read only)."""
    return len(plan_retry(records.trials(records.scan(Path(out_dir) / records.TRIALS_FILE))).failed)


def drop_failed(out_dir: Path, cells: Collection[str] | None = None) -> Retry:
    """Ask the failed trials (and the re-evaluations that depend on them) again: the journal rebuilt without their
    tells (re-evaluations without their configuration), then their record lines dropped. -> what was dropped."""
    out_dir = Path(out_dir)
    s = records.scan(out_dir / records.TRIALS_FILE)
    trials = records.trials(s)
    r = plan_retry(trials, cells)
    if not r.dropped:
        return r
    kept = {t: rec for t, rec in trials.items() if t not in r.dropped}
    forget = {(trials[t]["optuna"]["study"], int(trials[t]["optuna"]["number"])) for t in r.again}
    rebuild_journal(out_dir / JOURNAL_FILE, kept, forget=forget)
    records.rewrite(s.path, [x for x in s.records if not (x.get("kind") == records.TRIAL
                                                          and x.get("trial_id") in r.dropped)])
    return r


def retry_lines(r: Retry, say: Callable[[str], None]) -> None:
    """What a retry did, a line each: the trials run again (and why they failed), what it leaves."""
    if r.failed:
        reasons = sorted(set(r.failed.values()))
        say(f"--retry-failed: {len(r.failed)} failed trial(s) run again ({_named(list(r.failed))}); they failed with: "
            + "; ".join(x[:120] for x in reasons[:3]) + (f"; and {len(reasons) - 3} other reason(s)" if len(reasons) > 3
                                                          else ""))
    else:
        say("--retry-failed: no failed trial to run again")
    if r.again:
        say(f"--retry-failed: {len(r.again)} re-evaluation(s) of those cells run again once their search is told "
            "(a retried trial may become the winner)")
    if r.diverged:
        say(f"--retry-failed: {len(r.diverged)} diverged trial(s) kept ({_named(r.diverged)}): divergence is their "
            "configuration's result, and the same seed diverges again")
    if r.elsewhere:
        say(f"--retry-failed: {len(r.elsewhere)} failed trial(s) of refine rounds kept ({_named(r.elsewhere)}): "
            "run --resume runs the main grid only")


def _named(ids: list[str]) -> str:
    return ", ".join(ids[:4]) + (", ..." if len(ids) > 4 else "")
