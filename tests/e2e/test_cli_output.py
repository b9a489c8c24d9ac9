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


def _raylets_of(driver_pid: int) -> list[str]:
    """Raylets of the Ray a driver process started: Ray names the session directory after the driver's pid
    (``session_<date>_<time>_<usec>_<pid>``); raylets of other Ray instances on the machine do not count."""
    out = subprocess.run(["pgrep", "-af", "ray/core/src/ray/raylet/raylet"], capture_output=True, text=True).stdout
    return [ln for ln in out.splitlines() if re.search(rf"session_[0-9_-]+_{driver_pid}(/|\s|$)", ln)]


def test_spec_refused_while_ray_starts_is_one_line_and_ray_is_shut_down(tmp_path):
    """`healsweep run` starts Ray while the spec's registry checks run (orchestrator/commands/run.py): a spec that
    passes the plain checks but names an unknown pruner is still one error line, exit 2, no run directory, and
    the Ray it started is gone when the command returns."""
    spec = (REPO / "configs" / "tiny.yaml").read_text().replace("pruners: [magnitude]", "pruners: [magnitud]")
    (tmp_path / "typo.yaml").write_text(spec)
    exe = Path(sys.executable).with_name("healsweep")
    proc = subprocess.Popen([str(exe), "run", "typo.yaml", "--out", str(tmp_path / "run"), "--quiet",
                             "--num-cpus", "1"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=tmp_path, env=dict(os.environ, PYTHONPATH=str(REPO)))
    _, err = proc.communicate(timeout=300)
    err = err.strip()
    assert proc.returncode == 2 and len(err.splitlines()) == 1 and "magnitud" in err and "Traceback" not in err, err
    assert not (tmp_path / "run").exists()
    assert _raylets_of(proc.pid) == []  # this command's raylet exited with it
