"""The Optuna journal and the MLflow runs of a sweep, rebuilt from its trial record (orchestrator/rundir/records.py).

- ``rebuild_journal``: a fresh ``optuna.journal`` in which every recorded trial is told exactly as recorded; a
  trial the old journal asked (or told) but the record does not hold is asked again (RUNNING, with what the old
  journal still knows of its parameters), so a resume runs it again; so is a trial number neither holds (the
  numbers of the trials after it must not move): the design derives its parameters again.
- ``sync_runs``: every recorded trial has exactly one MLflow run (missing ones recreated from the record, extra
  copies deleted).
- ``rebuild_tracking``: a fresh SQLite tracking store in the run directory (the damaged one moved aside): the
  parent run (its artifacts copied from the run directory's artifacts/) and every recorded trial's run.
"""
from __future__ import annotations

import json
import os
import tempfile
import time
import uuid
from pathlib import Path
from typing import Collection

from orchestrator.rundir import records
from orchestrator.rundir.files import told_states, write_sweep
from orchestrator.tracking.store import experiment_id, keep_artifacts_inside, local_tracking_uri, open_tracking
from tasks.atomic import TMP_PREFIX, DiskFullError, is_disk_full

DONE = ("COMPLETE", "FAIL", "PRUNED")


# ------------------------------------------------------------------------------------------------ journal
def _old_studies(journal: Path) -> dict[str, dict]:
    """{study name: {"attrs", "direction", "trials": {number: FrozenTrial}}} of whatever the old journal still
    replays (its intact lines only); {} when nothing does."""
    import optuna

    s = records.scan(journal, records.check_json)
    if not s.records:
        return {}
    with tempfile.TemporaryDirectory(prefix="healsweep-journal-") as d:
        tmp = Path(d) / "old.journal"
        tmp.write_bytes(b"".join(json.dumps(r).encode() + b"\n" for r in s.records))
        try:
            storage = optuna.storages.JournalStorage(optuna.storages.journal.JournalFileBackend(str(tmp)))
            return {st.study_name: {"attrs": dict(st.user_attrs), "direction": st.direction.name,
                                    "trials": {t.number: t for t in storage.get_all_trials(st._study_id)}}
                    for st in storage.get_all_studies()}
        except Exception:  # noqa: BLE001 - a journal whose intact lines do not replay: the record alone
            return {}


def _recorded_studies(trials: dict[str, dict]) -> dict[str, dict]:
    out: dict[str, dict] = {}
    for rec in trials.values():
        o = rec["optuna"]
        st = out.setdefault(o["study"], {"attrs": o["study_attrs"], "direction": o["direction"], "trials": {}})
        st["trials"][int(o["number"])] = o
    return out


def _from_record(o: dict):
    import optuna
    from optuna.distributions import json_to_distribution
    from optuna.trial import TrialState

    state = TrialState[o["state"]]
    return optuna.trial.create_trial(
        state=state, value=o["value"] if state == TrialState.COMPLETE else None, params=o["params"],
        distributions={k: json_to_distribution(v) for k, v in o["distributions"].items()},
        user_attrs=o["user_attrs"], intermediate_values={int(k): v for k, v in o["intermediate"].items()})


def _asked(t=None):
    """A trial the record does not hold: asked again (RUNNING) with what the old journal still knows of it (its
    parameters and attributes; nothing for a number the old journal lost too: the design derives them again,
    orchestrator/search/base.py ``_derive_params``)."""
    import optuna
    from optuna.trial import TrialState

    if t is None:
        return optuna.trial.create_trial(state=TrialState.RUNNING)
    return optuna.trial.create_trial(state=TrialState.RUNNING, params=t.params, distributions=t.distributions,
                                     user_attrs=t.user_attrs)


def rebuild_journal(journal: Path, trials: dict[str, dict], forget: Collection[tuple[str, int]] = ()) -> dict[str, int]:
    """Rewrite ``journal`` from the record (see the module docstring); -> counts told / asked. ``forget``: (study,
    number) of trials the record does not hold that are asked again without what the old journal knows of them
    (the design derives them again: a re-evaluation of a winner that may change, orchestrator/tracking/retry.py)."""
    import optuna
    from optuna.study import StudyDirection

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    old, rec = _old_studies(journal), _recorded_studies(trials)
    counts = {"told": 0, "asked": 0}
    fd, tmp = tempfile.mkstemp(dir=journal.parent, prefix=".tmp-", suffix="-optuna.journal")
    os.close(fd)
    try:
        storage = optuna.storages.JournalStorage(optuna.storages.journal.JournalFileBackend(tmp))
        for name in [*old, *(n for n in rec if n not in old)]:
            base = rec.get(name) or old[name]
            sid = storage.create_new_study([StudyDirection[base["direction"]]], name)
            for k, v in (old.get(name) or base)["attrs"].items():
                storage.set_study_user_attr(sid, k, v)
            told, asked = rec.get(name, {}).get("trials", {}), old.get(name, {}).get("trials", {})
            for n in range(max([*told, *asked], default=-1) + 1):
                counts["told" if n in told else "asked"] += 1
                again = None if (name, n) in forget else asked.get(n)
                storage.create_new_trial(sid, template_trial=_from_record(told[n]) if n in told else _asked(again))
        del storage
        os.replace(tmp, journal)
    except OSError as e:
        if is_disk_full(e) and not isinstance(e, DiskFullError):
            raise DiskFullError(journal, journal.stat().st_size if journal.exists() else None) from e
        raise
    finally:
        Path(tmp).unlink(missing_ok=True)
    return counts


