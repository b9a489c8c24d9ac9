"""The store's fast stream for accelerators: batches gathered straight from the memory-mapped shards into pinned
host memory (one copy per row), then copied to the device on a side CUDA stream by the prefetch thread, so that
reading, the host-to-device copy and the healing step overlap.

- The gather runs on ``threads`` threads (``np.take`` releases the GIL; a Ray trial's torch has one intra-op
  thread, so ``torch.index_select`` alone would copy on one core): each block of a batch is one job.
- The shards' memory maps are opened once per reader and kept until it closes (``StreamMaps``), not re-opened and
  re-faulted every epoch (the pages are the OS's page cache either way).
- Pinned buffers come from a ring (``PinnedRing``): a set is rewritten only after the device copy that read it has
  finished, so no pinned memory is allocated or freed per batch.

Same rows, same order, same values as ``TargetReader._produce`` (the CPU path); only where the bytes go differs.
"""
from __future__ import annotations

import warnings
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Iterator

import numpy as np
import torch

Segment = tuple[dict[str, np.ndarray], np.ndarray, np.ndarray]  # (window sources, local index (m,), rows (m,))
Buffers = Callable[[int], dict[str, torch.Tensor]]  # n -> {block: (n, width) int16}


def _as_int16(a: np.ndarray) -> torch.Tensor:
    """(rows, width) uint16 view -> int16 tensor sharing it (read-only memory maps included)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # a read-only memory map: the tensor is only read
        return torch.from_numpy(a.view(np.int16))


def shard_columns(reader, si: int) -> tuple[object, dict[str, np.ndarray]]:
    """(open file, {block: (rows, width) uint16}) of shard ``si`` below num_rows: zero-copy views of the memory-mapped
    file when it holds one record batch (the store writes <= 256 rows per batch), else one concatenated copy. The
    views are valid while the file is open."""
    f = reader.open_shard(si)
    table, keep = reader.read_table(si, f)
    parts = [reader._columns(b, reader._infos[si]["file"]) for b in table.slice(0, keep).to_batches()]
    if len(parts) == 1:
        return f, parts[0]
    return f, {n: np.concatenate([p[n] for p in parts]) for n in reader.block_names}


class StreamMaps:
    """Each shard's columns, mapped on first use and kept until ``close`` (one reader, many epochs)."""

    def __init__(self, reader):
        self.reader, self._open = reader, {}

    def __call__(self, si: int) -> dict[str, np.ndarray]:
        if si not in self._open:
            self._open[si] = shard_columns(self.reader, si)
        return self._open[si][1]

    def close(self) -> None:
        files, self._open = [f for f, _ in self._open.values()], {}
        for f in files:
            f.close()


def window_sources(reader, maps: Callable[[int], dict[str, np.ndarray]], group: list[int], order: np.ndarray
                   ) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """One window: ({block: (k, width) int16 source}, (k,) int64 position of each row of ``order`` in it)."""
    cols = [maps(s) for s in group]
    sizes = [len(c[reader.block_names[0]]) for c in cols]
    off = np.zeros(len(reader._infos), np.int64)  # shard -> (position in the window) - (global row)
    off[group] = np.concatenate([[0], np.cumsum(sizes)[:-1]]) - reader._starts[group]
    local = order + off[np.searchsorted(reader._starts, order, side="right") - 1]  # (k,)
    src = {n: (cols[0][n] if len(cols) == 1 else np.concatenate([c[n] for c in cols])).view(np.int16)
           for n in reader.block_names}
    return src, np.ascontiguousarray(local)


def fresh_buffers(reader, pin: bool) -> Buffers:
    return lambda n: {name: torch.empty((n, w), dtype=torch.int16, pin_memory=pin) for name, w in reader._widths.items()}


def _take(src: np.ndarray, idx: np.ndarray, out: np.ndarray) -> None:
    """out (m, width) <- src[idx] (m,): one memcpy per row, GIL released; 'clip' spares numpy's checked temporary
    (indices were bounds-checked by the reader's epoch order)."""
    np.take(src, idx, axis=0, out=out, mode="clip")


