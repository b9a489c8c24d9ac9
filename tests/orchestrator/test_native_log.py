"""orchestrator/raytune/native_log.py: Ray's C++ log lines written to descriptor 2 while the driver attaches are
held back; every other line comes back, in order (a subprocess: the test needs a real descriptor 2)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from orchestrator.raytune.native_log import kept_lines

REPO = Path(__file__).resolve().parents[2]
CORE = b"[2026-11-30 22:31:03,781 W 28682 28682] gcs_client.cc:210: Failed to get cluster ID from GCS server\n"


def test_kept_lines_drop_only_the_cores_prefix():
    other = b"healsweep: [ray] attaching\n[ray] a Python line\n2026-11-30 22:31:03,781 W not the core\n"
    assert kept_lines(CORE + other + CORE) == other
    assert kept_lines(b"[2026-11-30 22:31:03,781 E 1 2] x.cc:1: y\nno newline") == b"no newline"
    assert kept_lines(b"") == b""


SCRIPT = """
import os, sys, threading
from orchestrator.raytune.native_log import held_native_lines
print("before", file=sys.stderr, flush=True)
with held_native_lines({enabled}):
    os.write(2, {core!r})  # what Ray's C++ core writes, below Python
    t = threading.Thread(target=lambda: print("from a thread", file=sys.stderr, flush=True)); t.start(); t.join()
    os.write(2, {core!r})
print("after", file=sys.stderr, flush=True)
"""


@pytest.mark.timeout(60)
@pytest.mark.parametrize("enabled, want", [
    (True, b"before\nfrom a thread\nafter\n"),
    (False, b"before\n" + CORE + b"from a thread\n" + CORE + b"after\n"),  # --verbose: Ray's lines shown
])
def test_the_core_lines_are_held_and_the_rest_comes_back(enabled, want):
    p = subprocess.run([sys.executable, "-c", SCRIPT.format(enabled=enabled, core=CORE)], capture_output=True,
                       cwd=REPO, env=dict(os.environ, PYTHONPATH=str(REPO)), timeout=50)
    assert p.returncode == 0 and p.stderr == want, p.stderr
