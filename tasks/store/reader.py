"""Bounded-memory reads of one target set: random row access and a prefetching, windowed-shuffle stream."""
from __future__ import annotations

import math
import os
from typing import Iterator, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.ipc as ipc
import torch

from tasks.store.codec import DTYPES, from_u16
from tasks.store.format import StoreError
from tasks.store.stream import DeviceCopier, EpochAhead, PinnedRing, Prefetcher, StreamMaps, ring_batches

Batch = tuple[np.ndarray, dict[str, torch.Tensor]]  # rows (B,) int64, {block: (B, *shape)}
GATHER_THREADS = min(4, os.cpu_count() or 1)  # the accelerator stream's gather threads (tasks/store/stream.py)


def selected_columns(columns: list[str], blocks: Sequence[str] | None, key: str) -> list[str]:
    """The columns a reader hands out: all (None) or ``blocks``, in file order; unknown or no names refused."""
    if blocks is None:
        return list(columns)
    wanted = set(blocks)
    unknown = sorted(wanted - set(columns))
    if unknown or not wanted:
        raise StoreError(f"key {key}: cannot read blocks {unknown or '(none)'}; it holds {', '.join(columns)}")
    return [c for c in columns if c in wanted]


class TargetReader:
    """Rows [0, num_rows) of one key (see ``TargetStore.open``), its columns or the ``blocks`` among them.

    ``iter_batches`` streams one *window* of shards at a time (read whole, sequentially, then dropped), so
    memory is bounded by ``window`` shards plus ``prefetch`` batches whatever the calibration size. (On a GPU the
    shards stay memory-mapped until ``close``: their pages are the OS's page cache, reclaimable, not the process's
    own memory; the pinned ring holds ``prefetch`` + 2 batches.)
    ``read_rows`` serves random access through memory maps (local) or per-record-batch reads (remote).
    """

    def __init__(self, store, key: str, manifest: dict, shard_infos: list[dict], num_rows: int,
                 blocks: Sequence[str] | None = None):
        self._store, self._key = store, key
        self.meta: dict = dict(manifest.get("meta") or {})  # what the writer recorded (model, calibration digest, ...)
        self.columns: list[str] = list(manifest["block_names"])  # every column a shard holds, in file order
        self.block_names: list[str] = selected_columns(self.columns, blocks, key)  # the ones this reader hands out
        self.block_shapes: dict[str, tuple[int, ...]] = {
            k: tuple(manifest["block_shapes"][k]) for k in self.block_names}
        self.dtype: torch.dtype = DTYPES[manifest["dtype"]]
        self.num_rows: int = num_rows
        self._file_widths = {n: math.prod(manifest["block_shapes"][n]) for n in self.columns}
        self._widths = {n: self._file_widths[n] for n in self.block_names}
        self._infos = sorted(shard_infos, key=lambda s: s["row_start"])
        self._starts = np.array([s["row_start"] for s in self._infos], dtype=np.int64)  # (n_shards,)
        self._random: dict[int, tuple] = {}  # shard -> (file, ipc reader, batch starts) for read_rows
        self.rows_streamed: dict[int, int] = {}  # epoch -> rows yielded by iter_batches (complete epochs)
        self._maps = StreamMaps(self)  # the accelerator stream's shard maps, kept across epochs until close
        self._rings: dict[tuple, PinnedRing] = {}  # (device, batch, depth) -> pinned buffers, kept likewise
        self._ahead = EpochAhead()  # the accelerator stream's next epoch, started as the current one ends
        self._closed = False

    # ------------------------------------------------------------------------------------ raw access
    def _check_open(self) -> None:
        if self._closed:
            raise StoreError("reader is closed")

    def _columns(self, batch: pa.RecordBatch, where: str) -> dict[str, np.ndarray]:
        """{block: (rows, width) uint16} views of one record batch's selected columns, its whole schema checked."""
        if batch.schema.names != self.columns:
            raise StoreError(f"{where} has columns {batch.schema.names}, expected {self.columns}")
        out = {}
        for name, col in zip(self.columns, batch.columns):
            if col.null_count or col.type.list_size != self._file_widths[name]:
                raise StoreError(f"{where} column {name}: nulls or width {col.type.list_size}")
            if name in self._widths:  # an unselected column is never read (its pages stay on disk)
                out[name] = col.flatten().to_numpy(zero_copy_only=True).reshape(batch.num_rows, self._widths[name])
        return out

    def _random_reader(self, si: int):
        if si not in self._random:
            info = self._infos[si]
            f = self._store.fs.open_random(self._store._rel(self._key, info["file"]))
            try:
                r = ipc.open_file(f)
                sizes = [r.get_batch(b).num_rows for b in range(r.num_record_batches)]
            except pa.ArrowException as e:
                f.close()
                raise StoreError(f"shard {info['file']} is not a readable Arrow IPC file: {e}") from e
            starts = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
            if starts[-1] != info["row_stop"] - info["row_start"]:
                f.close()
                raise StoreError(f"shard {info['file']} holds {starts[-1]} rows, manifest says "
                                 f"{info['row_stop'] - info['row_start']}")
            self._random[si] = (f, r, starts)
        return self._random[si]

    def read_table(self, si: int, f) -> tuple[pa.Table, int]:
        """Shard ``si`` read whole from the open file ``f`` (a memory map locally: no copy), its row count checked
        against the manifest. -> (table, rows of it below num_rows)."""
        info = self._infos[si]
        try:
            table = ipc.open_file(f).read_all()
        except pa.ArrowException as e:
            raise StoreError(f"shard {info['file']} is not a readable Arrow IPC file: {e}") from e
        if table.num_rows != info["row_stop"] - info["row_start"]:
            raise StoreError(f"shard {info['file']} holds {table.num_rows} rows, manifest says "
                             f"{info['row_stop'] - info['row_start']}")
        return table, min(info["row_stop"], self.num_rows) - info["row_start"]

    def open_shard(self, si: int):
        return self._store.fs.open_random(self._store._rel(self._key, self._infos[si]["file"]))

    def read_shard(self, si: int) -> dict[str, np.ndarray]:
        """Rows of shard ``si`` below num_rows, {block: (rows, width) uint16}, in fresh memory (file closed)."""
        info = self._infos[si]
        # Locally: memory-mapped, copied once, unmapped on return (its pages leave this process's RSS).
        with self.open_shard(si) as f:
            table, keep = self.read_table(si, f)
            out = {n: np.empty((keep, w), np.uint16) for n, w in self._widths.items()}
            pos = 0
            for batch in table.slice(0, keep).to_batches():
                for n, v in self._columns(batch, info["file"]).items():
                    out[n][pos:pos + batch.num_rows] = v
                pos += batch.num_rows
            del table
        return out

    def read_rows(self, rows: np.ndarray) -> dict[str, torch.Tensor]:
        """Rows in the given order -> {name: (len(rows), *shape)} fresh tensors in the store dtype."""
        self._check_open()
        rows = np.asarray(rows).reshape(-1)  # (B,)
        if rows.size and rows.dtype.kind not in "iu":
            raise StoreError(f"row indices must be integers, got dtype {rows.dtype}")
        rows = rows.astype(np.int64)
        if rows.size and (rows.min() < 0 or rows.max() >= self.num_rows):
            raise StoreError(f"row indices must lie in [0, {self.num_rows})")
        out = {n: np.empty((rows.size, w), np.uint16) for n, w in self._widths.items()}  # name -> (B, width)
        shard_of = np.searchsorted(self._starts, rows, side="right") - 1  # (B,)
        for si in np.unique(shard_of):
            _, reader, starts = self._random_reader(int(si))
            pos = np.flatnonzero(shard_of == si)  # positions in the output
            local = rows[pos] - self._starts[si]  # rows within the shard
            batch_of = np.searchsorted(starts, local, side="right") - 1
            for bi in np.unique(batch_of):
                sel = batch_of == bi
                p, r = pos[sel], local[sel] - starts[bi]
                cols = self._columns(reader.get_batch(int(bi)), self._infos[si]["file"])
                for name in self.block_names:
                    out[name][p] = cols[name][r]  # copies only these rows
        return {n: from_u16(a, self.dtype, self.block_shapes[n]) for n, a in out.items()}

    # ------------------------------------------------------------------------------------ epoch order
    def windows(self, *, shuffle: bool = False, seed: int = 0, epoch: int = 0, window: int = 1
                ) -> list[tuple[list[int], np.ndarray]]:
        """One epoch as [(shard indices, row order (k,) int64)]: shards in (seeded) random order, grouped
        ``window`` at a time, rows permuted within each group. Without shuffle: identity, one shard each."""
        self._check_open()
        if window < 1:
            raise StoreError(f"window must be >= 1, got {window}")
        ns = len(self._infos)
        rng = np.random.default_rng([seed, epoch]) if shuffle else None
        shard_order = rng.permutation(ns) if shuffle else np.arange(ns)
        out = []
        for g in range(0, ns, window if shuffle else 1):
            group = [int(s) for s in shard_order[g:g + (window if shuffle else 1)]]
            rows = np.concatenate([np.arange(self._infos[s]["row_start"],
                                             min(self._infos[s]["row_stop"], self.num_rows), dtype=np.int64)
                                   for s in group])
            out.append((group, rng.permutation(rows) if shuffle else rows))
        return out

    def epoch_order(self, *, shuffle: bool = False, seed: int = 0, epoch: int = 0, window: int = 1) -> np.ndarray:
        """Row order of one epoch, (num_rows,) int64 (the order ``iter_batches`` yields)."""
        w = self.windows(shuffle=shuffle, seed=seed, epoch=epoch, window=window)
        return np.concatenate([o for _, o in w]) if w else np.zeros(0, np.int64)

    def _produce(self, batch_size: int, drop_last: bool, wins) -> Iterator[Batch]:
        left_rows = np.zeros(0, np.int64)  # rows carried into the next window (< batch_size)
        left = {n: np.zeros((0, w), np.uint16) for n, w in self._widths.items()}
        for group, order in wins:
            parts = [self.read_shard(s) for s in group]
            sizes = [len(p[self.block_names[0]]) for p in parts]
            off = np.zeros(len(self._infos), np.int64)  # shard -> (position in the window) - (global row)
            off[group] = np.concatenate([[0], np.cumsum(sizes)[:-1]]) - self._starts[group]
            local = order + off[np.searchsorted(self._starts, order, side="right") - 1]  # (k,)
            win = {n: (np.concatenate([p[n] for p in parts]) if len(parts) > 1 else parts[0][n])[local]
                   for n in self.block_names}  # (k, width): the window, permuted (one copy)
            del parts
            i = 0
            if left_rows.size:
                i = min(batch_size - left_rows.size, order.size)
                left_rows = np.concatenate([left_rows, order[:i]])
                left = {n: np.concatenate([left[n], win[n][:i]]) for n in self.block_names}
                if left_rows.size < batch_size:
                    continue
                yield left_rows, self._tensors(left)
                left_rows = np.zeros(0, np.int64)
            while order.size - i >= batch_size:
                yield order[i:i + batch_size], self._tensors({n: v[i:i + batch_size] for n, v in win.items()})
                i += batch_size
            left_rows = order[i:].copy()
            left = {n: v[i:].copy() for n, v in win.items()}
        if left_rows.size and not drop_last:
            yield left_rows, self._tensors(left)

    def _tensors(self, cols: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
        """CPU batches (a GPU's are gathered into pinned memory by tasks/store/stream.py)."""
        return {n: from_u16(np.ascontiguousarray(a), self.dtype, self.block_shapes[n]) for n, a in cols.items()}

    def iter_batches(self, batch_size: int, *, shuffle: bool = False, seed: int = 0, epoch: int = 0,
                     drop_last: bool = False, window: int = 1, prefetch: int = 2,
                     device: str | torch.device | None = None, gather_threads: int = GATHER_THREADS
                     ) -> Iterator[Batch]:
        """Yield (rows (B,) int64, {name: (B, *shape)}) covering every row exactly once per epoch.

        A background thread reads windows and assembles batches into a queue of ``prefetch`` batches
        (0: no thread). On a CUDA ``device`` that thread gathers each batch straight from the memory-mapped shards
        into pinned host memory and copies it to the device on a side stream (tasks/store/stream.py), so the copy
        overlaps the consumer's work (``gather_threads`` threads gather; shard maps and pinned buffers are kept
        across epochs until ``close``; once an epoch's batches are produced, epoch + 1's start, for the call that
        asks for it next with the same arguments); otherwise batches stay on the CPU.
        """
        if batch_size < 1:
            raise StoreError(f"batch_size must be >= 1, got {batch_size}")
        wins = self.windows(shuffle=shuffle, seed=seed, epoch=epoch, window=window)
        dev = torch.device(device) if device is not None else None
        cuda = dev is not None and dev.type == "cuda"
        if cuda:  # one copy per row into pinned memory, then a side-stream copy to the device (tasks/store/stream.py)
            gen = self._device_stream(dev, batch_size, shuffle, seed, epoch, drop_last, window, prefetch,
                                      gather_threads)
        else:
            gen = self._produce(batch_size, drop_last, wins)
            if prefetch > 0:
                gen = Prefetcher(gen, prefetch)
        streamed = 0
        for item in gen:
            rows, tgt = DeviceCopier.ready(item) if cuda else item
            streamed += len(rows)
            yield rows, tgt
        self.rows_streamed[epoch] = streamed
        want = self.num_rows - (self.num_rows % batch_size if drop_last else 0)
        if streamed != want:  # e.g. a manifest claiming rows its shards do not hold: never train on fewer silently
            raise StoreError(f"key {self._key} epoch {epoch}: streamed {streamed} rows, expected {want} "
                             f"(calibration size {self.num_rows})")

    def _device_stream(self, dev: torch.device, batch_size: int, shuffle: bool, seed: int, epoch: int,
                       drop_last: bool, window: int, prefetch: int, threads: int) -> Prefetcher:
        """Epoch ``epoch`` gathered into the pinned ring and copied to ``dev`` by a prefetch thread (taken over from
        the one ``EpochAhead`` started when the previous epoch of the same stream ended)."""
        depth = max(1, prefetch) + 2  # queued + being gathered + being copied
        key = (dev, batch_size, shuffle, seed, drop_last, window, depth, threads)
        ring = self._rings.get((dev, batch_size, depth))
        if ring is None:
            ring = self._rings[(dev, batch_size, depth)] = PinnedRing(self._widths, batch_size, depth)

        def make(e: int):
            copier = DeviceCopier(dev, ring, self.dtype, self.block_shapes)
            wins = self.windows(shuffle=shuffle, seed=seed, epoch=e, window=window)
            return (copier.send(b) for b in ring_batches(self, batch_size, drop_last, wins, maps=self._maps, ring=ring,
                                                         threads=threads))
        return self._ahead.stream(key, epoch, make, max(1, prefetch))

    def load_all(self) -> dict[str, torch.Tensor]:
        """Every row in RAM, {name: (num_rows, *shape)}. For benchmarks and small sets only."""
        return self.read_rows(np.arange(self.num_rows, dtype=np.int64))

    def close(self) -> None:
        for f, _, _ in self._random.values():
            f.close()
        self._ahead.close()  # before the maps its producer reads
        self._maps.close()
        self._random, self._rings, self._closed = {}, {}, True

    def __enter__(self) -> "TargetReader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
