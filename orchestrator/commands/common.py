"""Shared CLI helpers: user errors become one line on stderr and exit code 2."""
from __future__ import annotations

import sys
from pathlib import Path

from orchestrator.rundir import interrupt
from orchestrator.spec.checks import not_a_dir  # noqa: F401 - the commands' face

DEFAULT_HOME = Path(".healsweep")


class CliError(Exception):
    """A user error: printed as one line, exit code 2."""


def load_spec_or_exit(path: str):
    """The validated spec of file ``path``, its tracking store reachable (an http(s) server answers, a SQLite
    file's directory exists and is writable); else a one-line CliError (exit 2)."""
    from orchestrator.spec import SpecError, check_tracking, load_spec

    try:
        spec = load_spec(path)
        check_tracking(spec)
        return spec
    except SpecError as e:
        raise CliError(str(e)) from None


def plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


def summary_lines(sweep_id: str, finished: int, failed: int, dense: int, seconds: float, tracking_uri: str) -> str:
    """What `healsweep run` ends with (a resume that starts nothing says it alike)."""
    return (f"sweep {sweep_id}: {plural(finished, 'trial')} finished, {failed} failed, dense forward images {dense}, "
            f"{seconds:.0f} s wall\nmlflow: {tracking_uri}")


def report_lines(paths: dict) -> str:
    """Where a written report is (run, refine and widen say it alike): both files, absolute."""
    return f"report: {Path(paths['html']).resolve()}\n        {Path(paths['md']).resolve()}"


def interrupted_exit(res) -> int:
    """A sweep (or round) that SIGINT/SIGTERM interrupted: its one line on stderr, and 128 + the signal; else 0."""
    if res.interrupted is None:
        return 0

    print(interrupt.line(res.trials_finished, res.trials_planned, res.trials_failed, res.out_dir), file=sys.stderr)
    return interrupt.exit_code(res.interrupted)
