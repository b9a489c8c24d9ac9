"""A Ray worker setup hook (``runtime_env={"worker_process_setup_hook": "tests.faults.dense_kill.install"}``) that
kills a dense-target worker with SIGKILL as it starts shard ``KILL_AT`` (the second shard of the first run of a GPU
dense stage), once per marker directory (``$HEALSWEEP_TEST_KILL_DIR``): as a node's OOM killer or a lost machine
would, after the run has already written and yielded its first shard. The project's real ``dense_shard`` does the
work; the hook only decides when the process dies."""
from __future__ import annotations

import os
import signal
from pathlib import Path

KILL_AT = 1


def install() -> None:
    import orchestrator.sweep.dense_work as dense_work

    real = dense_work.dense_shard

    def dense_shard(store_uri, key, index, start, stop, *args):
        marker = Path(os.environ["HEALSWEEP_TEST_KILL_DIR"]) / "killed"
        if index == KILL_AT and not marker.exists():
            marker.write_text(f"{os.getpid()}\n")
            os.kill(os.getpid(), signal.SIGKILL)
        return real(store_uri, key, index, start, stop, *args)

    dense_work.dense_shard = dense_shard
