"""tasks/net.py: pretrained weights that are not cached, on a machine that cannot reach their host, fail in
one line before the download client's retries (52 s of "Retrying in 8s" on a machine without DNS)."""
from __future__ import annotations

import socket
import time

import pytest

from tasks.models import MODEL_SOURCES, ModelSourceError, parse_ref
from tasks.net import PROXY_VARS, unreachable
from tests.ray_nodes import free_port


@pytest.fixture
def no_proxy(monkeypatch):
    for v in PROXY_VARS:
        monkeypatch.delenv(v, raising=False)


def test_a_host_that_cannot_be_reached_is_named_with_why(no_proxy, monkeypatch):
    port = free_port()  # nothing listens there
    assert unreachable(f"http://127.0.0.1:{port}/x") == "127.0.0.1 cannot be reached (Connection refused)"
    assert unreachable("https://no-such-host.invalid/w.pth").startswith("no-such-host.invalid cannot be reached (")
    with socket.socket() as srv:
        srv.bind(("127.0.0.1", 0))
        srv.listen()
        assert unreachable(f"http://127.0.0.1:{srv.getsockname()[1]}/x") is None
    for bad in ("http://mirror:abc/", "https://[::1/", f"https://{'a' * 70}.example/", "file:///x"):
        assert unreachable(bad) is None, bad  # malformed or hostless: the download client says what is wrong
    monkeypatch.setenv("HTTPS_PROXY", "http://proxy.example:3128")  # only the proxy may reach it: not asked
    assert unreachable(f"http://127.0.0.1:{port}/x") is None


def test_uncached_pretrained_timm_weights_fail_at_once_when_the_hub_cannot_be_reached(no_proxy, monkeypatch, tmp_path):
    port = free_port()  # nothing listens there
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{port}")  # a mirror that is down
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch"))
    t0 = time.perf_counter()
    with pytest.raises(ModelSourceError) as e:
        MODEL_SOURCES.get("timm").load(parse_ref("resnet18"))
    assert time.perf_counter() - t0 < 10
    assert str(e.value) == (f"model 'resnet18': pretrained timm weights 'resnet18' are not in the local cache "
                            f"({tmp_path / 'hf' / 'hub'}) and 127.0.0.1 cannot be reached (Connection refused); "
                            "download them once online, or use source: checkpoint with a local file")
