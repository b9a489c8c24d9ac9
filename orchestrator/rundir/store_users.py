"""Who is using a local store now, so that ``healsweep store gc`` never deletes what a live sweep reads.

Each sweep's driver holds an fcntl lock on a file of its own under ``<store root>/.users/`` from just before its
stages read the store to its end (the file names its run directory); ``store gc`` holds one too, then refuses while
any sweep's is held, and a sweep that finds a gc's held waits for it to end. Each takes its own file before it looks
for the other's, so of a sweep and a gc starting together at least one sees the other. The kernel drops a lock when
its holder dies: a killed sweep's file is stale by construction, and the next look removes it. A file is locked
before it gets its final name (a look never sees a file between its creation and its lock). Remote (bucket) stores
have no such lock: their gc keeps what was used in the last hour (orchestrator/commands/store_bucket.py)."""
from __future__ import annotations

import fcntl
import os
import time
import uuid
from pathlib import Path
from typing import IO, Callable

USERS = ".users"


def hold(root: Path, role: str, what: str) -> IO[str]:
    """A held lock file ``<root>/.users/<role>-<pid>-<hex>`` saying ``what``; -> the open file (``release`` it)."""
    d = Path(root) / USERS
    d.mkdir(parents=True, exist_ok=True)
    name = f"{role}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp = d / f".{name}"
    f = open(tmp, "w+", encoding="utf-8")  # noqa: SIM115 - held until release
    try:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)  # its own file: nobody else locks it but a look, for an instant
        f.write(what)
        f.flush()
        os.replace(tmp, d / name)  # the lock is on the file, not the name: held under its final name
    except BaseException:
        f.close()
        tmp.unlink(missing_ok=True)
        raise
    return f


def release(f: IO[str] | None) -> None:
    """Give up a ``hold`` (its file removed)."""
    if f is None or f.closed:
        return
    path = Path(f.name)
    Path(path.parent / path.name.lstrip(".")).unlink(missing_ok=True)
    f.close()


def live(root: Path, role: str) -> list[str]:
    """What the live holders of ``role`` files under ``<root>/.users`` say; stale files (holder dead) removed."""
    out = []
    for p in sorted((Path(root) / USERS).glob(f"{role}-*")):
        try:
            f = open(p, encoding="utf-8", errors="replace")  # noqa: SIM115 - closed below
        except OSError:
            continue  # removed meanwhile
        with f:
            try:  # shared and non-blocking: works on a file opened for reading, on NFS too (files.lock_holder)
                fcntl.flock(f.fileno(), fcntl.LOCK_SH | fcntl.LOCK_NB)
            except OSError as e:  # held (BlockingIOError), or a lock this file system cannot take: counted as live
                out.append(f.read(300).strip() or p.name if isinstance(e, BlockingIOError) else f"{p.name} (unknown)")
                continue
        p.unlink(missing_ok=True)  # its holder is gone
    return out


def sweep_holds(roots: list[Path], run_dir: Path, say: Callable[[str], None] = print,
                poll_s: float = 0.5) -> list[IO[str]]:
    """A sweep's holds on the local store roots it reads (its store directory; a local ``store.uri``'s parent),
    after any ``store gc`` running there ended. A root this process cannot write (a read-only store, one whose
    ``.users`` another account made) gets no hold: the sweep goes on (it only reads there), unseen by a gc there."""
    held = []
    try:
        for root in dict.fromkeys(Path(r) for r in roots):
            try:
                held.append(hold(root, "sweep", f"a sweep (pid {os.getpid()}, run directory {run_dir})"))
            except OSError:
                continue
            told = False
            while gcs := live(root, "gc"):
                if not told:
                    say(f"store: waiting for {gcs[0]} to end on {root}")
                    told = True
                time.sleep(poll_s)
    except BaseException:
        for f in held:
            release(f)
        raise
    return held
