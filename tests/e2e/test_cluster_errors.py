"""Cluster and store failures end in one line and exit code 2 (the real console script, real Ray / S3 endpoint)."""
from __future__ import annotations

import os
import secrets
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from tests.cluster_fixtures import free_port

pytestmark = pytest.mark.e2e
REPO = Path(__file__).resolve().parents[2]
CACHE = os.environ.get("HEALSWEEP_TEST_CACHE", str(REPO / ".healsweep" / "models"))
EXE = os.path.join(os.path.dirname(sys.executable), "healsweep")


def _spec(tmp_path, **store) -> Path:
    raw = {"name": "err", "models": ["vit_digits"], "sparsities": [0.9], "calib_sizes": [64], "pruners": ["magnitude"],
           "healers": ["starfish"], "search": {"trials_per_cell": 1, "lr": [1e-3, 1e-3], "epochs": [1, 1]}}
    if store:
        raw["store"] = store
    p = tmp_path / "spec.yaml"
    p.write_text(yaml.safe_dump(raw))
    return p


def _run(tmp_path, *args, env=None, timeout=120):
    cmd = [EXE, "run", str(_spec(tmp_path)), "--out", str(tmp_path / "run"), "--cache", CACHE,
           "--store", str(tmp_path / "store"), "--quiet", "--no-report", *args]
    t0 = time.monotonic()
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env={**os.environ, **(env or {})})
    return p, time.monotonic() - t0


def _one_line(p) -> str:
    assert p.returncode == 2, p.stderr[-3000:]
    lines = [ln for ln in p.stderr.splitlines() if ln.startswith("healsweep: error:")]
    assert len(lines) == 1 and "Traceback" not in p.stderr, p.stderr[-3000:]
    return lines[0]


def test_ray_client_address_is_refused_in_one_line(tmp_path):
    p, _ = _run(tmp_path, "--address", "ray://127.0.0.1:10001")
    assert "Ray Client (ray://) is not supported" in _one_line(p)
    assert not (tmp_path / "run" / "sweep.json").exists()  # refused before any work


def test_unreachable_cluster_is_one_line_within_seconds(tmp_path):
    p, dt = _run(tmp_path, "--address", f"127.0.0.1:{free_port()}")
    assert "cannot reach the Ray cluster at 127.0.0.1:" in _one_line(p) and dt < 120  # Ray alone retries for minutes


def test_a_web_server_at_the_address_is_one_line_within_seconds(tmp_path):
    """A port where something else listens (here Python's http.server) passed the TCP probe, then Ray retried
    "Failed to connect to GCS" for minutes with no healsweep line."""
    port = free_port()
    web = subprocess.Popen([sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1"],
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=tmp_path)
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", port)) == 0:
                    break
            time.sleep(0.1)
        p, dt = _run(tmp_path, "--address", f"127.0.0.1:{port}")
    finally:
        web.kill()
        web.wait()
    assert f"127.0.0.1:{port} is not a Ray GCS" in _one_line(p) and dt < 60
    assert not (tmp_path / "run" / "sweep.json").exists()  # refused before any work


def test_auto_without_a_cluster_is_one_line(tmp_path):
    env = {"RAY_ADDRESS": f"127.0.0.1:{free_port()}"}  # what --address auto follows first
    assert "cannot reach the Ray cluster" in _one_line(_run(tmp_path, "--address", "auto", env=env)[0])


def test_unreachable_s3_endpoint_and_missing_bucket_are_one_line(tmp_path, aws_env):
    dead = f"s3://hs-test/t?endpoint_override=127.0.0.1:{free_port()}&scheme=http"
    _spec(tmp_path, uri=dead)
    cmd = [EXE, "run", str(tmp_path / "spec.yaml"), "--out", str(tmp_path / "r1"), "--cache", CACHE, "--quiet"]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert "cannot reach the endpoint" in _one_line(p)
    _spec(tmp_path, uri=f"s3://no-such-bucket/t?endpoint_override={aws_env['host']}&scheme=http")
    p = subprocess.run(cmd[:4] + [str(tmp_path / "r2")] + cmd[5:], capture_output=True, text=True, timeout=120)
    assert "bucket 'no-such-bucket' does not exist" in _one_line(p)
    _spec(tmp_path, uri=f"s3://hs-test/t?endpoint_override={aws_env['host']}&scheme=http")
    env = {**os.environ, "AWS_SECRET_ACCESS_KEY": "wrong"}
    p = subprocess.run(cmd[:4] + [str(tmp_path / "r3")] + cmd[5:], capture_output=True, text=True, timeout=120,
                       env=env)
    assert "refused the credentials" in _one_line(p)


@pytest.fixture
def token_head(tmp_path):
    """`ray start --head` with token auth on; the token only in the head's environment."""
    import ray._private.services

    ip, port = ray._private.services.get_node_ip_address(), free_port()
    env = {**os.environ, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32),
           "RAY_USAGE_STATS_ENABLED": "0"}
    ray_exe = os.path.join(os.path.dirname(sys.executable), "ray")
    with open(tmp_path / "head.log", "w") as log:
        proc = subprocess.Popen([ray_exe, "start", "--head", "--block", f"--port={port}", "--num-cpus=1",
                                 "--include-dashboard=false", "--object-store-memory=80000000",
                                 "--disable-usage-stats"], stdout=log, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)
    try:
        t0 = time.monotonic()
        while time.monotonic() - t0 < 60:
            try:
                socket.create_connection((ip, port), timeout=1).close()
                break
            except OSError:
                time.sleep(0.2)
        yield f"{ip}:{port}"
    finally:
        os.killpg(proc.pid, 15)
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)


def test_auth_failure_is_one_line(tmp_path, token_head):
    p, _ = _run(tmp_path, "--address", token_head, env={"RAY_AUTH_MODE": "disabled"}, timeout=180)
    assert "refused this driver's authentication token" in _one_line(p)
    # Ray's C++ core printed ~20 "gcs_client.cc: ... InvalidAuthToken" retry lines on stderr before it, --quiet too
    assert p.stderr.strip().splitlines() == [_one_line(p)], p.stderr[-2000:]
