"""Checks of a parsed spec against the world outside it, run by `validate` and before `run` starts Ray: an
http(s) MLflow tracking server must accept a connection within a few seconds (MLflow's own client would retry
for minutes and then print a traceback)."""
from __future__ import annotations

import socket
from urllib.parse import urlsplit

from orchestrator.spec.checks import SpecError, excerpt

TIMEOUT_S = 3.0


def check_tracking_server(uri: str | None, timeout: float = TIMEOUT_S) -> None:
    """One TCP connection to an http(s) tracking URI's host and port; other URIs (sqlite, file, ...) pass."""
    if not uri:
        return
    parts = urlsplit(uri)
    if parts.scheme not in ("http", "https"):
        return
    try:
        host, port = parts.hostname, parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError as e:  # a port that is not a number
        raise SpecError("mlflow.tracking_uri", f"{excerpt(uri)}: {e}") from None
    if not host:
        raise SpecError("mlflow.tracking_uri", f"no host in {excerpt(uri)}")
    try:
        socket.create_connection((host, port), timeout=timeout).close()
    except OSError as e:
        why = "timed out" if isinstance(e, TimeoutError) else (e.strerror or type(e).__name__)
        raise SpecError("mlflow.tracking_uri", f"cannot reach {host if len(host) < 80 else excerpt(host, 80)}:{port} within {timeout:g} s "
                                               f"({why}); start the tracking server or fix the URI") from None
