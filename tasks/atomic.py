"""Atomic file writes: the one temp-file-then-rename helper every writer of the project uses (masks, rankings,
reference checkpoints, healed weights, diagnostics tables, store files on a local disk, streamed datasets' cached
items), so a reader sees a file complete or not at all, and a crash leaves no partial file behind; the one
local file lock (``file_lock``) writers that must not race take; and the one file digest (``sha256_file``/``sha256_stream``:
checkpoint identities, the healed store's pair sums, the target store's shard checks, a bundle's wheels)."""
from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import os
import shutil
import tempfile
from pathlib import Path
from typing import BinaryIO, Callable, Iterator

FILE_MODE = 0o644  # files are shared artefacts (exports, caches): readable by the group and others


TMP_PREFIX = ".tmp-"  # temporary files are ".tmp-<random>-<name>": a crashed writer's leftovers are recognisable

# What a file is, by its name (the one-line message of a full disk says what was being written).
_KINDS = ((".stream.arrow", "a streamed dataset's cached items"), (".arrow", "a target-store shard"),
          ("healed.safetensors", "a trial's healed weights"),
          ("manifest.json", "a target-store manifest"),
          (".safetensors", "a weights/mask file"), ("mlflow.db", "the MLflow tracking database"),
          ("optuna.journal", "the Optuna journal"), ("trials.jsonl", "the trial record"),
          ("sweep.json", "the sweep record"), ("report.html", "the report"), ("report.md", "the report"),
          (".json", "a JSON file"))


class DiskFullError(OSError):
    """ENOSPC (or EDQUOT) while writing ``path``: one line naming the path, what it is, the bytes it needed and
    the space left there. Still an OSError with errno ENOSPC, so callers that handle OSError keep working."""

    def __init__(self, path: str | os.PathLike, needed: int | None = None, what: str | None = None) -> None:
        self.path, self.needed, self.what = str(path), needed, what or describe(path)
        free = free_bytes(Path(self.path).parent)
        need = f"needed {_size(needed)}, " if needed else ""
        left = f"{_size(free)} free there" if free is not None else "free space unknown"
        super().__init__(errno.ENOSPC, f"no space left on device writing {self.what} {self.path} ({need}{left})")

    def line(self) -> str:
        return self.args[1]

    def __str__(self) -> str:
        return self.args[1]

    def __reduce__(self):  # crosses process boundaries (a Ray task's error) with its path and size
        return (type(self), (self.path, self.needed, self.what))


def sha256_file(path: str | os.PathLike) -> str:
    """The full sha256 (64 hex) of a file's bytes, read in 8-MiB chunks."""
    with open(path, "rb") as f:
        return sha256_stream(f)


def sha256_stream(f: BinaryIO) -> str:
    """The full sha256 (64 hex) of what is left to read in the binary stream ``f`` (a local file, or a pyarrow
    input stream of a remote store), read in 8-MiB chunks."""
    h = hashlib.sha256()
    while chunk := f.read(8 << 20):
        h.update(chunk)
    return h.hexdigest()


def describe(path: str | os.PathLike) -> str:
    name = Path(path).name
    return next((kind for suffix, kind in _KINDS if name.endswith(suffix)), "a file")


def is_disk_full(e: BaseException) -> bool:
    """ENOSPC/EDQUOT, also from writers that wrap it (safetensors: "I/O error: No space left on device")."""
    if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    return "No space left on device" in str(e) or "Disk quota exceeded" in str(e)


def free_bytes(where: str | os.PathLike) -> int | None:
    p = Path(where)
    while not p.exists() and p != p.parent:
        p = p.parent
    try:
        return shutil.disk_usage(p).free
    except OSError:
        return None


def _size(n: int) -> str:
    return f"{n / (1 << 20):.2f} MiB" if n >= 1 << 20 else f"{n / 1024:.1f} KiB" if n >= 1024 else f"{n} bytes"


def atomic_write(path: str | os.PathLike, write: Callable[[str], None], mode: int = FILE_MODE,
                 fsync: bool = False, replace: bool = True) -> Path:
    """Call ``write(tmp_path)`` on a temporary file next to ``path``, then rename it into place (atomic on POSIX).
    The temporary file is removed if ``write`` fails; the final file gets ``mode`` (mkstemp creates 0600).
    ``fsync``: flush the file's data to disk before the rename (the target store's shards and manifests).
    ``replace`` False: put it in place only if ``path`` does not exist (a hard link: FileExistsError when another
    writer was first, whose file then stays as it is).
    A full disk is a :class:`DiskFullError` naming ``path`` and what the temporary file had reached when the disk
    filled (``atomic_write_bytes``: the bytes it needed)."""
    path = Path(path)
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=TMP_PREFIX, suffix=f"-{path.name}")
        os.close(fd)
        write(tmp)
        os.chmod(tmp, mode)
        if fsync:
            with open(tmp, "rb+") as f:
                os.fsync(f.fileno())
        if replace:
            os.replace(tmp, path)
        else:
            _publish_new(tmp, path)
    except Exception as e:
        if not is_disk_full(e) or isinstance(e, DiskFullError):
            raise
        reached = Path(tmp).stat().st_size if tmp and Path(tmp).exists() else None
        raise DiskFullError(path, reached) from e
    finally:
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)
    return path


def _publish_new(tmp: str, path: Path) -> None:
    """``tmp`` as ``path`` only if ``path`` does not exist (FileExistsError): a hard link, atomic; on a file system
    without hard links (vfat/exFAT, many SMB and FUSE mounts) a check and a rename, which leaves a window."""
    try:
        os.link(tmp, path)
    except FileExistsError:
        raise
    except OSError:  # EPERM / EOPNOTSUPP / EXDEV: no hard links here
        if path.exists():
            raise FileExistsError(errno.EEXIST, "exists", str(path)) from None
        os.replace(tmp, path)


def atomic_write_bytes(path: str | os.PathLike, data, fsync: bool = False) -> Path:
    """``data``: bytes or any buffer (e.g. a pyarrow Buffer)."""
    view = memoryview(data)
    try:
        return atomic_write(path, lambda tmp: Path(tmp).write_bytes(view), fsync=fsync)
    except DiskFullError as e:
        raise DiskFullError(path, view.nbytes) from e.__cause__


def atomic_write_text(path: str | os.PathLike, text: str) -> Path:
    return atomic_write_bytes(path, text.encode("utf-8"))


@contextlib.contextmanager
def file_lock(path: str | os.PathLike, on_wait: Callable[[], None] | None = None,
              remove: bool = False) -> Iterator[None]:
    """An exclusive ``fcntl.flock`` on ``path`` (created if missing) across this machine's processes; waits for it,
    calling ``on_wait()`` first when another process holds it. The kernel drops the lock when the block ends or its
    holder dies (a crash leaves no stale lock). ``remove``: the file is deleted before the lock is let go (nothing
    left behind); a waiter that then holds the deleted file sees it is no longer the one at ``path`` and locks
    that one instead."""
    told = False
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, FILE_MODE)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if on_wait is not None and not told:
                on_wait()
                told = True
            fcntl.flock(fd, fcntl.LOCK_EX)
        except BaseException:
            os.close(fd)
            raise
        try:
            current = os.stat(path).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            current = False
        if current or not remove:
            break
        os.close(fd)  # the holder before removed it: lock the file now at that name
    try:
        yield
    finally:
        if remove:
            Path(path).unlink(missing_ok=True)
        os.close(fd)  # releases the lock
