"""Where a store lives: a local directory (memory-mapped reads, fsync, file locks) or any ``pyarrow.fs``
filesystem (``file://``, ``s3://``, ``gs://``, ``hdfs://`` URIs, or a FileSystem object such as
SubTreeFileSystem) through the same small set of operations."""
from __future__ import annotations

import contextlib
import logging
import os
import uuid
from typing import Iterator

import pyarrow as pa
import pyarrow.fs as pafs

from tasks.atomic import TMP_PREFIX, atomic_write_bytes, file_lock, sha256_stream

log = logging.getLogger("healsweep.store")


class StoreFS:
    """A root directory on a pyarrow filesystem. Paths handed to methods are relative to the root ("a/b")."""

    def __init__(self, root: str | os.PathLike, filesystem: pafs.FileSystem | None = None, create: bool = True):
        """``create``: make the root now (False: a reader that may hold read-only credentials)."""
        s = os.fspath(root)
        if filesystem is not None:
            fs, base = filesystem, s
        elif "://" in s:
            fs, base = pafs.FileSystem.from_uri(s)
        else:
            fs, base = pafs.LocalFileSystem(), os.path.realpath(s)
        self.fs = fs
        self.local = isinstance(fs, pafs.LocalFileSystem)
        if self.local:
            base = os.path.realpath(base)
        self.base = base.rstrip("/") or "/"
        if create:
            fs.create_dir(self.base, recursive=True)
        self.uri = s

    def path(self, rel: str) -> str:
        return f"{self.base}/{rel}" if rel else self.base

    def size(self, rel: str) -> int | None:
        """Byte size of a regular file, None if missing (or not a file)."""
        fi = self.fs.get_file_info(self.path(rel))
        return fi.size if fi.type == pafs.FileType.File else None

    def mtime(self, rel: str) -> float | None:
        fi = self.fs.get_file_info(self.path(rel))
        return fi.mtime.timestamp() if fi.type != pafs.FileType.NotFound and fi.mtime else None

    def is_dir(self, rel: str) -> bool:
        return self.fs.get_file_info(self.path(rel)).type == pafs.FileType.Directory

    def listdir(self, rel: str = "") -> list[str]:
        if not self.is_dir(rel):
            return []
        sel = pafs.FileSelector(self.path(rel), allow_not_found=True)
        return sorted(fi.base_name for fi in self.fs.get_file_info(sel))

    def newest_mtime(self, rel: str) -> float | None:
        """The latest mtime of the files directly under ``rel``, from one listing (a bucket has no directory mtimes:
        a key being written has shards, but no manifest and no last use yet)."""
        if not self.is_dir(rel):
            return None
        sel = pafs.FileSelector(self.path(rel), allow_not_found=True)
        return max((fi.mtime.timestamp() for fi in self.fs.get_file_info(sel)
                    if fi.type == pafs.FileType.File and fi.mtime), default=None)

    def mkdir(self, rel: str) -> None:
        self.fs.create_dir(self.path(rel), recursive=True)

    def read_bytes(self, rel: str) -> bytes | None:
        try:
            with self.fs.open_input_stream(self.path(rel)) as f:
                return f.read()
        except FileNotFoundError:
            return None

    def write_atomic(self, rel: str, data: bytes | pa.Buffer) -> None:
        """Write to a temporary name in the same directory, flush (fsync locally), then move into place."""
        if self.local:  # the project's one temp-file-then-rename helper, with fsync for the store
            atomic_write_bytes(self.path(rel), data, fsync=True)
            return
        d, name = rel.rsplit("/", 1) if "/" in rel else ("", rel)
        tmp = f"{d}/{TMP_PREFIX}{uuid.uuid4().hex}-{name}" if d else f"{TMP_PREFIX}{uuid.uuid4().hex}-{name}"
        try:
            with self.fs.open_output_stream(self.path(tmp)) as f:
                f.write(data)
            self.fs.move(self.path(tmp), self.path(rel))
        finally:
            self.delete(tmp)

    def delete(self, rel: str) -> None:
        try:
            if self.size(rel) is not None:
                self.fs.delete_file(self.path(rel))
        except FileNotFoundError:
            pass

    def move(self, rel: str, dst: str) -> None:
        if self.local:
            os.replace(self.path(rel), self.path(dst))
        else:
            self.fs.move(self.path(rel), self.path(dst))

    def delete_dir(self, rel: str) -> None:
        if self.is_dir(rel):
            self.fs.delete_dir(self.path(rel))

    def sha256(self, rel: str) -> str:
        with self.fs.open_input_stream(self.path(rel)) as f:
            return sha256_stream(f)

    def open_random(self, rel: str, mmap: bool = True):
        """Random-access file: memory-mapped when local and ``mmap``, else a pyarrow input file."""
        if self.local and mmap:
            return pa.memory_map(self.path(rel), "r")
        return self.fs.open_input_file(self.path(rel))

    def realpath_inside(self, rel: str) -> bool:
        """Locally, whether ``rel`` resolves (symlinks followed) to a path directly under its parent inside root."""
        if not self.local:
            return True
        p = os.path.realpath(self.path(rel))
        return os.path.dirname(p) == os.path.realpath(os.path.dirname(self.path(rel))) and p.startswith(self.base + "/")

    @contextlib.contextmanager
    def lock(self, rel: str) -> Iterator[None]:
        """Exclusive lock on a file (local: fcntl.flock, waits). Remote filesystems have no locks: writes there
        rely on idempotent shard writes and a single manifest winner."""
        if not self.local:
            yield
            return
        path = self.path(rel)
        with file_lock(path, lambda: log.info("waiting for the lock on %s (another sweep is writing this key)", path)):
            yield