def journal_disagrees(journal: Path, trials: dict[str, dict], told: dict | None = None) -> list[str]:
    """Trial ids whose journal state is not the recorded one: recorded but not told (or told otherwise), told
    but not recorded (the record is the truth: it runs again). ``told``: ``told_states(journal)`` when the caller
    has it already (the replay is the cost)."""

    if told is None:
        told = told_states(journal) if journal.exists() else {}
    states = {k: v.name for k, v in told.items()}
    out = [tid for tid, r in trials.items() if states.get(tid) != r["optuna"]["state"]]
    return out + [tid for tid, st in states.items() if st in DONE and tid not in trials]


# ------------------------------------------------------------------------------------------------ MLflow
def create_run(client, exp_id: str, parent_id: str, rec: dict) -> str:
    """One trial's MLflow run, recreated from its record; -> the new run id."""
    from mlflow.entities import Metric, Param

    m = rec["mlflow"]
    tags = {**m["tags"], "mlflow.parentRunId": parent_id}
    run = client.create_run(exp_id, start_time=m["start_time"], tags=tags, run_name=m["run_name"])
    rid = run.info.run_id
    ts = m["end_time"] or m["start_time"] or int(time.time() * 1000)
    params = [Param(k, v) for k, v in m["params"].items()]
    metrics = [Metric(k, v, ts, m["step"]) for k, v in m["metrics"].items()]
    metrics += [Metric(k, v, t, step) for k, hs in m["history"].items() for step, v, t in hs]
    for i in range(0, len(params), 100):
        client.log_batch(rid, params=params[i : i + 100])
    for i in range(0, len(metrics), 1000):
        client.log_batch(rid, metrics=metrics[i : i + 1000])
    client.set_terminated(rid, m["status"], end_time=m["end_time"])
    return rid


def _sweep_runs(client, exp_id: str, sweep_id: str, role: str) -> list:
    """The sweep's active runs of one role ("trial" or "sweep", its parent)."""
    return client.search_runs([exp_id], f"tags.sweep_id = '{sweep_id}' and tags.`healsweep.role` = '{role}'",
                              max_results=50000)


def _trial_runs(client, exp_id: str, sweep_id: str) -> dict[str, list]:
    runs: dict[str, list] = {}
    for r in _sweep_runs(client, exp_id, sweep_id, "trial"):
        runs.setdefault(r.data.tags.get("trial_id", ""), []).append(r)
    return runs


def runs_off(client, exp_id: str | None, sweep_id: str, trials: dict[str, dict]) -> list[str]:
    """Recorded trials (with an MLflow part) that do not have exactly one run in their recorded status: lost,
    doubled, or left RUNNING by a driver killed after the record (what ``sync_runs`` settles)."""
    runs = _trial_runs(client, exp_id, sweep_id) if exp_id is not None else {}
    return sorted(t for t, rec in trials.items() if rec.get("mlflow") and (
        len(runs.get(t, [])) != 1 or runs[t][0].info.status != rec["mlflow"]["status"]))


def unrecorded_running(client, exp_id: str, sweep_id: str, trials: dict[str, dict]) -> list[str]:
    """Run ids of the sweep's trial runs left RUNNING whose trial the record does not hold: the trials that were
    running when a driver stopped without ending the sweep (they run again on resume, under a new run)."""
    return sorted(r.info.run_id for t, rs in _trial_runs(client, exp_id, sweep_id).items() if t not in trials
                  for r in rs if r.info.status == "RUNNING")


