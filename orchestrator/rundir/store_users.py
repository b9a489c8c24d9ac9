"""Who is using a local store now, so that ``healsweep store gc`` never deletes what a live sweep reads.

Each sweep's driver holds an fcntl lock on a file of its own under ``<store root>/.users/`` for as long as it runs
(the file names its run directory); ``store gc`` holds one too, then refuses while any sweep's is held, and a sweep
that finds a gc's held waits for it to end. Each takes its own file before it looks for the other's, so of a sweep
and a gc starting together at least one sees the other. The kernel drops a lock when its holder dies: a killed
sweep's file is stale by construction, and the next look removes it. A file is locked before it gets its final
name (a look never sees a file between its creation and its lock). Remote (bucket) stores have no such lock: their
gc keeps what was used in the last hour (orchestrator/commands/store_bucket.py).
"""
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
    fcntl.flock(f.fileno(), fcntl.LOCK_EX)  # its own file: nobody else locks it but a look, for an instant
    f.write(what)
    f.flush()
    os.replace(tmp, d / name)  # the lock is on the file, not the name: held under its final name
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
            with open(p, encoding="utf-8", errors="replace") as f:
                try:
                    fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    out.append(f.read(300).strip() or p.name)
                    continue
            p.unlink(missing_ok=True)  # its holder is gone
        except OSError:
            continue  # removed meanwhile, or unreadable: not ours to judge
    return out


def sweep_holds(root: Path, run_dir: Path, say: Callable[[str], None] = print, poll_s: float = 0.5) -> IO[str]:
    """A sweep's hold on the local store at ``root`` (made if missing), after any ``store gc`` running there ended."""
    f = hold(root, "sweep", f"a sweep (pid {os.getpid()}, run directory {run_dir})")
    told = False
    while gcs := live(root, "gc"):
        if not told:
            say(f"store: waiting for {gcs[0]} to end on {root}")
            told = True
        time.sleep(poll_s)
    return f
