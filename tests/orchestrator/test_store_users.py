"""Who uses a local store (orchestrator/rundir/store_users.py): a live holder is seen, a dead one's file is stale
and removed, and a sweep starting while a store gc runs waits for it. Holders are other processes, as sweeps and
gcs are."""
from __future__ import annotations

import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

from orchestrator.rundir import store_users
from tests.orchestrator.run_cli import REPO, env


@contextmanager
def held_by_another_process(root: Path, role: str, what: str):
    code = ("import sys, time; from pathlib import Path; from orchestrator.rundir import store_users; "
            "h = store_users.hold(Path(sys.argv[1]), sys.argv[2], sys.argv[3]); print('held', flush=True); time.sleep(600)")
    p = subprocess.Popen([sys.executable, "-c", code, str(root), role, what], cwd=REPO, env=env(),
                         stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "held"
        yield p
    finally:
        p.kill()
        p.wait()
        p.stdout.close()


def test_live_holders_are_seen_and_a_dead_ones_file_is_removed(tmp_path):
    with held_by_another_process(tmp_path, "sweep", "a sweep (pid 1, run directory /r)"):
        assert store_users.live(tmp_path, "sweep") == ["a sweep (pid 1, run directory /r)"]
        assert store_users.live(tmp_path, "gc") == []
    assert store_users.live(tmp_path, "sweep") == []  # the kernel dropped its lock: stale, and removed
    assert list((tmp_path / store_users.USERS).iterdir()) == []
    mine = store_users.hold(tmp_path, "gc", "healsweep store gc (pid 2)")
    assert [p.name.split("-")[0] for p in (tmp_path / store_users.USERS).iterdir()] == ["gc"]
    store_users.release(mine)
    assert list((tmp_path / store_users.USERS).iterdir()) == []


def test_a_sweep_waits_for_a_running_gc(tmp_path):
    said: list[str] = []
    with held_by_another_process(tmp_path, "gc", "healsweep store gc (pid 7)") as gc:
        threading.Timer(1.5, gc.kill).start()  # the gc ends after 1.5 s
        t0 = time.monotonic()
        mine = store_users.sweep_holds([tmp_path, tmp_path], tmp_path / "run", say=said.append, poll_s=0.1)
        waited = time.monotonic() - t0
    try:
        assert waited >= 1.4 and said == [f"store: waiting for healsweep store gc (pid 7) to end on {tmp_path}"]
        assert len(mine) == 1 and store_users.live(tmp_path, "sweep")[0].endswith(f"run directory {tmp_path / 'run'})")
    finally:
        store_users.release(mine[0])


def test_a_store_this_user_cannot_write_gets_no_hold_and_the_sweep_goes_on(tmp_path):
    """Read-only stores are supported (a sweep reads their targets): making .users there failed the sweep."""
    ro = tmp_path / "ro"
    ro.mkdir()
    (ro / store_users.USERS).write_text("not a directory")  # (root ignores chmod: a file where the folder goes)
    mine = store_users.sweep_holds([ro, tmp_path], tmp_path / "run")
    try:
        assert len(mine) == 1 and len(store_users.live(tmp_path, "sweep")) == 1
    finally:
        store_users.release(mine[0])


def test_a_sweeps_store_roots_are_its_directory_and_a_local_uris_parent(tmp_path):
    from orchestrator.sweep.run import store_roots

    assert store_roots(None, tmp_path) == [tmp_path]
    assert store_roots(str(tmp_path / "data" / "targets"), tmp_path) == [tmp_path, tmp_path / "data"]
    assert store_roots(f"file://{tmp_path}/data/targets", tmp_path) == [tmp_path, tmp_path / "data"]
    assert store_roots("s3://bucket/targets", tmp_path) == []  # a bucket has no locks
