"""Content-addressed, sharded, memory-mapped store for dense block targets.

A *key* (``content_key`` of whatever determines the targets) names one directory under the store root::

    <root>/<key>/shard-00000.arrow   Arrow IPC file: one column per block, FixedSizeList<uint16>[prod(shape)]
    <root>/<key>/shard-00000.json    sidecar: the shard info, written right after the shard (used for resume)
    <root>/<key>/manifest.json       written LAST by ``finalize``; a key without it is incomplete

Row ``i`` is calibration item ``i``; each shard holds a contiguous row range. Values are the raw 16-bit
patterns of float16 / bfloat16 tensors, so round trips are bit-exact (NaN payloads, -0.0, subnormals).
Every file is written under a temporary name and ``os.replace``d into place, so readers never see a partial
file. Readers memory-map shards and copy only the rows a batch asks for. No pickle anywhere.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import re
import uuid
from datetime import datetime, timezone
from pathlib import Path
from typing import Iterator

import numpy as np
import pyarrow as pa
import pyarrow.ipc as ipc
import torch

__all__ = ["KEY_RE", "canonical_json", "content_key", "StoreError", "TargetStore", "TargetReader"]

KEY_RE = re.compile(r"^[0-9a-f]{32}$")
FORMAT = "healsweep-targets/1"
MANIFEST = "manifest.json"
BATCH_ROWS = 256  # max rows per Arrow record batch inside a shard file
_FILE_RE = re.compile(r"^(shard-\d{5,}\.(arrow|json)|manifest\.json)$")  # the only names in a key dir
_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}
_DTYPE_NAMES = {v: k for k, v in _DTYPES.items()}


def canonical_json(obj) -> str:
    """Deterministic JSON text: sorted keys, no whitespace, ASCII only; tuples become lists.

    Raises ValueError on NaN/inf and TypeError on anything JSON cannot represent.
    """
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False)


def content_key(obj) -> str:
    """32 hex chars: sha256 of ``canonical_json(obj)`` truncated to 128 bits."""
    return hashlib.sha256(canonical_json(obj).encode("ascii")).hexdigest()[:32]


class StoreError(Exception):
    """Invalid key, incomplete or corrupt store content, or inconsistent arguments."""


# ----------------------------------------------------------------------------------------------- helpers
def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _tmp_path(final: Path) -> Path:
    return final.with_name(f".tmp-{uuid.uuid4().hex}-{final.name}")


def _atomic_write_bytes(final: Path, data: bytes) -> None:
    tmp = _tmp_path(final)
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, final)
    finally:
        tmp.unlink(missing_ok=True)


def _sha256_file(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _shard_name(index: int) -> str:
    return f"shard-{index:05d}.arrow"


def _read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text(encoding="ascii"))
    except FileNotFoundError:
        return None
    except (ValueError, UnicodeDecodeError) as e:
        raise StoreError(f"unreadable JSON {path}: {e}") from e


def _to_u16(t: torch.Tensor) -> np.ndarray:
    """(rows, *shape) float16/bfloat16 tensor -> (rows, prod(shape)) uint16 raw bit patterns."""
    a = t.detach().to("cpu").contiguous().view(torch.int16).numpy().view(np.uint16)
    return a.reshape(t.shape[0], -1)


def _from_u16(a: np.ndarray, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """(B, prod(shape)) uint16 -> (B, *shape) tensor of ``dtype`` sharing ``a``'s memory."""
    return torch.from_numpy(a.view(np.int16)).view(dtype).reshape(a.shape[0], *shape)


