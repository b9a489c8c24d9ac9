"""A spec plugin for machines that cannot mount a small tmpfs (not root, no CAP_SYS_ADMIN): the directory named
by ``HEALSWEEP_TEST_QUOTA=DIR:BYTES`` behaves like a file system of BYTES. Every project write through
``tasks.atomic.atomic_write`` (store shards and manifests, masks, healed weights) under DIR writes its temporary file
as usual, then fails with ENOSPC from inside the write when the files under DIR exceed BYTES: the project's own
handling of a full disk (the DiskFullError line, the temporary file removed, the trial left untold) is what runs.
Imported by the driver and by every trial process (a spec's ``plugins``); the environment reaches both."""
from __future__ import annotations

import errno
import os
from pathlib import Path

import tasks.atomic
import tasks.export
import tasks.store.masks

_real = tasks.atomic.atomic_write


def _limit() -> tuple[Path, int] | None:
    spec = os.environ.get("HEALSWEEP_TEST_QUOTA", "")
    where, _, size = spec.rpartition(":")
    return (Path(where), int(size)) if where and size.isdigit() else None


def _used(root: Path) -> int:
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file() and not p.is_symlink())


def limited_write(path, write, *args, **kwargs):
    limit = _limit()
    if limit is None or not Path(path).resolve().is_relative_to(limit[0].resolve()):
        return _real(path, write, *args, **kwargs)

    def write_then_check(tmp: str) -> None:
        write(tmp)
        if _used(limit[0]) > limit[1]:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), tmp)
    return _real(path, write_then_check, *args, **kwargs)


for module in (tasks.atomic, tasks.export, tasks.store.masks):
    module.atomic_write = limited_write
