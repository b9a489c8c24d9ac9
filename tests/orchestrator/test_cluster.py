"""orchestrator/raytune/cluster.py without Ray: which variables workers get, address parsing and probing (TCP, then
HTTP/2's preface), the concurrency policy."""
from __future__ import annotations

import json
import os
import socket
import threading
import time

import pytest

from orchestrator.raytune.cluster import (ClusterError, is_http2_settings, mask_root, parse_address, pending_limit,
                                         pending_trials, present_concurrency, probe, store_subdir, tune_concurrency,
                                         worker_env)
from orchestrator.spec import parse_spec


def test_worker_env_takes_the_sweeps_variables_and_leaves_the_jobs_own_to_the_job():
    env = {"AWS_ACCESS_KEY_ID": "k", "AWS_SECRET_ACCESS_KEY": "s", "MLFLOW_TRACKING_URI": "http://m:5000",
           "HF_TOKEN": "t", "HOME": "/root", "PATH": "/bin", "TORCH_HOME": "/c", "AWSX": "no",
           "HEALSWEEP_MODEL_MIRROR": "/driver/cache",  # a node-local path: never the workers'

           "RAY_JOB_CONFIG_JSON_ENV_VAR": json.dumps({"runtime_env": {"env_vars": {"HF_TOKEN": "job"}}})}
    assert worker_env(env) == {"AWS_ACCESS_KEY_ID": "k", "AWS_SECRET_ACCESS_KEY": "s",
                               "MLFLOW_TRACKING_URI": "http://m:5000", "TORCH_HOME": "/c"}


@pytest.mark.parametrize("addr", ["ray://10.0.0.5:10001", "10.0.0.5", "10.0.0.5:x", ":6379"])
def test_refused_addresses(addr):
    with pytest.raises(ClusterError):
        parse_address(addr)


def test_parsed_addresses():
    assert parse_address("10.0.0.5:6379") == ("10.0.0.5", 6379)
    assert parse_address("[::1]:6379") == ("::1", 6379)
    assert parse_address("auto") is None


def test_probe_fails_fast_on_a_closed_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound, not listening: refused
        t0 = time.monotonic()
        with pytest.raises(ClusterError, match=f"127.0.0.1:{port} \\(connection refused\\)"):
            probe("127.0.0.1", port)
    assert time.monotonic() - t0 < 3.5


def test_tune_is_capped_only_by_the_user(monkeypatch):
    monkeypatch.delenv("TUNE_MAX_PENDING_TRIALS_PG", raising=False)
    raw = {"name": "x", "models": ["vit_digits"], "sparsities": [0.5], "calib_sizes": [64], "pruners": ["magnitude"],
           "healers": ["starfish"], "resources": {"cpus_per_trial": 2}}
    r = parse_spec(raw).resources
    assert tune_concurrency(r, {"CPU": 1}) is None  # queue beyond what is there now
    assert present_concurrency(r, {"CPU": 9}) == 4
    # Tune keeps the sweep's trials PENDING (at most 200), whatever the CPUs at start
    assert pending_trials(r, 32) == 32 and pending_trials(r, 1) == 1 and pending_trials(r, 5000) == 200
    monkeypatch.setenv("TUNE_MAX_PENDING_TRIALS_PG", "50")
    assert pending_trials(r, 32) == 50  # the user's value wins
    capped = parse_spec({**raw, "resources": {"cpus_per_trial": 2, "max_concurrent": 3}}).resources
    assert tune_concurrency(capped, {"CPU": 100}) == 3
    assert pending_trials(capped, 32, environ={}) == 3


