"""Shared CLI helpers: user errors become one line on stderr and exit code 2."""
from __future__ import annotations

from pathlib import Path

DEFAULT_HOME = Path(".healsweep")


class CliError(Exception):
    """A user error: printed as one line, exit code 2."""


def load_spec_or_exit(path: str):
    """The validated spec of file ``path``, its tracking server reachable; else a one-line CliError (exit 2)."""
    from orchestrator.spec import SpecError, check_tracking_server, load_spec

    try:
        spec = load_spec(path)
        check_tracking_server(spec.mlflow.tracking_uri)
        return spec
    except SpecError as e:
        raise CliError(str(e)) from None
