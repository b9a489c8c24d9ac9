"""Content-addressed, sharded store for dense block targets (see ``tasks.store`` for the layout)."""
from __future__ import annotations

import hashlib
import json
import math
import os
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING

import pyarrow as pa
import pyarrow.ipc as ipc

from tasks.errors import first_line
from tasks.store.fs import StoreFS
from tasks.store.format import (_FILE_RE, BATCH_ROWS, DTYPE_NAMES, FORMAT, KEY_RE, LAST_USE, LOCK, MANIFEST, QUARANTINE,
                                VERIFIED, StoreError, canonical_json, log, producer_versions, shard_name, sidecar_name)

if TYPE_CHECKING:
    from collections.abc import Sequence

    import torch

    from tasks.store.reader import TargetReader


class TargetStore:
    """Directory of target sets, one subdirectory per content key.

    ``root``: a local path (default use), a ``pyarrow.fs`` URI (``file:///…``, ``s3://bucket/prefix``,
    ``gs://…``), or a path inside ``filesystem`` (any ``pyarrow.fs.FileSystem``, e.g. SubTreeFileSystem).
    """

    def __init__(self, root: str | os.PathLike, filesystem=None, create: bool = True):
        self.fs = StoreFS(root, filesystem, create)  # create False: a reader (read-only credentials on a bucket)
        self.root = Path(self.fs.base) if self.fs.local else self.fs.uri

    # ---------------------------------------------------------------------------------------- names
    def _check_key(self, key) -> str:
        if not isinstance(key, str) or not KEY_RE.match(key):
            raise StoreError(f"invalid key {key!r}: expected 32 lowercase hex characters")
        if not self.fs.realpath_inside(key):
            raise StoreError(f"key directory for {key} resolves outside the store root")
        return key

    def key_dir(self, key: str) -> Path | str:
        """Directory of ``key`` (a Path locally); StoreError unless the key is 32 lowercase hex chars and
        stays inside root."""
        self._check_key(key)
        return Path(self.fs.path(key)) if self.fs.local else self.fs.path(key)

    def _rel(self, key: str, name: str) -> str:
        """A file inside the key dir, refusing foreign names and symlinks leading elsewhere."""
        self._check_key(key)
        if not isinstance(name, str) or not _FILE_RE.match(name):
            raise StoreError(f"invalid file name {name!r} in key {key}")
        rel = f"{key}/{name}"
        if not self.fs.realpath_inside(rel):
            raise StoreError(f"{name} in key {key} resolves outside its key directory")
        return rel

    def _read_json(self, rel: str) -> dict | None:
        data = self.fs.read_bytes(rel)
        if data is None:
            return None
        try:
            return json.loads(data.decode("ascii"))
        except (ValueError, UnicodeDecodeError) as e:
            raise StoreError(f"unreadable JSON {rel}: {e}") from e

    # ---------------------------------------------------------------------------------------- state
    def manifest(self, key: str) -> dict | None:
        """Parsed manifest.json, or None while the key is incomplete (not finalized). StoreError when it is
        unreadable or inconsistent (see ``check_manifest``): such a key is damaged, not incomplete."""
        m = self._read_json(self._rel(key, MANIFEST))
        if m is None:
            return None
        if not isinstance(m, dict) or m.get("format") != FORMAT or m.get("key") != key:
            got = (m.get("format"), m.get("key")) if isinstance(m, dict) else type(m).__name__
            raise StoreError(f"manifest of {key} has format / key {got!r}")
        problem = check_manifest(m)
        if problem:
            raise StoreError(f"manifest of {key} is inconsistent: {problem}")
        return m

    def keys(self) -> list[str]:
        """Sorted keys that have a manifest (complete target sets)."""
        out = []
        for name in self.fs.listdir():
            if KEY_RE.match(name):
                try:
                    if self.fs.size(self._rel(name, MANIFEST)) is not None:
                        out.append(name)
                except StoreError:
                    continue  # e.g. a symlink leading outside root: not ours
        return out

    def lock(self, key: str):
        """Context manager: exclusive writer lock on ``key`` (waits for another holder; no-op remotely)."""
        rel = self._rel(key, LOCK)
        self.fs.mkdir(key)
        return self.fs.lock(rel)

    def touch(self, key: str) -> None:
        """Record ``key``'s last use (now)."""
        try:
            self.fs.write_atomic(self._rel(key, LAST_USE), datetime.now(timezone.utc).isoformat().encode())
        except OSError as e:  # a read-only store still serves reads
            log.warning("could not record last use of %s: %s", key, e)

    def last_use(self, key: str) -> datetime | None:
        data = self.fs.read_bytes(self._rel(key, LAST_USE))
        try:
            return datetime.fromisoformat(data.decode()) if data else None
        except ValueError:
            return None

    def key_bytes(self, key: str) -> int:
        """Bytes of every file in the key dir."""
        self._check_key(key)
        return sum(self.fs.size(f"{key}/{n}") or 0 for n in self.fs.listdir(key))

    def delete(self, key: str) -> None:
        self.fs.delete_dir(self._check_key(key))

    # ------------------------------------------------------------------------------------ shard plans
    @staticmethod
    def shard_plan(num_rows: int, shard_size: int, start_row: int = 0, start_index: int = 0
                   ) -> list[tuple[int, int, int]]:
        """[(shard_index, row_start, row_stop)] covering [start_row, num_rows) contiguously; last may be short."""
        if num_rows < 0 or shard_size < 1 or start_row < 0:
            raise StoreError(f"bad shard plan: num_rows={num_rows}, shard_size={shard_size}, start={start_row}")
        return [(start_index + i, s, min(s + shard_size, num_rows))
                for i, s in enumerate(range(start_row, num_rows, shard_size))]

    def shard_info(self, key: str, shard_index: int) -> dict | None:
        """The sidecar of a written shard (row range, bytes, sha256, dtype, block shapes), or None."""
        try:
            return self._read_json(self._rel(key, sidecar_name(shard_index)))
        except StoreError:
            return None

    def missing_shards(self, key: str, plan_or_rows, shard_size: int | None = None, *,
                       verify: bool = False) -> list[tuple[int, int, int]]:
        """Plan entries still to compute (resume): ``missing_shards(key, plan)`` or ``(key, num_rows, shard_size)``.

        A shard counts as present only if its file exists and its sidecar records the same row range and the
        file's current size (and, with ``verify``, its sha256). A shard without a sidecar (crash between the
        two renames) is recomputed.
        """
        plan = plan_or_rows if shard_size is None else self.shard_plan(plan_or_rows, shard_size)
        missing = []
        for idx, start, stop in plan:
            info = self.shard_info(key, idx)
            ok = (info is not None and (info.get("row_start"), info.get("row_stop")) == (start, stop)
                  and self.check_shard(key, info, checksum=verify) is None)
            if not ok:
                missing.append((idx, start, stop))
        return missing

    # -------------------------------------------------------------------------------------- integrity
    def _verified(self, key: str) -> dict:
        try:
            return self._read_json(self._rel(key, VERIFIED)) or {}
        except StoreError:
            return {}

    def _mark_verified(self, key: str, entries: dict[str, dict]) -> None:
        if entries:
            self._write_verified(key, {**self._verified(key), **entries})

    def _write_verified(self, key: str, v: dict) -> None:
        try:
            self.fs.write_atomic(self._rel(key, VERIFIED), canonical_json(v).encode())
        except OSError as e:  # a read-only store (or a full disk) still serves reads: the record is only a log
            log.warning("could not record the verified shards of %s: %s", key, first_line(e))

    def _stamp(self, key: str, info: dict) -> dict:
        rel = self._rel(key, str(info.get("file")))
        return {"sha256": info["sha256"], "bytes": info["bytes"], "mtime": self.fs.mtime(rel)}

    def check_shard(self, key: str, info: dict, *, checksum: bool = False) -> str | None:
        """None if the shard is sound, else why not: its size always, its sha256 with ``checksum``."""
        try:
            rel = self._rel(key, str(info.get("file")))
        except StoreError as e:
            return str(e)
        size = self.fs.size(rel)
        if size is None:
            return f"missing ({info.get('bytes')} bytes recorded)"
        if size != info.get("bytes"):
            return f"truncated or grown ({size} bytes on disk, {info.get('bytes')} recorded)"
        if checksum and self.fs.sha256(rel) != info.get("sha256"):
            return "fails its sha256 check"
        return None

    def verify(self, key: str, num_rows: int | None = None) -> list[tuple[dict, str]]:
        """[(shard info, problem)] for the shards covering [0, num_rows), each checked by size and sha256.

        Integrity policy: every check hashes the bytes (no size/mtime shortcut: bit rot keeps both). verified.json
        records the last pass of each shard and loses the entry of a shard found bad; nothing trusts it (a store
        that cannot be written keeps serving reads without it)."""
        m = self.manifest(key)
        if m is None:
            raise StoreError(f"key {key} has no manifest (missing or not finalized)")
        n = m["num_rows"] if num_rows is None else num_rows
        verified = self._verified(key)
        bad, good = [], {}
        for s in (s for s in m["shards"] if s["row_start"] < n):
            if problem := self.check_shard(key, s, checksum=True):
                bad.append((s, problem))
            elif verified.get(s["file"]) != (st := self._stamp(key, s)):
                good[s["file"]] = st
        cleared = {s["file"] for s, _ in bad} & set(verified)
        if good or cleared:
            self._write_verified(key, {f: e for f, e in {**verified, **good}.items() if f not in cleared})
        return bad

    def quarantine(self, key: str, name: str) -> str | None:
        """Move ``key``/``name`` (a damaged manifest or shard) to <root>/.quarantine/; returns where it went."""
        rel = self._rel(key, name)
        if self.fs.size(rel) is None:
            return None
        stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%S%fZ")
        dst = f"{QUARANTINE}/{key}-{stamp}-{name}"
        self.fs.mkdir(QUARANTINE)
        self.fs.move(rel, dst)
        if name.endswith(".arrow"):  # its sidecar describes bytes that are gone
            self.fs.delete(self._rel(key, name[:-len(".arrow")] + ".json"))
        log.warning("store key %s: moved damaged %s to %s", key, name, self.fs.path(dst))
        return self.fs.path(dst)

    # ----------------------------------------------------------------------------------------- writes
    def write_shard(self, key: str, shard_index: int, row_start: int,
                    blocks: dict[str, torch.Tensor]) -> dict:
        """Write rows [row_start, row_start + rows) of every block atomically; return the shard info.

        blocks: name -> (rows, *shape) float16 or bfloat16 tensor; same rows and dtype for all blocks.
        Rewriting a shard with the same rows is idempotent (last rename wins, the sidecar follows it).
        """
        from tasks.store.codec import NAMES, to_u16  # torch: only a writer of values needs it

        self._check_key(key)
        if not blocks:
            raise StoreError("write_shard needs at least one block")
        if shard_index < 0 or row_start < 0:
            raise StoreError(f"negative shard_index/row_start: {shard_index}, {row_start}")
        dtypes = {t.dtype for t in blocks.values()}
        rows = {t.shape[0] if t.dim() else -1 for t in blocks.values()}
        if len(dtypes) != 1 or next(iter(dtypes)) not in NAMES:
            raise StoreError(f"blocks must all be float16 or all bfloat16, got {sorted(map(str, dtypes))}")
        if len(rows) != 1 or next(iter(rows)) < 1:
            raise StoreError(f"blocks must share a positive row count, got {sorted(rows)}")
        n = rows.pop()
        dtype = NAMES[dtypes.pop()]

        fields, arrays = [], []
        for name, t in blocks.items():
            shape = list(t.shape[1:])
            width = math.prod(shape)
            if width < 1:
                raise StoreError(f"block {name!r} has empty per-row shape {shape}")
            values = pa.array(to_u16(t).reshape(-1), type=pa.uint16())  # (rows * width,)
            arrays.append(pa.FixedSizeListArray.from_arrays(values, width))
            fields.append(pa.field(name, pa.list_(pa.uint16(), width), nullable=False,
                                   metadata={"shape": json.dumps(shape)}))
        schema = pa.schema(fields, metadata={"format": FORMAT, "dtype": dtype, "row_start": str(row_start),
                                             "row_stop": str(row_start + n)})
        sink = pa.BufferOutputStream()
        with ipc.new_file(sink, schema) as writer:
            writer.write_table(pa.Table.from_arrays(arrays, schema=schema), max_chunksize=BATCH_ROWS)
        buf = sink.getvalue()
        info = {"index": shard_index, "row_start": row_start, "row_stop": row_start + n,
                "file": shard_name(shard_index), "bytes": buf.size, "sha256": hashlib.sha256(buf).hexdigest(),
                "dtype": dtype, "block_shapes": {k: list(t.shape[1:]) for k, t in blocks.items()}}
        self.fs.mkdir(key)
        self.fs.write_atomic(self._rel(key, info["file"]), buf)
        self.fs.write_atomic(self._rel(key, sidecar_name(shard_index)), canonical_json(info).encode())
        return info

    def finalize(self, key: str, *, meta: dict, block_shapes: dict[str, list[int]], dtype: str,
                 num_rows: int, shard_infos: list[dict], calibration_rows: list[int] | None = None) -> dict:
        """Check the shards tile [0, num_rows) and match the schema, then write manifest.json (last).

        ``calibration_rows``: the dataset index of each row (row i = calibration item i); default 0..n-1.
        """
        if dtype not in DTYPE_NAMES:
            raise StoreError(f"dtype must be one of {sorted(DTYPE_NAMES)}, got {dtype!r}")
        if num_rows < 1 or not block_shapes:
            raise StoreError(f"need num_rows >= 1 and at least one block (num_rows={num_rows})")
        shards = sorted((dict(s) for s in shard_infos), key=lambda s: s["row_start"])
        problem = tiling_problem(shards, num_rows)
        if problem:
            raise StoreError(problem)
        if calibration_rows is not None and len(calibration_rows) != num_rows:
            raise StoreError(f"calibration_rows has {len(calibration_rows)} entries, num_rows is {num_rows}")
        shapes = {name: [int(d) for d in shape] for name, shape in block_shapes.items()}
        for s in shards:  # reading a footer is cheap: catches a stale or foreign shard before publishing
            problem = self.check_shard(self._check_key(key), s)
            if problem:
                raise StoreError(f"shard {s['file']} of key {key} is {problem}")
            self._check_schema(key, s, shapes, dtype)
        m = {"format": FORMAT, "key": key, "meta": meta, "block_names": list(shapes),
             "block_shapes": shapes, "dtype": dtype, "num_rows": num_rows,
             "row_bytes": 2 * sum(math.prod(v) for v in shapes.values()),
             "calibration_rows": [int(i) for i in calibration_rows] if calibration_rows is not None
             else list(range(num_rows)),
             "shards": shards, "producer": producer_versions(),
             "created": datetime.now(timezone.utc).isoformat()}
        self.fs.write_atomic(self._rel(key, MANIFEST), (json.dumps(m, indent=1, allow_nan=False) + "\n").encode())
        return m

    def _check_schema(self, key: str, info: dict, shapes: dict[str, list[int]], dtype: str) -> None:
        name = info["file"]
        try:
            with self.fs.open_random(self._rel(key, name)) as f:
                r = ipc.open_file(f)
                md = {k.decode(): v.decode() for k, v in (r.schema.metadata or {}).items()}
                got = {fl.name: json.loads((fl.metadata or {}).get(b"shape", b"null")) for fl in r.schema}
                rows = sum(r.get_batch(i).num_rows for i in range(r.num_record_batches))
        except (pa.ArrowException, ValueError, OSError) as e:
            raise StoreError(f"shard {name} is not a readable shard: {e}") from e
        want_rows = info["row_stop"] - info["row_start"]
        if (got != shapes or list(got) != list(shapes) or md.get("dtype") != dtype or rows != want_rows
                or md.get("row_start") != str(info["row_start"])):
            raise StoreError(f"shard {name} does not match the manifest: blocks {got}, dtype "
                             f"{md.get('dtype')}, rows {rows} from {md.get('row_start')} "
                             f"(want {shapes}, {dtype}, {want_rows} from {info['row_start']})")

    # ------------------------------------------------------------------------------------------ reads
    def open(self, key: str, num_rows: int | None = None, *, verify: bool = True, touch: bool = True,
             blocks: Sequence[str] | None = None) -> TargetReader:
        """Reader over rows [0, num_rows) (default: all); only shards covering that prefix are touched. ``blocks``:
        the columns it reads and hands out (default: all; e.g. only ``logits`` for logit distillation).

        ``verify`` (default True): every needed shard's size and sha256 are
        checked on every open, i.e. once per reader (per trial); False checks sizes only (benchmarks).
        """
        m = self.manifest(key)
        if m is None:
            raise StoreError(f"key {key} has no manifest (missing or not finalized)")
        n = m["num_rows"] if num_rows is None else num_rows
        if not 1 <= n <= m["num_rows"]:
            raise StoreError(f"num_rows={n} outside [1, {m['num_rows']}] for key {key}")
        needed = [s for s in m["shards"] if s["row_start"] < n]
        if verify:
            bad = self.verify(key, n)
        else:
            bad = [(s, p) for s in needed if (p := self.check_shard(key, s))]
        if bad:
            s, problem = bad[0]
            raise StoreError(f"shard {s['file']} of key {key} {problem}")
        if touch:
            self.touch(key)
        from tasks.store.reader import TargetReader  # torch: a reader hands out tensors

        return TargetReader(self, key, m, needed, n, blocks)