# ------------------------------------------------------------------------------------------------- store
class TargetStore:
    """Directory of target sets, one subdirectory per content key (see module docstring)."""

    def __init__(self, root: str | os.PathLike):
        Path(root).mkdir(parents=True, exist_ok=True)
        self.root = Path(root).resolve()

    def key_dir(self, key: str) -> Path:
        """Directory of ``key``; StoreError unless the key is 32 lowercase hex chars and stays inside root."""
        if not isinstance(key, str) or not KEY_RE.match(key):
            raise StoreError(f"invalid key {key!r}: expected 32 lowercase hex characters")
        d = (self.root / key).resolve()  # follows symlinks
        if d.parent != self.root:
            raise StoreError(f"key directory for {key} resolves outside the store root: {d}")
        return d

    def _file(self, key: str, name: str) -> Path:
        """A file inside the key dir, refusing names with separators and symlinks leading elsewhere."""
        kdir = self.key_dir(key)
        if not _FILE_RE.match(name):
            raise StoreError(f"invalid file name {name!r} in key {key}")
        p = (kdir / name).resolve()
        if p.parent != kdir:
            raise StoreError(f"{name} in key {key} resolves outside its key directory: {p}")
        return p

    def manifest(self, key: str) -> dict | None:
        """Parsed manifest.json, or None while the key is incomplete (not finalized)."""
        m = _read_json(self._file(key, MANIFEST))
        if m is not None and (m.get("format") != FORMAT or m.get("key") != key):
            raise StoreError(f"manifest of {key} has format {m.get('format')!r} / key {m.get('key')!r}")
        return m

    def keys(self) -> list[str]:
        """Sorted keys that have a manifest (complete target sets)."""
        out = []
        for p in sorted(self.root.iterdir()):
            if KEY_RE.match(p.name):
                try:
                    if self._file(p.name, MANIFEST).is_file():
                        out.append(p.name)
                except StoreError:
                    continue  # e.g. a symlink leading outside root: not ours
        return out

    @staticmethod
    def shard_plan(num_rows: int, shard_size: int) -> list[tuple[int, int, int]]:
        """[(shard_index, row_start, row_stop)] covering [0, num_rows) contiguously; last may be short."""
        if num_rows < 0 or shard_size < 1:
            raise StoreError(f"bad shard plan: num_rows={num_rows}, shard_size={shard_size}")
        return [(i, s, min(s + shard_size, num_rows)) for i, s in enumerate(range(0, num_rows, shard_size))]

    def missing_shards(self, key: str, num_rows: int, shard_size: int, *,
                       verify: bool = False) -> list[tuple[int, int, int]]:
        """Plan entries still to compute (resume).

        A shard counts as present only if its file exists and its sidecar records the same row range and the
        file's current size (and, with ``verify``, its sha256). A shard without a sidecar (crash between the
        two renames) is recomputed.
        """
        missing = []
        for idx, start, stop in self.shard_plan(num_rows, shard_size):
            path = self._file(key, _shard_name(idx))
            try:
                info = _read_json(self._file(key, f"shard-{idx:05d}.json"))
            except StoreError:
                info = None
            ok = (info is not None and path.is_file()
                  and (info.get("row_start"), info.get("row_stop")) == (start, stop)
                  and info.get("bytes") == path.stat().st_size
                  and (not verify or info.get("sha256") == _sha256_file(path)))
            if not ok:
                missing.append((idx, start, stop))
        return missing

    def shard_info(self, key: str, shard_index: int) -> dict | None:
        """The sidecar of a written shard (row range, bytes, sha256, dtype, block shapes), or None."""
        try:
            return _read_json(self._file(key, f"shard-{shard_index:05d}.json"))
        except StoreError:
            return None

    def write_shard(self, key: str, shard_index: int, row_start: int,
                    blocks: dict[str, torch.Tensor]) -> dict:
        """Write rows [row_start, row_start + rows) of every block atomically; return the shard info.

        blocks: name -> (rows, *shape) float16 or bfloat16 tensor; same rows and dtype for all blocks.
        """
        if not blocks:
            raise StoreError("write_shard needs at least one block")
        if shard_index < 0 or row_start < 0:
            raise StoreError(f"negative shard_index/row_start: {shard_index}, {row_start}")
        dtypes = {t.dtype for t in blocks.values()}
        rows = {t.shape[0] if t.dim() else -1 for t in blocks.values()}
        if len(dtypes) != 1 or next(iter(dtypes)) not in _DTYPE_NAMES:
            raise StoreError(f"blocks must all be float16 or all bfloat16, got {sorted(map(str, dtypes))}")
        if len(rows) != 1 or next(iter(rows)) < 1:
            raise StoreError(f"blocks must share a positive row count, got {sorted(rows)}")
        n = rows.pop()
        dtype = _DTYPE_NAMES[dtypes.pop()]

        fields, arrays = [], []
        for name, t in blocks.items():
            shape = list(t.shape[1:])
            width = math.prod(shape)
            if width < 1:
                raise StoreError(f"block {name!r} has empty per-row shape {shape}")
            values = pa.array(_to_u16(t).reshape(-1), type=pa.uint16())  # (rows * width,)
            arrays.append(pa.FixedSizeListArray.from_arrays(values, width))
            fields.append(pa.field(name, pa.list_(pa.uint16(), width), nullable=False,
                                   metadata={"shape": json.dumps(shape)}))
        schema = pa.schema(fields, metadata={"format": FORMAT, "dtype": dtype, "row_start": str(row_start),
                                             "row_stop": str(row_start + n)})
        table = pa.Table.from_arrays(arrays, schema=schema)

        final = self._file(key, _shard_name(shard_index))
        final.parent.mkdir(exist_ok=True)
        tmp = _tmp_path(final)
        try:
            with pa.OSFile(str(tmp), "wb") as sink, ipc.new_file(sink, schema) as writer:
                writer.write_table(table, max_chunksize=BATCH_ROWS)
            _fsync(tmp)
            info = {"index": shard_index, "row_start": row_start, "row_stop": row_start + n,
                    "file": final.name, "bytes": tmp.stat().st_size, "sha256": _sha256_file(tmp),
                    "dtype": dtype, "block_shapes": {k: list(t.shape[1:]) for k, t in blocks.items()}}
            os.replace(tmp, final)
        finally:
            tmp.unlink(missing_ok=True)
        _atomic_write_bytes(self._file(key, f"shard-{shard_index:05d}.json"), canonical_json(info).encode())
        return info

    def finalize(self, key: str, *, meta: dict, block_shapes: dict[str, list[int]], dtype: str,
                 num_rows: int, shard_infos: list[dict]) -> dict:
        """Check the shards tile [0, num_rows) and match the schema, then write manifest.json (last)."""
        if dtype not in _DTYPES:
            raise StoreError(f"dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")
        if num_rows < 1 or not block_shapes:
            raise StoreError(f"need num_rows >= 1 and at least one block (num_rows={num_rows})")
        shards = sorted((dict(s) for s in shard_infos), key=lambda s: s["row_start"])
        pos = 0
        for s in shards:
            if s["row_start"] != pos or s["row_stop"] <= s["row_start"]:
                raise StoreError(f"shard rows do not tile [0, {num_rows}): gap/overlap at row {pos} ({s})")
            pos = s["row_stop"]
        if pos != num_rows:
            raise StoreError(f"shard rows do not tile [0, {num_rows}): they end at {pos}")
        if len({s["index"] for s in shards}) != len(shards):
            raise StoreError("duplicate shard indices")
        shapes = {name: [int(d) for d in shape] for name, shape in block_shapes.items()}
        for s in shards:  # reading a footer is cheap: catches a stale or foreign shard before publishing
            _check_shard_schema(self._shard_path(key, s), s, shapes, dtype)
        m = {"format": FORMAT, "key": key, "meta": meta, "block_names": list(shapes),
             "block_shapes": shapes, "dtype": dtype, "num_rows": num_rows, "shards": shards,
             "created": datetime.now(timezone.utc).isoformat()}
        _atomic_write_bytes(self._file(key, MANIFEST), (json.dumps(m, indent=1, allow_nan=False) + "\n").encode())
        return m

    def _shard_path(self, key: str, info: dict) -> Path:
        """Path of a recorded shard, StoreError if it is missing or its size differs from the record."""
        path = self._file(key, str(info.get("file")))
        size = path.stat().st_size if path.is_file() else None
        if size != info.get("bytes"):
            raise StoreError(f"shard {info.get('file')} of key {key} is missing or truncated "
                             f"({size} bytes on disk, {info.get('bytes')} recorded)")
        return path

    def open(self, key: str, num_rows: int | None = None, *, verify: bool = False) -> "TargetReader":
        """Reader over rows [0, num_rows) (default: all); only shards covering that prefix are touched.

        Every needed shard's size must match the manifest; ``verify`` also checks its sha256 (reads it all).
        """
        m = self.manifest(key)
        if m is None:
            raise StoreError(f"key {key} has no manifest (missing or not finalized)")
        n = m["num_rows"] if num_rows is None else num_rows
        if not 1 <= n <= m["num_rows"]:
            raise StoreError(f"num_rows={n} outside [1, {m['num_rows']}] for key {key}")
        needed = [s for s in m["shards"] if s["row_start"] < n]
        paths = [self._shard_path(key, s) for s in needed]
        if verify:
            for s, p in zip(needed, paths):
                if _sha256_file(p) != s["sha256"]:
                    raise StoreError(f"shard {s['file']} of key {key} fails its sha256 check")
        return TargetReader(m, needed, paths, n)


