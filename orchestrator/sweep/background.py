"""``background``: a function run in a thread while the caller goes on (a light module: no torch, no Ray)."""
from __future__ import annotations

import threading


def background(fn, *args):
    """Run ``fn(*args)`` in a thread while the next stages run; the returned callable joins it (at most
    ``timeout`` seconds: TimeoutError) and returns its result (re-raising its error)."""

    box: dict = {}

    def target():
        try:
            box["value"] = fn(*args)
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread by join()
            box["error"] = e

    th = threading.Thread(target=target, name="healsweep-prepare", daemon=True)
    th.start()

    def join(timeout: float | None = None):
        th.join(timeout)
        if th.is_alive():
            raise TimeoutError(f"{getattr(fn, '__name__', 'the work')} still running after {timeout:g} s")
        if "error" in box:
            raise box["error"]
        return box["value"]
    return join