def sync_runs(client, exp_id: str, sweep_id: str, parent_id: str, trials: dict[str, dict]) -> dict[str, int]:
    """Every recorded trial with exactly one MLflow run, in its recorded status; -> counts created / deleted /
    ended (a run left RUNNING or otherwise off its record, set to the recorded status)."""
    runs = _trial_runs(client, exp_id, sweep_id)
    counts = {"created": 0, "deleted": 0, "ended": 0}
    for tid, rec in trials.items():
        have = runs.get(tid, [])
        if rec.get("mlflow") is None:
            continue
        if not have:
            create_run(client, exp_id, parent_id, rec)
            counts["created"] += 1
            continue
        keep = next((r for r in have if r.info.run_id == rec["mlflow"]["run_id"]), have[0])
        for r in have:
            if r is not keep:
                client.delete_run(r.info.run_id)
                counts["deleted"] += 1
        if keep.info.status != rec["mlflow"]["status"]:
            client.set_terminated(keep.info.run_id, rec["mlflow"]["status"], end_time=rec["mlflow"]["end_time"])
            counts["ended"] += 1
    return counts


def _parent(client, exp_id: str, info: dict, rec: dict | None) -> str:
    from mlflow.entities import Param

    tags = (rec or {}).get("tags") or {"sweep_id": info["sweep_id"], "healsweep.role": "sweep"}
    run = client.create_run(exp_id, start_time=(rec or {}).get("start_time"), tags=tags,
                            run_name=(rec or {}).get("run_name") or info.get("name"))
    params = [Param(k, v) for k, v in ((rec or {}).get("params") or {}).items()]
    for i in range(0, len(params), 100):
        client.log_batch(run.info.run_id, params=params[i : i + 100])
    return run.info.run_id


def _parent_status(info: dict, prec: dict | None) -> str:
    """A recreated parent run's status: FINISHED for a sweep that ended complete (sweep.json's ``complete``; the
    record's parent line is written at the first trial, before the end's ``partial`` tag), else by that tag."""
    partial = ((prec or {}).get("tags") or {}).get("partial", "true")
    return "FINISHED" if isinstance(info.get("complete"), dict) or partial == "false" else "KILLED"


def parent_gone(client, parent_id: str | None) -> str | None:
    """Why the sweep's parent run cannot be reopened ("deleted", "missing"), or None when it can."""
    if not parent_id:
        return None
    from mlflow.exceptions import MlflowException

    try:
        run = client.get_run(parent_id)
    except MlflowException as e:  # its rows deleted; any other error (a server's timeout, 5xx, refused credentials)
        if e.error_code == "RESOURCE_DOES_NOT_EXIST":  # is raised: "missing" would reopen a new parent run and
            return "missing"  # re-point every trial run at it
        raise
    return "deleted" if run.info.lifecycle_stage != "active" else None


def stray_parents(client, exp_id: str | None, sweep_id: str, parent_id: str | None) -> list[str]:
    """Active parent runs of the sweep other than its own (sweep.json's): left by a driver killed between creating
    its parent run and writing the id, or by a repair cut short. The report reads the sweep's first parent run."""
    if exp_id is None or not parent_id:
        return []
    return sorted(r.info.run_id for r in _sweep_runs(client, exp_id, sweep_id, "sweep") if r.info.run_id != parent_id)


def drop_stray_parents(client, exp_id: str, sweep_id: str, parent_id: str) -> int:
    """Delete the sweep's stray parent runs (``stray_parents``; MLflow keeps them as deleted), any trial run under
    one pointed at the sweep's own parent first; -> how many."""
    strays = set(stray_parents(client, exp_id, sweep_id, parent_id))
    if not strays:
        return 0
    for r in _sweep_runs(client, exp_id, sweep_id, "trial"):
        if r.data.tags.get("mlflow.parentRunId") in strays:
            client.set_tag(r.info.run_id, "mlflow.parentRunId", parent_id)
    for run_id in sorted(strays):
        client.delete_run(run_id)
    return len(strays)


def reopen_parent(client, exp_id: str, out_dir: Path, info: dict) -> str:
    """The parent run back: a deleted one restored; a missing one recreated from the record's parent line (its
    tags, params, artifacts kept under DIR/artifacts), the sweep's trial runs pointed at it and sweep.json updated
    (a resume updated a run that no longer existed and ended in MLflow's traceback). -> what was done."""
    old = info["parent_run_id"]
    if parent_gone(client, old) == "deleted":
        client.restore_run(old)
        return f"parent run {old} restored"
    prec = records.parent(records.scan(Path(out_dir) / records.TRIALS_FILE))
    new = _parent(client, exp_id, info, prec)
    for arts in (Path(out_dir) / "artifacts").glob(f"*/{old}/artifacts"):
        client.log_artifacts(new, str(arts))
    for r in _sweep_runs(client, exp_id, info["sweep_id"], "trial"):
        client.set_tag(r.info.run_id, "mlflow.parentRunId", new)
    client.set_terminated(new, _parent_status(info, prec))
    info["parent_run_id"] = new
    write_sweep(Path(out_dir), info)
    return f"parent run {old} recreated from {records.TRIALS_FILE} as {new}"


