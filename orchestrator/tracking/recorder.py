"""Writing ``DIR/trials.jsonl`` (orchestrator/rundir/records.py) from the driver.

``TrialRecorder`` is called by the searcher on the MLflow writer's thread right before a trial's Optuna tell
(orchestrator/search/tune.py): every MLflow write of that trial's results is done by then, so the record reads
the run back from MLflow (what a rebuild must restore) and the trial back from its study. A record that cannot
be written (a full disk) raises: the tell is not written either, the sweep is stopped (``faults.stop``) and the
trial runs again on resume.
"""
from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

from orchestrator.raytune.cluster import is_remote, store_subdir
from orchestrator.rundir import faults, records
from orchestrator.rundir.files import JOURNAL_FILE, SWEEP_FILE
from orchestrator.rundir.records import PARENT, TRIAL
from tasks.saved_trial import weights_seen

EPOCH_METRICS = ("train_loss", "selection_acc", "rows_streamed")  # orchestrator/tracking/logger.py: logged per epoch
STATUS = {"COMPLETE": "FINISHED", "FAIL": "FAILED", "PRUNED": "KILLED"}  # Optuna state -> MLflow status


def _num(v: float | None) -> float | None:
    return None if v is None or not math.isfinite(v) else float(v)


def optuna_part(study, trial, stage: str, value: float | None, state: str) -> dict:
    """The Optuna side of a record: what ``rebuild`` needs to recreate the trial in its study (and the study)."""
    from optuna.distributions import distribution_to_json

    return {"study": study.study_name, "study_attrs": dict(study.user_attrs), "direction": study.direction.name,
            "number": trial.number, "stage": stage, "params": dict(trial.params),
            "distributions": {k: distribution_to_json(d) for k, d in trial.distributions.items()},
            "user_attrs": dict(trial.user_attrs),
            "intermediate": {str(k): v for k, v in trial.intermediate_values.items()},
            "value": _num(value), "state": state}


def mlflow_part(client, run_id: str | None, status: str) -> dict | None:
    """The MLflow side of a record, read back from the run: name, tags (without MLflow's own), params, final
    metrics (latest value and its step) and the per-epoch history. None when the run cannot be read."""
    if not run_id:
        return None
    try:
        run = client.get_run(run_id)
        history = {k: [[m.step, m.value, m.timestamp] for m in client.get_metric_history(run_id, k)]
                   for k in EPOCH_METRICS if k in run.data.metrics}
    except Exception:  # noqa: BLE001 - the tracking store failing must not lose the record of a finished trial
        return None
    steps = [h[0] for hs in history.values() for h in hs]
    return {"run_id": run_id, "run_name": run.info.run_name, "status": status,
            "start_time": run.info.start_time, "end_time": run.info.end_time or int(time.time() * 1000),
            "tags": {k: v for k, v in run.data.tags.items() if not k.startswith("mlflow.")},
            "params": dict(run.data.params),
            "metrics": {k: v for k, v in run.data.metrics.items() if k not in history},
            "step": max(steps, default=0), "history": history}


def parent_record(client, parent_id: str) -> dict:
    run = client.get_run(parent_id)
    return {"kind": PARENT, "run_id": parent_id, "run_name": run.info.run_name, "start_time": run.info.start_time,
            "tags": {k: v for k, v in run.data.tags.items() if not k.startswith("mlflow.")},
            "params": dict(run.data.params)}


