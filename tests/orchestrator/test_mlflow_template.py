"""A run directory's SQLite tracking store seeded from a template (orchestrator/tracking/template.py): the same
schema MLflow creates itself, the Default experiment inside the run directory, a usable store, and nothing
seeded over an existing store or when templates are off."""
import sqlite3
from pathlib import Path

import pytest

from orchestrator.tracking import template as mt

pytestmark = pytest.mark.timeout(120)


def _schema(db: Path) -> tuple:
    with sqlite3.connect(db) as con:
        # each statement's lines sorted: MLflow's own migrations order a table's constraints differently run to run
        tables = sorted(tuple(sorted(ln.strip().rstrip(",") for ln in r[0].splitlines()))
                        for r in con.execute("SELECT sql FROM sqlite_master WHERE sql IS NOT NULL"))
        version = con.execute("SELECT version_num FROM alembic_version").fetchall()
    con.close()
    return tuple(tables), tuple(version)


def test_seeded_store_has_mlflows_own_schema_and_works(tmp_path, monkeypatch):
    from mlflow import MlflowClient
    from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore

    monkeypatch.setenv(mt.TEMPLATE_ENV, str(tmp_path / "templates"))
    own = tmp_path / "own" / "mlflow.db"  # a store MLflow creates itself, for comparison
    own.parent.mkdir()
    SqlAlchemyStore(f"sqlite:///{own}", (tmp_path / "own" / "mlruns").as_uri()).engine.dispose()
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    db = run_dir / "mlflow.db"
    assert mt.seed_sqlite_store(db) is True
    assert mt.template_path(tmp_path / "templates").is_file()  # made on first use, keyed by the MLflow version
    assert _schema(db) == _schema(own)
    client = MlflowClient(f"sqlite:///{db}")
    default = client.get_experiment("0")
    assert default.name == "Default" and default.artifact_location == (run_dir / "artifacts" / "0").as_uri()
    eid = client.create_experiment("x", artifact_location=(run_dir / "artifacts").as_uri())
    run = client.create_run(eid)
    client.log_metric(run.info.run_id, "m", 1.5)
    assert client.get_run(run.info.run_id).data.metrics == {"m": 1.5}
    second = tmp_path / "run2" / "mlflow.db"  # the next run directory copies the same template
    second.parent.mkdir()
    assert mt.seed_sqlite_store(second) is True and MlflowClient(f"sqlite:///{second}").search_experiments(
        filter_string="name = 'x'") == []


def test_existing_store_kept_and_templates_off(tmp_path, monkeypatch):
    monkeypatch.setenv(mt.TEMPLATE_ENV, str(tmp_path / "templates"))
    db = tmp_path / "mlflow.db"
    db.write_bytes(b"not a template")
    assert mt.seed_sqlite_store(db) is False and db.read_bytes() == b"not a template"
    monkeypatch.setenv(mt.TEMPLATE_ENV, "off")
    fresh = tmp_path / "fresh" / "mlflow.db"
    fresh.parent.mkdir()
    assert mt.seed_sqlite_store(fresh) is False and not fresh.exists()


def test_unwritable_template_directory_leaves_the_store_to_mlflow(tmp_path, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("a file where the template directory should be")
    monkeypatch.setenv(mt.TEMPLATE_ENV, str(blocker / "templates"))
    db = tmp_path / "mlflow.db"
    assert mt.seed_sqlite_store(db) is False and not db.exists()


def test_sweeps_opening_one_new_shared_store_together_all_get_it(tmp_path, monkeypatch):
    """Two sweeps started together on one new shared SQLite file (a spec's mlflow.tracking_uri or
    MLFLOW_TRACKING_URI) both had MLflow create its tables: one ended in "table latest_metrics already exists". The
    store is now seeded whole and only where none is yet: four processes opening it at once all find one store."""
    import subprocess
    import sys

    from tests.orchestrator.run_cli import REPO, env

    monkeypatch.setenv(mt.TEMPLATE_ENV, str(tmp_path / "templates"))
    mt.make_template(mt.template_path(tmp_path / "templates"))  # (made once; the race is over the shared file)
    uri, go = f"sqlite:///{tmp_path / 'shared' / 'mlflow.db'}", tmp_path / "go"
    code = ("import sys, time; from pathlib import Path\n"
            "from orchestrator.tracking.store import keep_artifacts_inside, open_tracking\n"
            "while not Path(sys.argv[2]).exists(): time.sleep(0.005)\n"
            "keep_artifacts_inside(sys.argv[1], Path(sys.argv[3]), 'healsweep')\n"
            "c = open_tracking(sys.argv[1], 'healsweep')\n"
            "print(c.get_experiment_by_name('healsweep').experiment_id)")
    (tmp_path / "shared").mkdir()
    procs = [subprocess.Popen([sys.executable, "-c", code, uri, str(go), str(tmp_path / f"run{i}")], cwd=REPO,
                              env=env(**{mt.TEMPLATE_ENV: str(tmp_path / "templates")}), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for i in range(4)]
    go.touch()
    outs = [p.communicate(timeout=100) for p in procs]
    assert [p.returncode for p in procs] == [0] * 4, [e[-800:] for _, e in outs]
    assert len({o.strip() for o, _ in outs}) == 1  # one experiment, found by all
    assert not [p for p in (tmp_path / "shared").iterdir() if p.name.startswith(".tmp-")]
