"""The whole Ray cluster lost mid-sweep (a real ``ray start`` head, every process of it SIGKILLed after the first
trials): the driver ends in healsweep's own line with exit 1 before Ray's core would have ended it (60 s after the
loss, with only its C++ "Failed to connect to GCS" message), the parent run is KILLED and tagged partial, the report
says so on its first screen, and ``run --resume`` on a local Ray finishes the sweep with every trial once."""
from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import pytest
from mlflow import MlflowClient

from tests.ray_nodes import HEALSWEEP, NODE_ENV, REPO, completed, read_trials, scaleout_spec, start_node

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]
CACHE = Path(os.environ.get("HEALSWEEP_TEST_CACHE", REPO / ".healsweep" / "models"))


def test_losing_the_whole_cluster_ends_in_one_line_and_the_sweep_resumes(tmp_path):
    spec, out, store = scaleout_spec(tmp_path / "spec.yaml", trials_per_cell=2), tmp_path / "run", tmp_path / "store"
    cmd = [HEALSWEEP, "run", str(spec), "--out", str(out), "--store", str(store), "--cache", str(CACHE), "--quiet"]
    env = {**os.environ, **NODE_ENV}
    head = start_node(2)
    try:
        proc = subprocess.Popen([*cmd, "--address", head.address], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, cwd=REPO, env=env, start_new_session=True)
        deadline = time.monotonic() + 300
        while completed(out) < 2 and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.3)
        assert proc.poll() is None and completed(out) >= 2, "the sweep should be running its trials"
        head.kill()  # the head's every process: GCS, raylet, the trial actors
        t_lost = time.monotonic()
        stdout, stderr = proc.communicate(timeout=120)
        after = time.monotonic() - t_lost
    finally:
        head.stop()
    assert proc.returncode == 1 and after < 55, (proc.returncode, after, stderr[-3000:])
    errors = [ln for ln in stderr.splitlines() if ln.startswith("healsweep: error:")]
    port = head.address.rsplit(":", 1)[1]  # Ray's GCS address, as the "joined" line names it (the node's own IP)
    assert len(errors) == 1 and errors[0].startswith("healsweep: error: the Ray cluster at ")
    assert f":{port} stopped answering (" in errors[0]
    assert f"resume with healsweep run --resume {out}" in errors[0] and "Traceback" not in stderr
    assert "Failed to connect to GCS within 60 seconds" not in stderr  # Ray's own end did not come first
    assert f"report: {(out / 'report.html').resolve()} (partial)" in stdout
    told = completed(out)
    assert 2 <= told < 8
    assert (f"Partial sweep: interrupted by the loss of its Ray cluster with {told} of 8 trials finished"
            in (out / "report.md").read_text())
    info = json.loads((out / "sweep.json").read_text())
    parent = MlflowClient(info["tracking_uri"]).get_run(info["parent_run_id"])
    assert parent.info.status == "KILLED" and parent.data.tags["partial"] == "true"
    assert "complete" not in info  # a resume runs the rest

    r = subprocess.run([*cmd[:2], "--resume", str(out), "--num-cpus", "2", "--quiet"], capture_output=True,
                       text=True, cwd=REPO, env=env, timeout=300)
    assert r.returncode == 0 and "8 trials finished, 0 failed" in r.stdout, r.stderr[-3000:]
    t = read_trials(out)
    assert len(t.runs) == 8 and t.failed == 0 and t.run_twice == 0  # every trial once, its one run FINISHED
    assert MlflowClient(info["tracking_uri"]).get_run(info["parent_run_id"]).data.tags["partial"] == "false"
