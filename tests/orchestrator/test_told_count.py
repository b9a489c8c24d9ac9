"""A run directory without a trial record: a sweep from before trials.jsonl (its told trials must be recorded
from the journal and MLflow), or a new sweep interrupted before its first result (nothing to record). Only trials
the journal has told count: a trial that was only asked (RUNNING at the interrupt) is not a result."""
from __future__ import annotations

import json

import optuna

from orchestrator.lifecycle.doctor import Doctor
from orchestrator.lifecycle.resume import told_count
from orchestrator.search import open_journal


def _run_dir(tmp_path, told: int, asked: int):
    """A run directory whose journal holds one cell's study (named by its cell id, the older naming) with
    ``told`` finished trials and ``asked`` more only asked; no trials.jsonl, no mlflow.db."""
    run = tmp_path / "run"
    run.mkdir(parents=True)
    (run / "sweep.json").write_text(json.dumps({"sweep_id": "s", "tracking_uri": f"sqlite:///{run}/mlflow.db",
                                                "store": str(tmp_path / "store"), "cache": str(tmp_path), "spec": {}}))
    storage = open_journal(run / "optuna.journal")
    study = optuna.create_study(study_name="0123456789ab", storage=storage, direction="maximize")
    for i in range(told + asked):
        t = study.ask()
        if i < told:
            study.tell(t, 0.5)
    return run


def test_only_told_trials_count(tmp_path):
    assert told_count(_run_dir(tmp_path / "a", told=0, asked=2) / "optuna.journal") == 0
    assert told_count(_run_dir(tmp_path / "b", told=1, asked=2) / "optuna.journal") == 1


def test_doctor_finds_nothing_missing_in_a_sweep_interrupted_before_its_first_result(tmp_path):
    """It said 'trials.jsonl: missing (a sweep from before it; 2 trials in the journal)' and exit 1 after a Ctrl-C
    while the first two trials ran."""
    assert Doctor(_run_dir(tmp_path / "a", told=0, asked=2))._no_record() == []
