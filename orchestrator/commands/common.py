"""Shared CLI helpers: user errors become one line on stderr and exit code 2."""
from __future__ import annotations

from pathlib import Path

DEFAULT_HOME = Path(".healsweep")


class CliError(Exception):
    """A user error: printed as one line, exit code 2."""


def load_spec_or_exit(path: str):
    from orchestrator.spec import SpecError, load_spec

    try:
        return load_spec(path)
    except SpecError as e:
        raise CliError(str(e)) from None
