"""A watch on the Ray cluster's GCS while the trials run, so that losing the whole cluster ends the sweep in
healsweep's own words.

Without it, when the head (or every node) dies mid-sweep, Tune's loop in the driver hangs on the dead cluster
and, 60 s later, Ray's C++ core ends the process (``rpc_client.h:204: Failed to connect to GCS within 60
seconds ... The program will terminate``, exit 1): no healsweep line, no report, the parent run left RUNNING
(seen 2026-11-30 with ``ray stop --force`` under a 2-CPU head). :class:`GcsWatch` probes the GCS's TCP port every
``every`` seconds from a daemon thread; after ``after`` seconds without an answer it calls ``on_lost(seconds)``
once (orchestrator/sweep/end.py ``cluster_lost``: it writes what the sweep has, then ends the process before
Ray's 60 s are up). A GCS that comes back in time (fault-tolerant GCS restarts take seconds) is no loss.
"""
from __future__ import annotations

import contextlib
import socket
import threading
import time
from typing import Callable, Iterator

EVERY_S = 1.0
LOST_AFTER_S = 15.0  # well inside Ray's 60 s (gcs_rpc_server_reconnect_timeout_s), past a GCS restart's seconds


def reachable(host: str, port: int, timeout: float) -> bool:
    try:
        socket.create_connection((host, port), timeout=timeout).close()
        return True
    except OSError:
        return False


class GcsWatch:
    """Probe ``host:port`` every ``every`` s; ``on_lost(seconds unreachable)`` once it has not answered for
    ``after`` s. ``stop()`` ends the watch (the trials are over)."""

    def __init__(self, host: str, port: int, on_lost: Callable[[float], None], *, every: float = EVERY_S,
                 after: float = LOST_AFTER_S) -> None:
        self.host, self.port, self.on_lost, self.every, self.after = host, port, on_lost, every, after
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="healsweep-gcs-watch", daemon=True)

    def start(self) -> GcsWatch:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=2 * self.every + 1)

    def _loop(self) -> None:
        last_ok = time.monotonic()
        while not self._stop.wait(self.every):
            if reachable(self.host, self.port, timeout=min(1.0, self.every)):
                last_ok = time.monotonic()
            elif time.monotonic() - last_ok >= self.after and not self._stop.is_set():
                self.on_lost(time.monotonic() - last_ok)
                return


def gcs_host_port() -> tuple[str, int] | None:
    """The connected cluster's GCS address (None when Ray does not say)."""
    import ray

    node = getattr(ray._private.worker.global_worker, "node", None)
    host, sep, port = str(getattr(node, "gcs_address", "") or "").rpartition(":")
    return (host.strip("[]"), int(port)) if sep and port.isdigit() else None


@contextlib.contextmanager
def watching(on_lost: Callable[[str, float], None], **kw) -> Iterator[GcsWatch | None]:
    """The block runs under a :class:`GcsWatch` of the connected cluster's GCS; ``on_lost(address, seconds)``."""
    hp = gcs_host_port()
    if hp is None:
        yield None
        return
    w = GcsWatch(*hp, lambda seconds: on_lost(f"{hp[0]}:{hp[1]}", seconds), **kw).start()
    try:
        yield w
    finally:
        w.stop()
