"""Atomic file writes: the one temp-file-then-rename helper every writer of the project uses (masks, rankings,
reference checkpoints, healed weights, diagnostics tables, store files on a local disk), so a reader sees a file
complete or not at all, and a crash leaves no partial file behind."""
from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Callable

FILE_MODE = 0o644  # files are shared artefacts (exports, caches): readable by the group and others


TMP_PREFIX = ".tmp-"  # temporary files are ".tmp-<random>-<name>": a crashed writer's leftovers are recognisable


def atomic_write(path: str | os.PathLike, write: Callable[[str], None], mode: int = FILE_MODE,
                 fsync: bool = False) -> Path:
    """Call ``write(tmp_path)`` on a temporary file next to ``path``, then rename it into place (atomic on POSIX).
    The temporary file is removed if ``write`` fails; the final file gets ``mode`` (mkstemp creates 0600).
    ``fsync``: flush the file's data to disk before the rename (the target store's shards and manifests)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=TMP_PREFIX, suffix=f"-{path.name}")
    os.close(fd)
    try:
        write(tmp)
        os.chmod(tmp, mode)
        if fsync:
            with open(tmp, "rb+") as f:
                os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        Path(tmp).unlink(missing_ok=True)
    return path


def atomic_write_bytes(path: str | os.PathLike, data, fsync: bool = False) -> Path:
    """``data``: bytes or any buffer (e.g. a pyarrow Buffer)."""
    return atomic_write(path, lambda tmp: Path(tmp).write_bytes(memoryview(data)), fsync=fsync)


def atomic_write_text(path: str | os.PathLike, text: str) -> Path:
    return atomic_write(path, lambda tmp: Path(tmp).write_text(text, encoding="utf-8"))
