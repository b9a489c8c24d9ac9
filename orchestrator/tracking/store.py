"""A run directory's own MLflow tracking store: its SQLite URI, the experiment with its artifacts inside the run
directory, a copied or moved run directory pointed at its new place, and the client opened with its experiment
ready."""
from __future__ import annotations

import json
import sqlite3
from pathlib import Path

from orchestrator.rundir.files import write_sweep
from orchestrator.tracking.template import seed_sqlite_store


def local_tracking_uri(out_dir) -> str:
    """The default tracking store of a run directory: SQLite inside it."""
    return f"sqlite:///{Path(out_dir).resolve() / 'mlflow.db'}"


def own_db(out_dir: Path, info: dict) -> bool:
    """Whether the sweep tracks into its run directory's own SQLite database (DIR/mlflow.db, or that of the run
    directory it was copied from, which holds a sweep.json too), not a server or a shared database."""
    uri = info.get("tracking_uri", "")
    if not uri.startswith("sqlite:///") or not uri.endswith("/mlflow.db"):
        return False
    where = Path(uri[len("sqlite:///"):]).parent
    return where == Path(out_dir).resolve() or (where / "sweep.json").is_file()


def keep_artifacts_inside(tracking_uri: str, out_dir, experiment: str, own: bool = False) -> None:
    """Never ``$PWD/mlruns`` (MLflow's default artifact root for a SQL store): with the run directory's own SQLite
    store, create the experiment with its artifact root in ``out_dir/artifacts``, so the run directory holds
    everything of a run; with another SQLite file (a spec's ``mlflow.tracking_uri``, possibly shared by sweeps),
    in ``mlartifacts`` beside that file (the MLflow server's default name). An existing experiment keeps its root;
    a server or another database decides its own. ``own``: ``tracking_uri`` is the run directory's own store
    built under another name (a rebuild, moved to DIR/mlflow.db when whole)."""
    own = own or tracking_uri == local_tracking_uri(out_dir)
    if not own and not tracking_uri.startswith("sqlite:///"):
        return
    from mlflow import MlflowClient

    # a copy, not ~1.5 CPU-s of table creation and migrations; for a shared file also what keeps two sweeps that
    # start together from both creating its tables (one ended in "table latest_metrics already exists")
    seed_sqlite_store(Path(tracking_uri[len("sqlite:///"):]))
    root = Path(out_dir).resolve() / "artifacts" if own else Path(tracking_uri[len("sqlite:///"):]).parent / "mlartifacts"
    experiment_id(MlflowClient(tracking_uri), experiment, root.resolve().as_uri())  # (a duplicate: the first's)


def moved_from(run_dir, meta: dict) -> str | None:
    """The directory a moved or copied run directory's sweep.json still names (its tracking URI is the SQLite store
    inside another directory while ``run_dir`` has its own), else None."""
    uri = str(meta.get("tracking_uri") or "")
    if (not uri.startswith("sqlite:///") or not uri.endswith("/mlflow.db") or uri == local_tracking_uri(run_dir)
            or not (Path(run_dir) / "mlflow.db").is_file()):
        return None
    return uri[len("sqlite:///"):-len("/mlflow.db")]


def relocate(run_dir) -> bool:
    """A run directory copied or moved elsewhere: point its sweep.json and its SQLite store (experiment artifact
    locations, run artifact URIs) at the new place. True when something was rewritten."""

    run_dir = Path(run_dir).resolve()
    meta_p, db = run_dir / "sweep.json", run_dir / "mlflow.db"
    if not meta_p.exists() or not db.exists():
        return False
    meta = json.loads(meta_p.read_text(encoding="utf-8"))
    if not isinstance(meta, dict):
        return False  # not a sweep record (the caller's own check says so in one line)
    old = moved_from(run_dir, meta)
    if old is None:
        return False
    with sqlite3.connect(db) as con:
        for table, col in (("experiments", "artifact_location"), ("runs", "artifact_uri")):
            con.execute(f"UPDATE {table} SET {col} = replace({col}, ?, ?)", (old + "/", str(run_dir) + "/"))
    meta["tracking_uri"] = local_tracking_uri(run_dir)
    write_sweep(run_dir, meta)  # whole or not at all
    return True


def experiment_id(client, name: str, artifact_location: str | None = None) -> str:
    """The experiment's id, created when missing. Two sweeps starting together on one shared store can both find
    it missing: the second's create fails as a duplicate, and it takes the first's."""
    from mlflow.exceptions import MlflowException

    exp = client.get_experiment_by_name(name)
    if exp is not None:
        return exp.experiment_id
    try:
        return client.create_experiment(name, artifact_location=artifact_location)
    except MlflowException:
        exp = client.get_experiment_by_name(name)
        if exp is None:  # not a duplicate: MLflow's own error
            raise
        return exp.experiment_id


def open_tracking(uri: str, experiment: str):
    """The MLflow client with its experiment ready (a new SQLite store creates its tables: seconds), opened
    while the models, dense and mask stages run."""
    from mlflow import MlflowClient

    client = MlflowClient(uri)
    experiment_id(client, experiment)
    return client