def tiling_problem(shards: list[dict], num_rows: int) -> str | None:
    """Why ``shards`` (sorted by row_start) do not tile [0, num_rows) exactly, or None."""
    pos = 0
    for s in shards:
        if s["row_start"] != pos or s["row_stop"] <= s["row_start"]:
            return f"shard rows do not tile [0, {num_rows}): gap/overlap at row {pos} ({s.get('file')})"
        pos = s["row_stop"]
    if pos != num_rows:
        return f"shard rows do not tile [0, {num_rows}): they end at {pos}"
    if len({s["index"] for s in shards}) != len(shards):
        return "duplicate shard indices"
    return None


def check_manifest(m: dict) -> str | None:
    """Why a parsed manifest is not self-consistent, or None: its shards must cover exactly its rows (a manifest
    claiming 320 rows over 256 stored is damaged), one calibration row per row, known dtype and file names."""
    try:
        n, shards, shapes = m["num_rows"], m["shards"], m["block_shapes"]
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            return f"num_rows {n!r} is not a positive integer"
        if m.get("dtype") not in DTYPE_NAMES:
            return f"dtype {m.get('dtype')!r} is not one of {sorted(DTYPE_NAMES)}"
        if not isinstance(shapes, dict) or not shapes or list(m["block_names"]) != list(shapes):
            return "block_names / block_shapes disagree"
        for s in shards:
            if not (isinstance(s["file"], str) and _FILE_RE.match(s["file"]) and s["file"].endswith(".arrow")
                    and all(isinstance(s[k], int) for k in ("index", "row_start", "row_stop", "bytes"))):
                return f"bad shard entry {canonical_json(s)[:120]}"
        problem = tiling_problem(sorted(shards, key=lambda s: s["row_start"]), n)
        if problem:
            return problem
        cal = m.get("calibration_rows")
        if cal is not None and len(cal) != n:
            return f"{len(cal)} calibration rows for {n} rows"
    except (KeyError, TypeError, AttributeError, ValueError) as e:
        return f"missing or malformed field ({type(e).__name__}: {e})"
    return None