class TrialRecorder:
    """``record(ask, value, state)``: one trial line (and, first in a session, the parent run's line)."""

    def __init__(self, out_dir: Path, design, client_of, run_of, parent_of, stored=None) -> None:
        self.path = Path(out_dir) / records.TRIALS_FILE
        self.design, self.client_of, self.run_of, self.parent_of = design, client_of, run_of, parent_of
        self.stored = stored  # trial id -> whether a remote store holds its healed weights (``stored_weights``)
        self.parent_done = False
        self.written = 0

    def __call__(self, ask, value: float | None, state: Any) -> None:
        try:
            self._write(ask, value, state)
        except OSError as e:
            faults.stop(e)  # the sweep stops (Tune's stopper); the caller's tell is skipped: it runs again
            raise

    def _write(self, ask, value, state) -> None:
        if faults.stopped() is not None:  # an MLflow write of this trial failed (full disk): no record, no tell
            raise faults.stopped()
        client = self.client_of()
        if not self.parent_done:
            try:
                rec = parent_record(client, self.parent_of())
            except Exception:  # noqa: BLE001 - without its parent line a rebuild names the parent after the spec;
                rec = None  # the next trial's record tries again
            if rec is not None:
                records.append(self.path, rec)
                self.parent_done = True
        study = self.design.study(ask.cell_id, ask.stage)
        trial = study.trials[ask.number]
        name = getattr(state, "name", str(state))
        if name == "COMPLETE" and _num(value) is None:
            name = "FAIL"  # what the design's tell makes of a missing or non-finite objective
        rec = {"kind": TRIAL, "trial_id": ask.trial_id, "cell_id": ask.cell_id,
               "optuna": optuna_part(study, trial, ask.stage, value, name),
               "mlflow": mlflow_part(client, self.run_of(ask.trial_id), STATUS.get(name, "FAILED"))}
        if name == "COMPLETE":  # its healed weights, as this driver sees them now (lifecycle/resume.py lost_weights)
            rec["weights"] = weights_where(self.path.parent, ask.trial_id, self.stored)
        records.append(self.path, rec)
        self.written += 1


def stored_weights(paths: dict, sweep_id: str):
    """``TrialRecorder``'s ``stored``: with a remote store, a trial id -> whether ``<store>/healed/<sweep id>/``
    holds its healed weights (tasks/store/healed.py); None otherwise."""
    if not paths.get("healed"):
        return None

    def stored(trial_id: str) -> bool:
        from tasks.store.healed import HealedStore

        return HealedStore(paths["healed"]).has(sweep_id, trial_id)
    return stored


def run_stored(out_dir: Path, sweep_id: str):
    """:func:`stored_weights` of the sweep in ``out_dir`` (its sweep.json's ``store.uri``), for a record written
    after the sweep (``backfill``); None when its store is not remote or sweep.json cannot tell."""
    try:
        uri = json.loads((Path(out_dir) / SWEEP_FILE).read_text(encoding="utf-8"))["spec"]["store"]["uri"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return stored_weights({"healed": store_subdir(uri, "healed")}, sweep_id) if is_remote(uri) else None


def weights_where(run_dir: Path, trial_id: str, stored) -> str:
    """A COMPLETE trial's ``weights``: "saved" (whole in the run directory), "store" (a node without the run
    directory put them in the store's healed/: ``stored``, of :func:`stored_weights`) or "elsewhere"."""
    seen = weights_seen(run_dir, trial_id)
    return "store" if seen == "elsewhere" and stored is not None and _stored(stored, trial_id) else seen


def _stored(stored, trial_id: str) -> bool:
    try:
        return bool(stored(trial_id))
    except Exception:  # noqa: BLE001 - an unreachable store must not lose the record line: "elsewhere" stands
        return False


def backfill(out_dir: Path, client, experiment: str, sweep_id: str, parent_id: str | None) -> int:
    """The record of a sweep from before ``trials.jsonl``: one line per trial its journal told, from the trial and
    its MLflow run (``healsweep doctor --repair``); -> trials recorded."""
    import optuna

    from orchestrator.search import Ask, journal_cells, open_journal

    path, storage = Path(out_dir) / records.TRIALS_FILE, open_journal(Path(out_dir) / JOURNAL_FILE)
    stored = run_stored(out_dir, sweep_id)
    exp = client.get_experiment_by_name(experiment)
    runs = {} if exp is None else {
        r.data.tags.get("trial_id"): r.info.run_id for r in client.search_runs(
            [exp.experiment_id], f"tags.sweep_id = '{sweep_id}' and tags.`healsweep.role` = 'trial'", max_results=50000)}
    out = [parent_record(client, parent_id)] if parent_id else []
    for cid, studies in journal_cells(storage).items():
        for stage, sid in studies.items():
            study = optuna.load_study(study_name=storage.get_study_name_from_id(sid), storage=storage)
            for t in study.get_trials(deepcopy=False):
                if t.state.name in STATUS:
                    tid = Ask(cid, t.number, {}, stage).trial_id
                    out.append({"kind": TRIAL, "trial_id": tid, "cell_id": cid,
                                "optuna": optuna_part(study, t, stage, t.value, t.state.name),
                                "mlflow": mlflow_part(client, runs.get(tid), STATUS[t.state.name]),
                                **({"weights": weights_where(out_dir, tid, stored)} if t.state.name == "COMPLETE" else {})})
    records.rewrite(path, out)  # whole or not at all
    return len(out) - bool(parent_id)
