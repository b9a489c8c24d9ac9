"""Checks of a parsed spec against the world outside it, run by `validate` and before `run` starts Ray: an
http(s) MLflow tracking server or a tracking database must accept a connection within a few seconds (MLflow's own
client would retry for minutes and then print a traceback); a SQLite tracking store's directory must exist and be
writable (MLflow would fail only once the sweep opens it, with SQLAlchemy's traceback); a scheme MLflow cannot
track to, or its file store, is refused."""
from __future__ import annotations

import os
from pathlib import Path
from urllib.parse import urlsplit

from orchestrator.spec.checks import SpecError, excerpt
from tasks.net import cannot_connect

TIMEOUT_S = 3.0
PORTS = {"http": 80, "https": 443, "postgresql": 5432, "mysql": 3306, "mssql": 1433}  # default ports by scheme


def configured_tracking_uri(spec) -> tuple[str | None, str]:
    """(the tracking URI a sweep of ``spec`` uses before its run directory's own SQLite store, where it comes
    from): the spec's ``mlflow.tracking_uri``, else ``MLFLOW_TRACKING_URI``; (None, "") when neither is set."""
    if spec.mlflow.tracking_uri:
        return spec.mlflow.tracking_uri, "mlflow.tracking_uri"
    env = os.environ.get("MLFLOW_TRACKING_URI")
    return (env, "MLFLOW_TRACKING_URI") if env else (None, "")


def check_tracking(spec, timeout: float = TIMEOUT_S) -> None:
    """SpecError when the tracking store a sweep of ``spec`` would use cannot be: :func:`check_tracking_uri`."""
    uri, field = configured_tracking_uri(spec)
    check_tracking_uri(uri, timeout, field)


def check_tracking_uri(uri: str | None, timeout: float = TIMEOUT_S, field: str = "mlflow.tracking_uri") -> None:
    """One TCP connection to the host and port of an http(s) tracking server or a database MLflow's SQLAlchemy
    store opens (postgresql, mysql, mssql); a sqlite:/// URI's directory checked on disk; databricks passes; any
    other scheme, a file store and a bare path are refused (the sweep died on them after its dense and mask
    stages, in a traceback). ``field`` names where the URI came from in the error."""
    if not uri:
        return
    if uri.startswith("sqlite:///"):
        check_sqlite_dir(uri, field)
        return
    if uri == "databricks" or uri.startswith("databricks://"):  # a Databricks workspace (its profile): MLflow's own
        return
    parts = urlsplit(uri)
    scheme = parts.scheme.split("+", 1)[0].lower()  # postgresql+psycopg: the database, then its driver
    if scheme in ("", "file"):
        raise SpecError(field, f"{excerpt(uri)}: MLflow's file store is not supported; use sqlite:///PATH or an "
                               f"http(s) tracking server")
    if scheme not in PORTS:
        raise SpecError(field, f"{excerpt(uri)}: unknown scheme {excerpt(parts.scheme, 20)}; allowed: sqlite:///PATH, "
                               f"http(s)://HOST[:PORT], postgresql://, mysql://, mssql:// (SQLAlchemy URLs), databricks")
    try:
        host, port = parts.hostname, parts.port or PORTS[scheme]
    except ValueError as e:  # a port that is not a number
        raise SpecError(field, f"{excerpt(uri)}: {e}") from None
    if not host:
        raise SpecError(field, f"no host in {excerpt(uri)}")
    what = "server" if scheme.startswith("http") else "database"
    why = cannot_connect(host, port, timeout)
    if why:
        raise SpecError(field, f"cannot reach {host if len(host) < 80 else excerpt(host, 80)}:{port} within {timeout:g} s "
                               f"({why}); start the tracking {what} or fix the URI")


def check_server(uri: str, field: str) -> None:
    """The 3-s connection check of :func:`check_tracking_uri` for a recorded sweep's server or database (report,
    resume): a server that is down took MLflow's client ~4 min of retries, then a traceback or 'parent run not
    found'. A SQLite store (on disk) and Databricks pass."""
    if uri.startswith("sqlite:") or uri == "databricks" or uri.startswith("databricks://"):
        return
    check_tracking_uri(uri, field=field)


def check_sqlite_dir(uri: str, field: str = "mlflow.tracking_uri") -> None:
    """SpecError unless the directory of a ``sqlite:///PATH`` store exists and this process may write there (the
    database file, when it exists, too). SQLite creates the file, never its directory."""
    path = uri[len("sqlite:///"):].split("?", 1)[0]
    if path in ("", ":memory:"):
        return
    db = Path(path)
    where = db.parent
    if not where.is_dir():
        raise SpecError(field, f"{excerpt(uri)}: directory {excerpt(str(where), 120)} does not exist (create it, or "
                               "leave the tracking URI unset: each run directory has its own mlflow.db)")
    for p in (where, db) if db.exists() else (where,):
        if not os.access(p, os.W_OK):
            raise SpecError(field, f"{excerpt(uri)}: {excerpt(str(p), 120)} is not writable by this user")
