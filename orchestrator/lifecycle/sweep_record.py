"""A damaged ``sweep.json`` rebuilt from what else the run directory holds (``healsweep doctor DIR --repair``).

Every command reads sweep.json first (the sweep id, the tracking URI, the store, the spec), so a damaged one stopped
them all, ``doctor --repair`` included, though nothing in it is unique: the trial record's parent line names the
parent run and the sweep id, the run directory's own SQLite database holds the parent run (its experiment, the
``store`` param, each session's ``dense_forward_images_session``), and the parent run's ``spec.json`` artifact lies
under ``DIR/artifacts``. Only the model cache is not recorded elsewhere: the rebuilt file names ``doctor --cache`` or the
default one, and the problem line says so. A sweep tracked on a server cannot be rebuilt (its URI was only in sweep.json).
"""
from __future__ import annotations

import json
from pathlib import Path

from orchestrator.lifecycle.resume import DB_FILE, db_problem
from orchestrator.rundir import records
from orchestrator.rundir.files import SWEEP_FILE, ResumeError, read_sweep, spec_lacks, write_sweep
from orchestrator.tracking.store import local_tracking_uri


def sweep_damage(out_dir: Path) -> str | None:
    """Why ``out_dir``'s sweep.json cannot be read, or None; a missing one is damage only in a run directory (its
    trials.jsonl is there: rebuilt as an unreadable one is), else None (read_sweep says it is no run directory)."""
    if not (Path(out_dir) / SWEEP_FILE).is_file():
        return "missing" if (Path(out_dir) / records.TRIALS_FILE).is_file() else None
    try:
        return spec_lacks(read_sweep(Path(out_dir), repair_hint=False))
    except ResumeError as e:
        return str(e).split(": ", 1)[-1]


def rebuilt_sweep(out_dir: Path, cache: Path) -> dict:
    """sweep.json's content from the record, the database and the spec artifact; ResumeError (why not) when one
    of them is missing or damaged."""
    out_dir = Path(out_dir).resolve()
    parent = records.parent(records.scan(out_dir / records.TRIALS_FILE))
    if parent is None or not isinstance(parent.get("run_id"), str):
        raise ResumeError(f"{records.TRIALS_FILE} has no parent-run line to rebuild it from")
    db = out_dir / DB_FILE
    if db.is_file() and db_problem(db):
        raise ResumeError(f"the run directory's {DB_FILE} is damaged too (each is rebuilt from the other: restore one "
                          "of them from a copy)")
    if not db.is_file():
        raise ResumeError(f"the run directory's {DB_FILE} is missing (a sweep tracked on a server cannot be rebuilt: "
                          "its URI was only in sweep.json)")
    from mlflow import MlflowClient

    client = MlflowClient(local_tracking_uri(out_dir))
    run = _parent_run(client, parent)
    spec = _spec(out_dir, (run.info.run_id, parent["run_id"]))
    dense = {str(m.step): int(m.value) for m in client.get_metric_history(run.info.run_id,
                                                                           "dense_forward_images_session")}
    out = {"sweep_id": str((parent.get("tags") or {}).get("sweep_id") or run.data.tags.get("sweep_id")),
            "name": spec.get("name") or parent.get("run_name"), "tracking_uri": local_tracking_uri(out_dir),
            "experiment": client.get_experiment(run.info.experiment_id).name,
            "store": run.data.params.get("store") or str(cache.parent / "store"), "cache": str(Path(cache).resolve()),
            "spec": spec, "dense_forward_images": dense, "parent_run_id": run.info.run_id}
    if run.data.tags.get("partial") == "false":  # the sweep ended complete: so does the rebuilt record of it
        out["complete"] = {"told": len(records.trials(records.scan(out_dir / records.TRIALS_FILE)))}
    return out


def _parent_run(client, parent: dict):
    """The sweep's parent run in the database: the record's, or (a database rebuilt since gave it a new id) the
    one run tagged as this sweep's parent; ResumeError when there is none."""
    from mlflow.exceptions import MlflowException

    try:
        return client.get_run(parent["run_id"])
    except MlflowException:
        pass
    sweep = (parent.get("tags") or {}).get("sweep_id")
    exps = [e.experiment_id for e in client.search_experiments()]
    runs = client.search_runs(exps, f"tags.sweep_id = '{sweep}' and tags.`healsweep.role` = 'sweep'",
                              order_by=["attributes.start_time DESC"]) if sweep and exps else []
    if not runs:
        raise ResumeError(f"its parent run ({parent['run_id']}, sweep {sweep}) is not in the run directory's {DB_FILE}")
    return runs[0]


def _spec(out_dir: Path, run_ids: tuple[str, ...]) -> dict:
    """The parent run's spec artifact (spec.json) under the first of ``run_ids`` that has one."""
    files = [out_dir / "artifacts" / r / "artifacts" / "spec.json" for r in run_ids]
    f = next((f for f in files if f.is_file()), files[-1])
    try:
        return json.loads(f.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ResumeError(f"the parent run's spec ({f}) is unreadable ({type(e).__name__})") from None


def rebuild_sweep(out_dir: Path, cache: Path) -> str:
    """Write the rebuilt sweep.json, the damaged one kept beside it as ``sweep.json.damaged``; -> what was done."""
    out_dir = Path(out_dir)
    info = rebuilt_sweep(out_dir, cache)
    kept = (out_dir / SWEEP_FILE).is_file()  # a lost one: nothing to keep
    if kept:
        (out_dir / SWEEP_FILE).replace(out_dir / f"{SWEEP_FILE}.damaged")
    write_sweep(out_dir, info)
    return (f"rebuilt from {records.TRIALS_FILE}, {DB_FILE} and the parent run's spec.json"
            + (f" (the damaged one kept as {SWEEP_FILE}.damaged)" if kept else ""))
