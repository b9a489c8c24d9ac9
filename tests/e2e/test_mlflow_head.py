"""cluster.yaml's MLflow server on the head (docker/mlflow-head.sh), run as Ray runs a setup command (`bash -c` with
the command in its arguments), on a real `mlflow server`:

- it starts once: a second `ray up` (setup commands again) finds it answering and starts no other. The command it
  replaced, `pgrep -f "mlflow server" || nohup mlflow server ...`, matched its own shell and never started one;
- `backup` copies the live SQLite database to the shared directory, and on a new head (no database: `ray down`
  deleted the disk) `start` restores it: the runs logged before are there.
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from mlflow import MlflowClient

from tests.ray_nodes import free_port

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.e2e


def _setup_command() -> str:
    cmds = yaml.safe_load((REPO / "cluster.yaml").read_text())["head_setup_commands"]
    (cmd,) = [c for c in cmds if "mlflow-head.sh" in c]
    return cmd


def _ray_runs(cmd: str, env: dict) -> subprocess.CompletedProcess:
    """As Ray's command runner: the whole command is bash's argument (so a process-name probe sees it)."""
    return subprocess.run(["bash", "-c", cmd], env=env, capture_output=True, text=True, timeout=150,
                          start_new_session=True)  # its own process group: _stop ends the server with it


def _pid(stdout: str) -> int:
    return int(stdout.split("server pid ")[1].split()[0])


def _stop(pid: int, port: int | None = None) -> None:
    try:
        os.killpg(os.getpgid(pid), signal.SIGTERM)  # the server and its uvicorn workers
    except ProcessLookupError:
        pass
    deadline = time.monotonic() + 30
    while port is not None and time.monotonic() < deadline:  # until the port is free (the new head's own)
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) != 0:
                return
        time.sleep(0.2)


@pytest.mark.timeout(300)
def test_the_head_starts_one_tracking_server_and_a_new_head_restores_its_backup(tmp_path):
    home, shared, port = tmp_path / "head", tmp_path / "efs", free_port()
    home.mkdir()
    (home / "healsweep").symlink_to(REPO)  # cluster.yaml's file_mounts: ~/healsweep
    env = {**os.environ, "HOME": str(home), "HEALSWEEP_SHARED": str(shared), "MLFLOW_PORT": str(port),
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    cmd, pids = _setup_command(), []
    try:
        first = _ray_runs(cmd, env)
        assert first.returncode == 0, first.stdout + first.stderr
        pids.append(_pid(first.stdout))
        uri = f"http://127.0.0.1:{port}"
        client = MlflowClient(uri)
        exp = client.create_experiment("healsweep")
        run_id = client.create_run(exp).info.run_id
        client.log_metric(run_id, "eval_acc", 0.93)
        again = _ray_runs(cmd, env)  # a second `ray up`
        assert again.returncode == 0 and "already answers" in again.stdout, again.stdout + again.stderr

        backup = _ray_runs("bash ~/healsweep/docker/mlflow-head.sh backup", env)
        assert backup.returncode == 0, backup.stderr
        assert (shared / "mlflow-backup.db").stat().st_size > 0 and not (shared / "mlflow-backup.db.tmp").exists()
        _stop(pids[0], port)
        (home / "mlflow.db").unlink()  # `ray down`: the head's disk is gone

        new_head = _ray_runs(cmd, env)
        assert new_head.returncode == 0, new_head.stdout + new_head.stderr
        pids.append(_pid(new_head.stdout))
        assert "restored" in new_head.stdout
        assert MlflowClient(uri).get_run(run_id).data.metrics == {"eval_acc": 0.93}
    finally:
        for pid in pids:
            _stop(pid)


@pytest.mark.timeout(60)
def test_backup_without_a_database_says_so():
    env = {**os.environ, "HOME": "/nonexistent-head", "HEALSWEEP_SHARED": "/nonexistent-efs"}
    r = subprocess.run(["bash", str(REPO / "docker" / "mlflow-head.sh"), "backup"], env=env, capture_output=True,
                       text=True, timeout=30)
    assert r.returncode == 1 and "no database at /nonexistent-head/mlflow.db" in r.stderr
    r = subprocess.run(["bash", str(REPO / "docker" / "mlflow-head.sh")], capture_output=True, text=True, timeout=30)
    assert r.returncode == 2 and "usage:" in r.stderr
