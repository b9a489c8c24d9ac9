"""Where a sweep's MLflow artifacts go: never ``$PWD/mlruns`` (MLflow's default artifact root for a SQL store).
The run directory's own SQLite store keeps them in DIR/artifacts; another SQLite file named by the spec keeps them
in ``mlartifacts`` beside it (they went to the working directory's mlruns/)."""
from __future__ import annotations

from mlflow import MlflowClient

from orchestrator.tracking.store import keep_artifacts_inside, local_tracking_uri


def test_artifacts_stay_beside_their_sqlite_store(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # where MLflow's default would put mlruns/
    run = tmp_path / "runs" / "x"
    run.mkdir(parents=True)
    keep_artifacts_inside(local_tracking_uri(run), run, "healsweep")
    own = MlflowClient(local_tracking_uri(run)).get_experiment_by_name("healsweep")
    assert own.artifact_location == (run / "artifacts").resolve().as_uri()
    (tmp_path / "dbs").mkdir()
    other = f"sqlite:///{tmp_path / 'dbs' / 'other.db'}"
    keep_artifacts_inside(other, run, "healsweep")
    exp = MlflowClient(other).get_experiment_by_name("healsweep")
    assert exp.artifact_location == (tmp_path / "dbs" / "mlartifacts").resolve().as_uri()
    keep_artifacts_inside(other, tmp_path / "runs" / "y", "healsweep")  # a second sweep: the experiment keeps it
    assert MlflowClient(other).get_experiment_by_name("healsweep").artifact_location == exp.artifact_location
    assert not (tmp_path / "mlruns").exists()
