"""A run directory's SQLite tracking store, seeded from a template.

MLflow creates a new SQLite store by building its tables and running every Alembic migration: ~1.5 CPU-s, paid
by every sweep at its busiest moment (while Ray starts and the models load, on 2 cores). A copy of a store that
the same MLflow version created and never wrote to is the same file, made in milliseconds. MLflow verifies a
store's schema version whenever it opens one (and refuses a mismatch), and templates are keyed by the installed
MLflow version, so an upgrade makes a new template.

Templates live in ``.healsweep/mlflow`` under the current directory (``HEALSWEEP_MLFLOW_TEMPLATES``: another
directory; ``off``: no template, MLflow creates every store itself). The copied store's ``Default`` experiment
points into the run directory (``artifacts/0``), like everything else of the run.
"""
from __future__ import annotations

import os
import shutil
import sqlite3
import tempfile
from pathlib import Path

from tasks.atomic import atomic_write

TEMPLATE_ENV = "HEALSWEEP_MLFLOW_TEMPLATES"


def template_dir() -> Path | None:
    v = os.environ.get(TEMPLATE_ENV, "")
    if v.lower() in ("off", "0", "false", "no"):
        return None
    return (Path(v) if v else Path(".healsweep") / "mlflow").resolve()


def template_path(root: Path) -> Path:
    import mlflow

    return root / f"mlflow-{mlflow.__version__}.db"


def seed_sqlite_store(db: str | os.PathLike) -> bool:
    """Copy the template store to ``db`` (making the template first when there is none) unless ``db`` exists or
    templates are off. -> True when ``db`` was seeded."""
    db = Path(db)
    root = template_dir()
    if db.exists() or root is None:
        return False
    tpl = template_path(root)
    try:
        if not tpl.exists():
            make_template(tpl)
    except OSError:  # an unwritable template directory: MLflow creates the store itself, as without templates
        return False
    def write(tmp: str) -> None:
        shutil.copyfile(tpl, tmp)
        with sqlite3.connect(tmp) as con:  # Default points at the creator's $PWD/mlruns: into the run directory
            con.execute("UPDATE experiments SET artifact_location = ? WHERE experiment_id = 0",
                        ((db.parent.resolve() / "artifacts" / "0").as_uri(),))
        con.close()

    try:  # whole, and only where no store is yet: two sweeps seeding one shared file keep the first's (MLflow
        atomic_write(db, write, replace=False)  # creating its tables in both ended one in "table already exists")
    except FileExistsError:
        return False
    return True  # db's own directory full or read-only: raised (MLflow creating the store there would fail too)


def make_template(tpl: Path) -> None:
    """A store created by MLflow itself in a scratch directory, then moved into place atomically."""
    from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore

    tpl.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=tpl.parent, prefix=".tmp-") as d:
        scratch = Path(d) / "mlflow.db"
        store = SqlAlchemyStore(f"sqlite:///{scratch}", (Path(d) / "mlruns").as_uri())
        store.engine.dispose()  # every connection closed before the file is copied
        atomic_write(tpl, lambda tmp: shutil.copyfile(scratch, tmp))
