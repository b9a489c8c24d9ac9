"""tasks/atomic.atomic_write: complete or absent, never partial; shared files are 0644. file_lock: one holder at a
time across processes."""
from __future__ import annotations

import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tasks.atomic import atomic_write, atomic_write_text, file_lock


def test_atomic_write_replaces_whole_file_with_mode_0644(tmp_path):
    p = atomic_write_text(tmp_path / "sub" / "a.txt", "one")
    atomic_write_text(p, "two")
    assert p.read_text() == "two" and stat.S_IMODE(p.stat().st_mode) == 0o644
    assert sorted(x.name for x in p.parent.iterdir()) == ["a.txt"]  # no temporary file left behind


def test_failed_write_keeps_the_old_file_and_leaves_no_temporary(tmp_path):
    p = atomic_write_text(tmp_path / "a.txt", "old")

    def half(tmp):
        with open(tmp, "w") as f:
            f.write("partial")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        atomic_write(p, half)
    assert p.read_text() == "old" and [x.name for x in tmp_path.iterdir()] == ["a.txt"]


def test_every_local_writer_goes_through_atomic_write(tmp_path, monkeypatch):
    """The store's local writes, sweep.json, SnapViT rankings and verdicts use tasks/atomic.atomic_write: its temporary
    names are recognisable (.tmp-<random>-<name>), so a killed writer's leftovers are found and removed."""
    import pyarrow as pa

    import tasks.atomic as io
    from orchestrator.rundir.files import write_sweep
    from tasks.store.fs import StoreFS

    seen = []
    real = io.atomic_write

    def spy(path, write, mode=io.FILE_MODE, fsync=False):
        seen.append((Path(path).name, fsync))
        return real(path, write, mode, fsync)

    monkeypatch.setattr(io, "atomic_write", spy)
    fs = StoreFS(str(tmp_path / "store"))
    fs.mkdir("k")
    fs.write_atomic("k/shard.arrow", pa.py_buffer(b"abc"))
    write_sweep(tmp_path, {"sweep_id": "x"})
    assert seen == [("shard.arrow", True), ("sweep.json", False)]  # the store fsyncs, sweep.json does not
    assert (tmp_path / "store/k/shard.arrow").read_bytes() == b"abc"
    assert oct((tmp_path / "store/k/shard.arrow").stat().st_mode & 0o777) == "0o644"
    assert not [p for p in tmp_path.rglob("*") if p.name.startswith(io.TMP_PREFIX)]


_LOCKER = """
import sys, time
from tasks.atomic import file_lock
with file_lock(sys.argv[1], lambda: print("waiting", flush=True)):
    print(f"got {time.time()}", flush=True)
"""


@pytest.mark.timeout(60)
def test_file_lock_makes_another_process_wait_until_it_is_released(tmp_path):
    lock = tmp_path / "x.lock"
    with file_lock(lock, lambda: pytest.fail("nobody holds it")):
        child = subprocess.Popen([sys.executable, "-c", _LOCKER, str(lock)], stdout=subprocess.PIPE, text=True,
                                 cwd=Path(__file__).resolve().parents[1])
        assert child.stdout.readline().strip() == "waiting"  # it found the lock held and said so
        time.sleep(0.5)
        released = time.time()
    out, _ = child.communicate(timeout=30)
    assert child.returncode == 0 and float(out.split()[1]) >= released  # it got the lock only after the release
    with file_lock(lock, lambda: pytest.fail("the child's lock outlived it")):
        pass
