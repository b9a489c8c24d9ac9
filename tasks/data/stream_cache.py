"""A machine-local copy of the items a streamed split needs: made once per machine, memory-mapped by every process.

A streamed dataset (the ``imagenet1k`` preset's three hub splits) is materialised to the first ``n`` items after a
seeded shuffle buffer (``hub.StreamTable``). Every process that loads the model does it: the driver, each trial
actor, each dense-target run and mask task. Without this cache each of them downloaded the items again and held
them in its heap (for ImageNet: 5,000 test + 1,000 train + 50,000 validation JPEGs, ~6 GB). With it, the first
process on a machine streams and writes one Arrow IPC file per split (encoded image bytes, stream positions,
labels); the others wait on a file lock, then memory-map that file (the page cache holds it once per machine).

The file is keyed by everything that fixes its items (dataset ident, hub split, seed, shuffle buffer, columns,
and for a local dataset a stamp of its files); ``n`` is not in the key: the shuffled stream's first ``n`` items
are a prefix of its first ``m > n``, so a file with at least ``n`` rows serves by slicing, and a shorter one is
streamed again to the larger ``n`` and replaced. Files are written to a temporary name and renamed, never
rewritten in place: a reader never sees a partial file, and a process that maps the old file keeps reading it
(truncating a mapped file would kill its readers with SIGBUS). One that does not open (damaged) is streamed
again. Arrow IPC holds no Python objects (nothing is unpickled).

Where: ``$HEALSWEEP_STREAM_CACHE`` (``off`` disables the cache), else ``$XDG_CACHE_HOME/healsweep/streams``,
else ``~/.cache/healsweep/streams``.
"""
from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path
from typing import Any, Mapping

import pyarrow as pa

from tasks.atomic import atomic_write, file_lock
from tasks.errors import DatasetError, first_line

CACHE_ENV = "HEALSWEEP_STREAM_CACHE"
SCHEMA = pa.schema([("bytes", pa.large_binary()), ("path", pa.string()), ("pos", pa.int64()), ("label", pa.int64())])


def cache_root() -> Path | None:
    """The cache directory, or None when ``$HEALSWEEP_STREAM_CACHE`` is ``off``."""
    env = os.environ.get(CACHE_ENV, "").strip()
    if env.lower() in ("off", "0", "false", "no"):
        return None
    if env:
        return Path(env).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "healsweep" / "streams"


def cache_file(root: Path, key: Mapping[str, Any]) -> Path:
    """The file that holds the stream described by ``key`` (JSON-able): ``root/<sha256 of key>.stream.arrow``."""
    digest = hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:32]
    return root / f"{digest}.stream.arrow"


def local_stamp(path: str | os.PathLike) -> str:
    """A stamp of a local dataset's files (relative path, size, mtime), so that data rewritten in place is not
    served from a stale copy; '' for a hub id (its ``revision`` is in the key instead)."""
    p = Path(path)
    if not p.exists():
        return ""
    files = [p] if p.is_file() else sorted(f for f in p.rglob("*") if f.is_file())
    h = hashlib.sha256()
    for f in files:
        st = f.stat()
        h.update(f"{f.relative_to(p) if f != p else f.name}:{st.st_size}:{st.st_mtime_ns}\n".encode())
    return h.hexdigest()[:16]


def machine_lock(path: Path):
    """The lock on ``path``'s items across this machine's processes (``<path>.lock``; ``tasks.atomic.file_lock``):
    the one that holds it streams, the others wait (saying so once) and then read the file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    lock = path.with_name(path.name + ".lock")
    return file_lock(lock, lambda: print(f"healsweep: waiting for another process to stream {path.name}",
                                         file=sys.stderr))


def open_cached(path: Path, n: int) -> pa.Table | None:
    """The first ``n`` rows of the cached file, memory-mapped; None when there is no file or it has fewer rows.
    A file that does not open as Arrow IPC with this schema is removed (and None returned): it is made again."""
    if not path.is_file():
        return None
    try:
        table = pa.ipc.open_file(pa.memory_map(str(path), "r")).read_all()
        if not table.schema.equals(SCHEMA):
            raise ValueError(f"schema {table.schema.names}")
    except FileNotFoundError:  # removed since is_file()
        return None
    except ValueError as e:  # pyarrow's ArrowInvalid (a truncated or foreign file) is a ValueError; damaged: made again
        print(f"healsweep: stream cache {path.name} is damaged ({first_line(e, 120)}); streaming again",
              file=sys.stderr)
        path.unlink(missing_ok=True)
        return None
    except OSError as e:  # unreadable, not damaged (permissions, too many open files): kept, and said
        raise DatasetError(f"stream cache {str(path)!r} cannot be read: {first_line(e)} (it is kept; fix its "
                           f"permissions, or delete it to stream again)") from None
    return table.slice(0, n) if table.num_rows >= n else None


def write_cached(path: Path, table: pa.Table, key: Mapping[str, Any]) -> None:
    """Write ``table`` (SCHEMA; ``key`` kept as schema metadata, for whoever inspects the file) through the
    project's temp-file-then-rename (``tasks.atomic.atomic_write``; a full disk is a one-line DiskFullError)."""
    table = table.replace_schema_metadata({"healsweep.stream": json.dumps(key, sort_keys=True, default=str)})

    def write(tmp: str) -> None:
        with pa.OSFile(tmp, "wb") as sink, pa.ipc.new_file(sink, table.schema) as writer:
            writer.write_table(table, max_chunksize=4096)

    atomic_write(path, write)


def cell_parts(x: Any) -> tuple[bytes | None, str | None] | None:
    """An undecoded image cell ({'bytes', 'path'} dict, raw bytes or a path) -> (bytes, path); None for anything
    else (a decoded image: such a stream is kept in RAM, not cached)."""
    if isinstance(x, Mapping) and ("bytes" in x or "path" in x):
        return x.get("bytes"), x.get("path")
    if isinstance(x, (bytes, bytearray)):
        return bytes(x), None
    if isinstance(x, (str, os.PathLike)):
        return None, str(x)
    return None


def items_table(parts: list[tuple[bytes | None, str | None]], positions: list[int], labels: list[int]) -> pa.Table:
    """(bytes, path) of each streamed item, its stream position and label -> a SCHEMA table."""
    return pa.table({"bytes": [b for b, _ in parts], "path": [p for _, p in parts], "pos": positions,
                     "label": labels}, schema=SCHEMA)
