"""orchestrator/raytune/gcs_watch.py on a real listening socket: no call while it answers, one call once it has not
answered for ``after`` seconds, none after ``stop``."""
from __future__ import annotations

import socket
import threading
import time

import pytest

from orchestrator.raytune.gcs_watch import GcsWatch, reachable

pytestmark = pytest.mark.timeout(60)


def _listener():
    srv = socket.create_server(("127.0.0.1", 0))
    return srv, srv.getsockname()[1]


def test_a_gcs_that_answers_is_not_lost_and_one_that_stops_is_lost_once():
    srv, port = _listener()
    calls, lost = [], threading.Event()
    w = GcsWatch("127.0.0.1", port, lambda s: (calls.append(s), lost.set()), every=0.05, after=0.5).start()
    try:
        time.sleep(1.0)  # answering the whole time: no call
        assert calls == [] and reachable("127.0.0.1", port, 1.0)
        srv.close()
        t0 = time.monotonic()
        assert lost.wait(5)
        waited = time.monotonic() - t0
        time.sleep(0.3)
    finally:
        w.stop()
    assert len(calls) == 1 and calls[0] >= 0.5 and 0.45 <= waited < 3, (calls, waited)


def test_a_short_outage_is_no_loss_and_stop_ends_the_watch():
    srv, port = _listener()
    calls = []
    w = GcsWatch("127.0.0.1", port, calls.append, every=0.05, after=1.0).start()
    try:
        srv.close()
        time.sleep(0.4)  # gone for less than `after` (a GCS restarting) ...
        srv = socket.create_server(("127.0.0.1", port))  # ... and back on its port
        time.sleep(1.2)
        assert calls == []
    finally:
        w.stop()
        srv.close()
    time.sleep(1.2)
    assert calls == []  # stopped: the trials are over, whatever the cluster does now