def rebuild_tracking(out_dir: Path, info: dict, scan: records.Scan) -> dict[str, int]:
    """A fresh tracking store for the run directory's own SQLite database, rebuilt from the record beside it
    (``.tmp-<hex>-mlflow.db.rebuilding-<utc time>``) and moved into place only when whole: a rebuild that fails (a full disk,
    a read-only directory) leaves the old database where it was and no half-built one (every later command then
    ended in a traceback). The old one, if any, is kept as ``mlflow.db.damaged-<utc time>``; sweep.json points at
    the new parent run."""
    out_dir = Path(out_dir).resolve()
    db = out_dir / "mlflow.db"
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    # a temporary file's name (doctor names and removes one a killed rebuild left), unique to this attempt (MLflow
    # keeps an engine per URI: a second attempt at the same name would meet the first one's closed file)
    new = out_dir / f"{TMP_PREFIX}{uuid.uuid4().hex[:8]}-mlflow.db.rebuilding-{stamp}"
    # a read-only directory: its one line now, not after MLflow's retries (~2 minutes)
    tempfile.TemporaryFile(dir=out_dir, prefix=f"{TMP_PREFIX}mlflow.db.rebuilding-").close()
    try:
        parent_id, counts = _rebuild_into(new, out_dir, info, scan)
    except BaseException:
        for suffix in ("", "-wal", "-shm", "-journal"):
            Path(f"{new}{suffix}").unlink(missing_ok=True)
        raise
    for suffix in ("", "-wal", "-shm", "-journal"):
        if Path(f"{db}{suffix}").exists():
            os.replace(f"{db}{suffix}", f"{db}.damaged-{stamp}{suffix}")
    os.replace(new, db)
    _reconnect(local_tracking_uri(out_dir), f"sqlite:///{new}")
    info.update(tracking_uri=local_tracking_uri(out_dir), parent_run_id=parent_id)
    write_sweep(out_dir, info)
    return counts


def _reconnect(*uris: str) -> None:
    """Close the pooled connections MLflow keeps per database URI (one engine each, for the process's life): they
    still read the file that was at the path before the rebuilt one replaced it (later commands in this process
    found the damaged database again)."""
    from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore

    engines = getattr(SqlAlchemyStore, "_engine_map", {})  # MLflow's cache (3.x); without it nothing is kept
    for uri in uris:
        if (engine := engines.get(uri)) is not None:
            engine.dispose()


def _rebuild_into(new: Path, out_dir: Path, info: dict, scan: records.Scan) -> tuple[str, dict[str, int]]:
    """The run directory's tracking store built in the SQLite file ``new`` (artifacts in out_dir/artifacts, as the
    own store's): -> (the new parent run's id, sync_runs' counts)."""
    uri, experiment = f"sqlite:///{new}", info.get("experiment") or "healsweep"
    keep_artifacts_inside(uri, out_dir, experiment, own=True)
    client = open_tracking(uri, experiment)
    exp_id = experiment_id(client, experiment)
    old_parent, prec = info.get("parent_run_id"), records.parent(scan)
    parent_id = _parent(client, exp_id, info, prec)
    arts = out_dir / "artifacts"  # <run id>/artifacts (the experiment's root), or an older <experiment>/<run id>/
    for old in [arts / old_parent / "artifacts", *arts.glob(f"*/{old_parent}/artifacts")] if old_parent else ():
        if old.is_dir():
            client.log_artifacts(parent_id, str(old))
    counts = sync_runs(client, exp_id, info["sweep_id"], parent_id, records.trials(scan))
    _sweep_facts(client, parent_id, info, prec)
    return parent_id, counts


def _sweep_facts(client, parent_id: str, info: dict, prec: dict | None) -> None:
    """What sweep.json holds that a later rebuild of sweep.json reads from the parent run (lifecycle/sweep_record.py):
    each session's dense images (metric ``dense_forward_images_session``) and, for a sweep that ended complete, the
    end's ``partial`` tag; then the run's status."""
    from mlflow.entities import Metric, RunTag

    now, status = int(time.time() * 1000), _parent_status(info, prec)
    dense = info.get("dense_forward_images") if isinstance(info.get("dense_forward_images"), dict) else {}
    metrics = [Metric("dense_forward_images_session", float(v), now, int(k)) for k, v in dense.items()
               if str(k).isdigit() and isinstance(v, (int, float))]
    tags = [RunTag("partial", "false")] if status == "FINISHED" else []
    client.log_batch(parent_id, metrics=metrics, tags=tags)
    client.set_terminated(parent_id, status)
