"""The end of a sweep: the report thread's failure reaches the caller, and the console script's fast exit
keeps buffered output, atexit handlers and the exit code."""
from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def test_report_written_in_the_background_raises_its_error_on_join(tmp_path):
    from orchestrator.console import StageClock
    from orchestrator.sweep import _start_report

    clock = StageClock(enabled=False)
    join = _start_report(tmp_path, clock)  # no sweep.json: write_report fails in the thread
    with pytest.raises(FileNotFoundError):
        join()
    assert "report" in clock.seconds  # the failed stage is still timed


def test_exit_now_flushes_output_runs_atexit_and_keeps_the_code(tmp_path):
    marker = tmp_path / "atexit.txt"
    code = textwrap.dedent(f"""
        import atexit, sys
        from orchestrator.cli import exit_now
        atexit.register(lambda: open({str(marker)!r}, "w").write("ran"))
        print("x" * 5000)  # stdout is a pipe: block-buffered, lost without a flush
        print("on stderr", file=sys.stderr)
        exit_now(3)
        print("never")
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=60)
    assert proc.returncode == 3
    assert proc.stdout == "x" * 5000 + "\n"
    assert proc.stderr == "on stderr\n"
    assert marker.read_text() == "ran"
