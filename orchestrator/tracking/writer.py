"""One background MLflow writer for the driver: Tune callbacks enqueue, a thread writes.

Trials never wait on MLflow: the Tune loop only appends to a queue (microseconds); the writer thread drains
everything queued, coalesces consecutive metrics per run into ``log_batch`` calls (at most 1000 per call,
MLflow's limit) and runs other operations (run creation, tags, termination, Optuna tells) in submission order.
``flush()`` blocks until everything queued so far is written; ``close()`` flushes and stops the thread.
A failing write is counted and logged, never raised into the sweep.

The client may be given as a callable that returns it (a sweep's tracking store is opened, and its parent run
created, in a thread while Tune starts its trial actors: orchestrator/sweep/parent.py): it is resolved on first
use.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from typing import TYPE_CHECKING, Callable

from orchestrator.rundir import faults

if TYPE_CHECKING:  # MLflow is imported by whoever opens the client (orchestrator/tracking/logger.py)
    from mlflow import MlflowClient
    from mlflow.entities import Metric

log = logging.getLogger(__name__)
MAX_BATCH = 1000


class AsyncMlflowWriter:
    def __init__(self, client: MlflowClient | Callable[[], MlflowClient]) -> None:
        self._client = client
        self.errors = 0
        self.write_seconds = 0.0  # time the writer thread spent in MLflow calls
        self.batches = 0
        self._closed = False
        self._q: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._loop, name="mlflow-writer", daemon=True)
        self._thread.start()

    @property
    def client(self) -> MlflowClient:
        if callable(self._client):  # a client is not callable; the function that opens one is
            self._client = self._client()  # joins whatever opens it (re-raising its error)
        return self._client

    # Tune pickles its callbacks and searcher into the experiment directory; a copy is a closed writer (without
    # its client while that is still being opened: Tune pickles them before the first trial).
    def __getstate__(self) -> dict:
        return {"client": None if callable(self._client) else self._client}

    def __setstate__(self, state: dict) -> None:
        self._client, self.errors, self.write_seconds, self.batches, self._closed = state["client"], 0, 0.0, 0, True

    def submit(self, fn: Callable[[], None]) -> None:
        if self._closed:
            self._guard(fn)
            return
        self._q.put(("call", fn))

    def log_metrics(self, run_id: Callable[[], str | None], metrics: list[Metric]) -> None:
        """``run_id`` is resolved in the writer thread (runs are created there too)."""
        self._q.put(("metrics", run_id, metrics))

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every write queued before this call is done (at most ``timeout`` s); -> whether they are."""
        done = threading.Event()
        self._q.put(("call", done.set))
        return done.wait(timeout)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.flush()
        self._q.put(None)
        self._thread.join()

    def _loop(self) -> None:
        while True:
            items = [self._q.get()]
            while True:
                try:
                    items.append(self._q.get_nowait())
                except queue.Empty:
                    break
            pending: dict[str, list[Metric]] = {}
            stop = False
            for item in items:
                if item is None:
                    stop = True
                elif item[0] == "metrics":
                    rid = self._guard(item[1])
                    if rid:
                        pending.setdefault(rid, []).extend(item[2])
                else:
                    self._write(pending)
                    pending = {}
                    self._guard(item[1])
            self._write(pending)
            if stop:
                return

    def _write(self, pending: dict[str, list[Metric]]) -> None:
        for rid, metrics in pending.items():
            for i in range(0, len(metrics), MAX_BATCH):
                self._guard(lambda: self.client.log_batch(rid, metrics=metrics[i : i + MAX_BATCH]))
                self.batches += 1

    def _guard(self, fn: Callable[[], object]):
        t0 = time.perf_counter()
        try:
            return fn()
        except Exception as e:  # noqa: BLE001 - a logging failure must not stop the sweep
            self.errors += 1
            if faults.one_line(e) is not None:  # a full disk, a damaged database: the sweep stops (one line);
                log.debug("mlflow write failed: %s", e)  # that line says it: not a second one on stderr
                faults.stop(e)  # the trial record is not written, so the trial runs again on resume
            else:
                log.warning("mlflow write failed: %s", e)
            return None
        finally:
            self.write_seconds += time.perf_counter() - t0