def assemble(reader, segments: list[Segment], buffers: Buffers, pool: ThreadPoolExecutor | None
             ) -> tuple[np.ndarray, dict[str, torch.Tensor]]:
    """One batch from its segments: each block gathered into one buffer (a job per block, on ``pool`` if given),
    viewed as the store dtype and block shape. -> (rows (B,), {block: (B, *shape)})."""
    n = sum(len(idx) for _, idx, _ in segments)
    bufs = buffers(n)

    def gather(name: str) -> None:
        out, pos = bufs[name].numpy(), 0  # (n, width) int16, sharing the buffer
        for src, idx, _ in segments:
            _take(src[name], idx, out[pos:pos + len(idx)])
            pos += len(idx)

    if pool is None:
        for name in reader.block_names:
            gather(name)
    else:
        for job in [pool.submit(gather, name) for name in reader.block_names]:
            job.result()
    out = {name: bufs[name][:n].view(reader.dtype).reshape(n, *reader.block_shapes[name]) for name in reader.block_names}
    return np.concatenate([rows for _, _, rows in segments]), out


def gathered_batches(reader, batch_size: int, drop_last: bool, wins, *, maps=None, buffers: Buffers | None = None,
                     threads: int = 1) -> Iterator[tuple[np.ndarray, dict[str, torch.Tensor]]]:
    """Batches of ``batch_size`` rows over the epoch's windows (a batch may span two windows), like
    ``TargetReader._produce``. ``maps``: shard -> columns (default: a ``StreamMaps`` closed at the end);
    ``buffers``: where batches land (default: fresh, unpinned); ``threads`` > 1 gathers blocks in parallel."""
    own = maps is None
    maps = StreamMaps(reader) if own else maps
    buffers = buffers or fresh_buffers(reader, pin=False)
    pool = ThreadPoolExecutor(threads, thread_name_prefix="healsweep-gather") if threads > 1 else None
    try:
        carry: list[Segment] = []
        have = 0
        for group, order in wins:
            src, local = window_sources(reader, maps, group, order)
            i = 0
            while i < len(order):
                take = min(batch_size - have, len(order) - i)
                carry.append((src, local[i:i + take], order[i:i + take]))
                have, i = have + take, i + take
                if have == batch_size:
                    yield assemble(reader, carry, buffers, pool)
                    carry, have = [], 0
        if carry and not drop_last:
            yield assemble(reader, carry, buffers, pool)
    finally:
        if pool is not None:
            pool.shutdown(wait=True)
        if own:
            maps.close()


class PinnedRing:
    """``depth`` sets of pinned (rows, width) int16 buffers, one per block, handed out round-robin; a set is handed
    out again only after the device copy that last read it has finished (``mark``), so the host never overwrites
    bytes still in flight and nothing is pinned per batch."""

    def __init__(self, widths: dict[str, int], rows: int, depth: int, pin: bool = True):
        self.sets = [{n: torch.empty((rows, w), dtype=torch.int16, pin_memory=pin) for n, w in widths.items()}
                     for _ in range(depth)]
        self.events: list[torch.cuda.Event | None] = [None] * depth
        self.i = -1

    def __call__(self, n: int) -> dict[str, torch.Tensor]:
        self.i = (self.i + 1) % len(self.sets)
        if self.events[self.i] is not None:
            self.events[self.i].synchronize()  # the copy that read this set is done (producer thread only)
        return {name: t[:n] for name, t in self.sets[self.i].items()}

    def mark(self, done: torch.cuda.Event) -> None:
        self.events[self.i] = done


class DeviceCopier:
    """Host-to-device copies of prefetched batches on a side CUDA stream (called from the prefetch thread);
    ``ready`` (in the consumer) makes the consumer's stream wait for that copy, without blocking the host."""

    def __init__(self, device: torch.device, ring: PinnedRing | None = None):
        self.device, self.ring = device, ring
        self.stream = torch.cuda.Stream(device=device)

    def send(self, batch: tuple[np.ndarray, dict[str, torch.Tensor]]):
        rows, tgt = batch
        with torch.cuda.stream(self.stream):
            out = {n: t.to(self.device, non_blocking=True) for n, t in tgt.items()}
            done = torch.cuda.Event()
            done.record(self.stream)
        if self.ring is not None:
            self.ring.mark(done)
        return rows, out, done

    def ready(self, item) -> tuple[np.ndarray, dict[str, torch.Tensor]]:
        rows, out, done = item
        current = torch.cuda.current_stream(self.device)
        current.wait_event(done)
        for t in out.values():
            t.record_stream(current)  # the allocator must not reuse this memory before the consumer is done
        return rows, out