def _check_shard_schema(path: Path, info: dict, shapes: dict[str, list[int]], dtype: str) -> None:
    try:
        with pa.memory_map(str(path), "r") as f:
            r = ipc.open_file(f)
            md = {k.decode(): v.decode() for k, v in (r.schema.metadata or {}).items()}
            got = {fl.name: json.loads((fl.metadata or {}).get(b"shape", b"null")) for fl in r.schema}
            rows = sum(r.get_batch(i).num_rows for i in range(r.num_record_batches))
    except (pa.ArrowException, ValueError) as e:
        raise StoreError(f"shard {path.name} is not a readable shard: {e}") from e
    want_rows = info["row_stop"] - info["row_start"]
    if (got != shapes or list(got) != list(shapes) or md.get("dtype") != dtype or rows != want_rows
            or md.get("row_start") != str(info["row_start"])):
        raise StoreError(f"shard {path.name} does not match the manifest: blocks {got}, dtype "
                         f"{md.get('dtype')}, rows {rows} from {md.get('row_start')} "
                         f"(want {shapes}, {dtype}, {want_rows} from {info['row_start']})")


# ------------------------------------------------------------------------------------------------ reader
class _Shard:
    """One memory-mapped shard: zero-copy (rows_in_batch, width) uint16 views per record batch."""

    def __init__(self, path: Path, row_start: int, row_stop: int, widths: dict[str, int]):
        self.row_start, self.row_stop = row_start, row_stop
        self.mmap = pa.memory_map(str(path), "r")
        self.views: dict[str, list[np.ndarray]] = {name: [] for name in widths}
        try:
            reader = ipc.open_file(self.mmap)
            if reader.schema.names != list(widths):
                raise StoreError(f"shard {path.name} has columns {reader.schema.names}, expected {list(widths)}")
            sizes = []
            for b in range(reader.num_record_batches):
                batch = reader.get_batch(b)
                sizes.append(batch.num_rows)
                for name, col in zip(widths, batch.columns):
                    if col.null_count or col.type.list_size != widths[name]:
                        raise StoreError(f"shard {path.name} column {name}: nulls or width {col.type.list_size}")
                    flat = col.flatten().to_numpy(zero_copy_only=True)  # (rows_in_batch * width,) map view
                    self.views[name].append(flat.reshape(batch.num_rows, widths[name]))
        except pa.ArrowException as e:
            self.close()
            raise StoreError(f"shard {path.name} is not a readable Arrow IPC file: {e}") from e
        except BaseException:
            self.close()
            raise
        self.batch_starts = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)  # (n_batches + 1,)
        if self.batch_starts[-1] != row_stop - row_start:
            self.close()
            raise StoreError(f"shard {path.name} holds {self.batch_starts[-1]} rows, "
                             f"manifest says {row_stop - row_start}")

    def close(self) -> None:
        self.views = {}
        self.mmap.close()