def test_pending_limit_is_set_while_tune_runs_and_the_users_value_restored(monkeypatch):
    r = parse_spec({"name": "x", "models": ["vit_digits"], "sparsities": [0.5], "calib_sizes": [64],
                    "pruners": ["magnitude"], "healers": ["starfish"]}).resources
    monkeypatch.delenv("TUNE_MAX_PENDING_TRIALS_PG", raising=False)
    with pending_limit(r, 32) as n:
        assert n == 32 and os.environ["TUNE_MAX_PENDING_TRIALS_PG"] == "32"
    assert "TUNE_MAX_PENDING_TRIALS_PG" not in os.environ  # a second sweep in this process sizes its own
    with pending_limit(r, 8):
        assert os.environ["TUNE_MAX_PENDING_TRIALS_PG"] == "8"
    monkeypatch.setenv("TUNE_MAX_PENDING_TRIALS_PG", "5")
    with pending_limit(r, 32) as n:
        assert n == 5
    assert os.environ["TUNE_MAX_PENDING_TRIALS_PG"] == "5"


def test_masks_follow_a_remote_store_uri():
    uri = "s3://b/st?endpoint_override=h:9000&scheme=http"
    assert store_subdir(uri, "masks") == "s3://b/st/masks?endpoint_override=h:9000&scheme=http"
    assert mask_root(uri, "/l/masks") == "s3://b/st/masks?endpoint_override=h:9000&scheme=http"
    assert mask_root(None, "/l/masks") == "/l/masks" and mask_root("/data/t", "/l/masks") == "/l/masks"


def _serve_once(reply: bytes | None):
    """A listener on 127.0.0.1 that reads the client's first bytes, then sends ``reply`` (None: says nothing)."""
    srv = socket.create_server(("127.0.0.1", 0))

    def serve():
        try:
            conn, _ = srv.accept()
        except OSError:  # the test closed the listener first (its probe never connected): nothing to answer
            return
        with conn:
            conn.recv(64)
            if reply is not None:
                conn.sendall(reply)
                time.sleep(0.2)
            else:
                time.sleep(2)
    t = threading.Thread(target=serve, daemon=True)
    t.start()
    return srv, srv.getsockname()[1]


@pytest.mark.timeout(30)
@pytest.mark.parametrize("reply, said", [
    (b"HTTP/1.0 400 Bad request\r\n\r\n", r"answered b'HTTP/1.0 '"),  # a web server (the dashboard, http.server)
    (b"", "closed the connection"),
    (None, "said nothing in 1 s"),
    (bytes([0, 0, 0, 4, 1, 0, 0, 0, 0]), "answered"),  # a SETTINGS ACK is not a server's first frame
])
def test_a_listener_that_is_not_a_gcs_is_refused_in_one_line(reply, said):
    srv, port = _serve_once(reply)
    with srv:
        t0 = time.monotonic()
        with pytest.raises(ClusterError, match=f"127.0.0.1:{port} is not a Ray GCS: it {said}") as e:
            probe("127.0.0.1", port, timeout=1.0)
    assert time.monotonic() - t0 < 2.5 and "\n" not in str(e.value)


@pytest.mark.timeout(30)
def test_a_grpc_server_passes_and_tls_skips_the_preface():
    # a gRPC server's first frame: SETTINGS with two settings (12 bytes of payload), no ACK, stream 0
    srv, port = _serve_once(bytes([0, 0, 12, 4, 0, 0, 0, 0, 0]) + bytes(12))
    with srv:
        probe("127.0.0.1", port, timeout=1.0)
    srv, port = _serve_once(b"HTTP/1.0 400 Bad request\r\n\r\n")
    with srv:
        probe("127.0.0.1", port, timeout=1.0, environ={"RAY_USE_TLS": "1"})  # TLS: Ray's own handshake decides


def test_http2_settings_frames():
    assert is_http2_settings(bytes([0, 0, 6, 4, 0, 0, 0, 0, 0]))
    assert not is_http2_settings(bytes([0, 0, 0, 4, 1, 0, 0, 0, 0]))  # ACK
    assert not is_http2_settings(bytes([0, 0, 6, 4, 0, 0, 0, 0, 1]))  # stream 1
    assert not is_http2_settings(bytes([0, 0, 6, 1, 0, 0, 0, 0, 0]))  # HEADERS
    assert not is_http2_settings(b"\x00\x00\x06\x04") and not is_http2_settings(None)
