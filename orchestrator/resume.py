"""Resuming a sweep whose driver died (``healsweep run --resume DIR``).

We do not use ``Tuner.restore``: the durable state of a sweep is already outside Tune. The per-cell Optuna
journal (DIR/optuna.journal) records every asked trial, its parameters and whether it was told; the target and
mask stores are content-addressed; DIR/sweep.json holds the sweep id, the spec and the MLflow parent run.
A restart therefore rebuilds the searcher over the journal (told trials are never run again; asked-but-untold
trials run again with the same trial number and parameters, from scratch) and starts a new Tune experiment
for the remaining work. Optuna is told only after that trial's MLflow writes (same writer thread), so a told
trial always has its complete child run; ``reconcile`` closes child runs whose final status was lost.
"""
from __future__ import annotations

import json
from pathlib import Path

from mlflow import MlflowClient
from optuna.trial import TrialState

from orchestrator.search import open_journal

SWEEP_FILE = "sweep.json"
JOURNAL_FILE = "optuna.journal"
STATUS = {TrialState.COMPLETE: "FINISHED", TrialState.FAIL: "FAILED", TrialState.PRUNED: "KILLED"}


class ResumeError(ValueError):
    pass


def read_sweep(out_dir: Path) -> dict:
    f = out_dir / SWEEP_FILE
    if not f.is_file():
        raise ResumeError(f"{out_dir}: not a run directory (no {SWEEP_FILE}); nothing to resume")
    return json.loads(f.read_text())


def write_sweep(out_dir: Path, info: dict) -> None:
    tmp = out_dir / (SWEEP_FILE + ".tmp")
    tmp.write_text(json.dumps(info, indent=1, default=list))
    tmp.replace(out_dir / SWEEP_FILE)


def told_states(journal: Path) -> dict[str, TrialState]:
    """{trial key: state} for every trial in the journal ("<cell_id>-<number>")."""
    storage = open_journal(journal)
    out = {}
    for s in storage.get_all_studies():
        for t in storage.get_all_trials(s._study_id, deepcopy=False):
            out[f"{s.study_name}-{t.number}"] = t.state
    return out


def reconcile(client: MlflowClient, experiment_id: str, sweep_id: str, journal: Path) -> int:
    """Terminate child runs left RUNNING whose trial the journal has told; returns how many were fixed."""
    states = told_states(journal)
    fixed = 0
    for r in client.search_runs([experiment_id], f"tags.sweep_id = '{sweep_id}' and "
                                                 "tags.`healsweep.role` = 'trial' and attributes.status = 'RUNNING'",
                                max_results=50000):
        st = states.get(r.data.tags.get("trial_id", ""))
        if st in STATUS:
            client.set_terminated(r.info.run_id, STATUS[st])
            fixed += 1
    return fixed