class TargetReader:
    """Bounded-memory reader over rows [0, num_rows) of one target set (see ``TargetStore.open``)."""

    def __init__(self, manifest: dict, shard_infos: list[dict], paths: list[Path], num_rows: int):
        self.block_names: list[str] = list(manifest["block_names"])
        self.block_shapes: dict[str, tuple[int, ...]] = {
            k: tuple(manifest["block_shapes"][k]) for k in self.block_names}
        self.dtype: torch.dtype = _DTYPES[manifest["dtype"]]
        self.num_rows: int = num_rows
        self._shards: list[_Shard] = []
        self._closed = False
        widths = {n: math.prod(self.block_shapes[n]) for n in self.block_names}
        try:
            for s, p in zip(shard_infos, paths):
                self._shards.append(_Shard(p, s["row_start"], s["row_stop"], widths))
        except BaseException:
            self.close()
            raise
        self._starts = np.array([s.row_start for s in self._shards], dtype=np.int64)  # (n_shards,)

    def read_rows(self, rows: np.ndarray) -> dict[str, torch.Tensor]:
        """Rows in the given order -> {name: (len(rows), *shape)} fresh tensors in the store dtype."""
        if self._closed:
            raise StoreError("reader is closed")
        rows = np.asarray(rows).reshape(-1)  # (B,)
        if rows.size and rows.dtype.kind not in "iu":
            raise StoreError(f"row indices must be integers, got dtype {rows.dtype}")
        rows = rows.astype(np.int64)
        if rows.size and (rows.min() < 0 or rows.max() >= self.num_rows):
            raise StoreError(f"row indices must lie in [0, {self.num_rows})")
        out = {n: np.empty((rows.size, math.prod(self.block_shapes[n])), np.uint16)
               for n in self.block_names}  # name -> (B, width)
        shard_of = np.searchsorted(self._starts, rows, side="right") - 1  # (B,)
        for si in np.unique(shard_of):
            shard = self._shards[si]
            pos = np.flatnonzero(shard_of == si)  # positions in the output
            local = rows[pos] - shard.row_start  # rows within the shard
            batch_of = np.searchsorted(shard.batch_starts, local, side="right") - 1
            for bi in np.unique(batch_of):
                sel = batch_of == bi
                p, r = pos[sel], local[sel] - shard.batch_starts[bi]
                for name in self.block_names:
                    out[name][p] = shard.views[name][bi][r]  # copies only these rows out of the map
        return {n: _from_u16(a, self.dtype, self.block_shapes[n]) for n, a in out.items()}

    def epoch_order(self, *, shuffle: bool = False, seed: int = 0, epoch: int = 0) -> np.ndarray:
        """Row order of one epoch, (num_rows,) int64: identity, or shards permuted then rows within each."""
        if self._closed:
            raise StoreError("reader is closed")
        if not shuffle:
            return np.arange(self.num_rows, dtype=np.int64)
        rng = np.random.default_rng([seed, epoch])
        parts = []
        for si in rng.permutation(len(self._shards)):
            s = self._shards[si]
            parts.append(rng.permutation(np.arange(s.row_start, min(s.row_stop, self.num_rows), dtype=np.int64)))
        return np.concatenate(parts) if parts else np.zeros(0, np.int64)

    def iter_batches(self, batch_size: int, *, shuffle: bool = False, seed: int = 0, epoch: int = 0,
                     drop_last: bool = False) -> Iterator[tuple[np.ndarray, dict[str, torch.Tensor]]]:
        """Yield (rows (B,) int64, {name: (B, *shape)}) covering every row exactly once per epoch."""
        if batch_size < 1:
            raise StoreError(f"batch_size must be >= 1, got {batch_size}")
        order = self.epoch_order(shuffle=shuffle, seed=seed, epoch=epoch)
        for i in range(0, order.size, batch_size):
            idx = order[i:i + batch_size]
            if drop_last and idx.size < batch_size:
                return
            yield idx, self.read_rows(idx)

    def load_all(self) -> dict[str, torch.Tensor]:
        """Every row in RAM, {name: (num_rows, *shape)}. For benchmarks and small sets only."""
        return self.read_rows(np.arange(self.num_rows, dtype=np.int64))

    def close(self) -> None:
        for s in self._shards:
            s.close()
        self._shards, self._closed = [], True

    def __enter__(self) -> "TargetReader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
