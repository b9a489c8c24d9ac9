"""`healsweep run configs/tiny.yaml` as a user runs it (real console script, subprocess): stage lines, per-cell
progress, stage times, and no third-party chatter (Ray, Tune, MLflow) unless --verbose."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.e2e
NOISE = re.compile(r"WARNING|Warning|View run|Downloading artifacts|TensorBoard|Configuration for experiment|"
                   r"Creating initial MLflow database|may be a performance bottleneck")
STAGE_LINES = ("[models] models: vit_digits", "[ray] ", "[dense] dense targets: vit_digits 256 images",
               "[masks] masks: 4 cells (magnitude)", "[trials] grid main: 8 trials over 4 cells",
               "[report] report: writing", "stage times (s): imports")


def test_tiny_run_prints_stages_and_no_warning_lines(tmp_path):
    cache = os.environ.get("HEALSWEEP_TEST_CACHE", str(REPO / ".healsweep" / "models"))
    exe = Path(sys.executable).with_name("healsweep")
    env = dict(os.environ, PYTHONPATH=str(REPO))
    proc = subprocess.run([str(exe), "run", str(REPO / "configs" / "tiny.yaml"), "--out", str(tmp_path / "run"),
                           "--store", str(tmp_path / "store"), "--cache", cache, "--num-cpus", "2"],
                          capture_output=True, text=True, env=env, timeout=600, cwd=tmp_path)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    lines = re.split(r"[\r\n]", out)
    assert not [ln for ln in lines if NOISE.search(ln)], [ln for ln in lines if NOISE.search(ln)][:5]
    for want in STAGE_LINES:
        assert any(want in ln for ln in lines), (want, out[-3000:])
    # per-cell progress: the training bar names the model and cell, never a sweep-wide best
    assert any(re.search(r"vit_digits magnitude sparsity 0\.9 calib 128 starfish: [12]/2 trials", ln) for ln in lines)
    assert "best_selection_acc" not in out
    assert "8 trials finished, 0 failed" in proc.stdout
