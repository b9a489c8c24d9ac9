"""`healsweep run` twice on one store and model cache (issue #35): the second driver, whose targets, masks and model
facts are all there, never imports torch, from its spec check to its report; the first (cold) one computes them and
does. The driver is the CLI's own ``main`` as the console script runs it, in a fresh interpreter with an audit hook
that records the first ``import torch`` and where it came from; Tune's trial actors import torch as before."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
CACHE = os.environ.get("HEALSWEEP_TEST_CACHE", str(REPO / ".healsweep" / "models"))
pytestmark = pytest.mark.e2e

SPEC = """name: warm_driver
models: [vit_digits]
sparsities: [0.9]
calib_sizes: [64]
pruners: [magnitude]
healers: [starfish]
search: {trials_per_cell: 2, lr: [1.0e-3, 3.0e-3], epochs: [1, 2], reevaluate: 0}
"""

DRIVER = r"""
import atexit, json, os, sys, traceback
first = []


def audit(event, args):
    if event == "import" and args[0] == "torch" and not first:
        first.append("".join(traceback.format_stack(limit=40)[:-1]))


def record():
    with open(os.environ["PROBE_OUT"], "w") as f:
        json.dump({"torch": "torch" in sys.modules, "first": first[0] if first else ""}, f)


sys.addaudithook(audit)
atexit.register(record)  # the console script's exit_now runs atexit handlers too
from orchestrator.cli import main

main()  # argv from sys.argv, as the console script
"""


def _run(tmp_path: Path, name: str) -> dict:
    probe = tmp_path / f"{name}.json"
    env = dict(os.environ, PYTHONPATH=str(REPO), RAY_USAGE_STATS_ENABLED="0", PROBE_OUT=str(probe),
               HEALSWEEP_CHECK_CACHE=str(tmp_path / "checks"))  # the cached model facts and verdicts
    proc = subprocess.run([sys.executable, "-c", DRIVER, "run", str(tmp_path / "spec.yaml"), "--out",
                           str(tmp_path / name), "--store", str(tmp_path / "store"), "--cache", CACHE,
                           "--num-cpus", "2", "--quiet"],
                          capture_output=True, text=True, env=env, cwd=tmp_path, timeout=500)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "2 trials finished, 0 failed" in proc.stdout and (tmp_path / name / "report.html").is_file()
    return json.loads(probe.read_text())


@pytest.mark.timeout(1100)
def test_a_warm_healsweep_run_imports_no_torch_in_its_driver(tmp_path):
    (tmp_path / "spec.yaml").write_text(SPEC)
    cold = _run(tmp_path, "cold")
    assert cold["torch"] and cold["first"]  # the model loaded, targets and masks computed: the probe sees torch
    warm = _run(tmp_path, "warm")
    assert not warm["torch"], "a warm driver imported torch:\n" + warm["first"]
