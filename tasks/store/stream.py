"""The store's fast stream for accelerators: batches gathered straight from the memory-mapped shards into pinned
host memory (one copy per row), then copied to the device on a side CUDA stream by the prefetch thread, so that
reading, the host-to-device copy and the healing step overlap.

- The gather runs on ``threads`` threads (``np.take`` releases the GIL; a Ray trial's torch has one intra-op
  thread, so ``torch.index_select`` alone would copy on one core): the blocks are split into ``threads`` jobs of
  about equal bytes, so a batch costs the producer a handful of hand-offs of the GIL, not one per block.
- The shards' memory maps are opened once per reader and kept until it closes (``StreamMaps``), not re-opened and
  re-faulted every epoch (the pages are the OS's page cache either way).
- The copies run on the process's one ``copy`` stream (tasks/cuda_streams.py), not on a stream drawn per epoch from
  torch's pool: such a stream comes round again as the stream a CUDA-graph capture records on.
- Pinned buffers come from a ring (``PinnedRing``): one flat buffer per slot holding every block, copied to the
  device in one piece and rewritten only after that copy has finished, so no pinned memory is allocated or freed
  per batch. The producer makes no torch call per block (``ring_batches``: numpy views of each slot, made once; the
  device copy's typed views are made by the consumer in ``DeviceCopier.ready``): every call of a background thread
  is a hand-off of the GIL that a host-bound healing step waits for (benchmarks/bench_stream_gil.py; docs/gpu.md).
- ``EpochAhead``: when epoch e's batches are all produced, epoch e + 1's first batches are gathered and copied
  while the consumer finishes e (a STARFISH epoch on a small calibration set is a few steps: without this, every
  epoch would start on an empty pipeline).

Same rows, same order, same values as ``TargetReader._produce`` (the CPU path); only where the bytes go differs.
"""
from __future__ import annotations

import queue
import threading
from concurrent.futures import ThreadPoolExecutor, wait
from contextlib import contextmanager
from typing import Callable, Hashable, Iterator

import numpy as np
import torch

from tasks.cuda_streams import side_stream

Segment = tuple[dict[str, np.ndarray], np.ndarray, np.ndarray]  # (window sources, local index (m,), rows (m,))
Buffers = Callable[[int], dict[str, torch.Tensor]]  # n -> {block: (n, width) int16}


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


def balanced_groups(widths: dict[str, int], k: int) -> list[list[str]]:
    """Block names in ``k`` (or fewer) groups of about equal width: the largest first, each to the lightest group."""
    groups: list[list[str]] = [[] for _ in range(max(1, min(k, len(widths))))]
    load = [0] * len(groups)
    for name in sorted(widths, key=lambda n: -widths[n]):
        i = load.index(min(load))
        groups[i].append(name)
        load[i] += widths[name]
    return [g for g in groups if g]


def fill(segments: list[Segment], outs: dict[str, np.ndarray], pool: ThreadPoolExecutor | None,
         groups: list[list[str]]) -> None:
    """Gather one batch's rows into ``outs`` ({block: (B, width) int16}): a job per group of blocks, on ``pool`` if
    given. Only numpy calls (each releases the GIL while it copies): no torch op per block."""
    def gather(names: list[str]) -> None:
        for name in names:
            out, pos = outs[name], 0
            for src, idx, _ in segments:
                _take(src[name], idx, out[pos:pos + len(idx)])
                pos += len(idx)

    if pool is None:
        gather(list(outs))
    else:
        done, _ = wait([pool.submit(gather, g) for g in groups])
        for job in done:
            job.result()  # re-raises a job's error


def assemble(reader, segments: list[Segment], buffers: Buffers, pool: ThreadPoolExecutor | None,
             groups: list[list[str]]) -> tuple[np.ndarray, dict[str, torch.Tensor]]:
    """One batch from its segments, each block gathered into one buffer, viewed as the store dtype and block shape.
    -> (rows (B,), {block: (B, *shape)})."""
    n = sum(len(idx) for _, idx, _ in segments)
    bufs = buffers(n)
    fill(segments, {name: bufs[name].numpy() for name in reader.block_names}, pool, groups)
    out = {name: bufs[name][:n].view(reader.dtype).reshape(n, *reader.block_shapes[name]) for name in reader.block_names}
    return np.concatenate([rows for _, _, rows in segments]), out


def batch_segments(reader, batch_size: int, drop_last: bool, wins, maps) -> Iterator[list[Segment]]:
    """The epoch's windows cut into batches of ``batch_size`` rows (a batch may span two windows), in the order of
    ``TargetReader._produce``: each batch as its segments, one per window it takes rows from."""
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
                yield carry
                carry, have = [], 0
    if carry and not drop_last:
        yield carry


@contextmanager
def gather_pool(reader, threads: int) -> Iterator[tuple[ThreadPoolExecutor | None, list[list[str]]]]:
    """(pool of ``threads`` gather threads, or None for one; the blocks in that many groups of about equal bytes),
    the pool shut down on exit."""
    pool = ThreadPoolExecutor(threads, thread_name_prefix="healsweep-gather") if threads > 1 else None
    try:
        yield pool, balanced_groups(reader._widths, threads)
    finally:
        if pool is not None:
            pool.shutdown(wait=True)


def gathered_batches(reader, batch_size: int, drop_last: bool, wins, *, maps=None, buffers: Buffers | None = None,
                     threads: int = 1) -> Iterator[tuple[np.ndarray, dict[str, torch.Tensor]]]:
    """Batches of ``batch_size`` rows over the epoch's windows (a batch may span two windows), like
    ``TargetReader._produce``. ``maps``: shard -> columns (default: a ``StreamMaps`` closed at the end);
    ``buffers``: where batches land (default: fresh, unpinned); ``threads`` > 1 gathers blocks in parallel."""
    own = maps is None
    maps = StreamMaps(reader) if own else maps
    buffers = buffers or fresh_buffers(reader, pin=False)
    try:
        with gather_pool(reader, threads) as (pool, groups):
            for segments in batch_segments(reader, batch_size, drop_last, wins, maps):
                yield assemble(reader, segments, buffers, pool, groups)
    finally:
        if own:
            maps.close()


def ring_batches(reader, batch_size: int, drop_last: bool, wins, *, maps, ring: "PinnedRing", threads: int = 1
                 ) -> Iterator[tuple[np.ndarray, int]]:
    """The accelerator stream's producer: each batch gathered into the ring's next slot through cached numpy views
    (no torch op per block: every torch or numpy call of this thread is a hand-off of the GIL that a host-bound
    healing step waits for) -> (rows (B,), B); the slot is ``ring.current``, its typed views are made by the
    consumer (``DeviceCopier.ready``)."""
    with gather_pool(reader, threads) as (pool, groups):
        for segments in batch_segments(reader, batch_size, drop_last, wins, maps):
            n = sum(len(idx) for _, idx, _ in segments)
            fill(segments, ring.arrays(n), pool, groups)
            yield np.concatenate([rows for _, _, rows in segments]), n


class PinnedRing:
    """``depth`` slots, each one flat pinned int16 buffer holding every block of a batch (block b's (rows, width_b)
    at ``offsets[b]``), handed out round-robin; a slot is handed out again only after the device copy that last read
    it has finished (``mark``), so the host never overwrites bytes still in flight and nothing is pinned per batch."""

    def __init__(self, widths: dict[str, int], rows: int, depth: int, pin: bool = True):
        self.widths, self.rows = dict(widths), rows
        starts = np.concatenate([[0], np.cumsum([rows * w for w in widths.values()])]).tolist()
        self.offsets = dict(zip(widths, starts[:-1]))  # block -> first element of its (rows, width) region
        self.slots = [torch.empty(int(starts[-1]), dtype=torch.int16, pin_memory=pin) for _ in range(depth)]
        self.events: list[torch.cuda.Event | None] = [None] * depth
        self.i = -1
        self._arrays: dict[tuple[int, int], dict[str, np.ndarray]] = {}  # (slot, n) -> numpy views, made once

    def views(self, flat: torch.Tensor, n: int) -> dict[str, torch.Tensor]:
        """{block: (n, width) int16} views of one slot's (or its device copy's) flat buffer."""
        return {b: flat[o:o + n * self.widths[b]].view(n, self.widths[b]) for b, o in self.offsets.items()}

    def typed(self, flat: torch.Tensor, n: int, dtype: torch.dtype, shapes: dict[str, tuple[int, ...]]
              ) -> dict[str, torch.Tensor]:
        """{block: (n, *shape) ``dtype``} views of a slot (or its device copy) holding n rows (a full slot: one
        split of the buffer, then a view per block)."""
        typed = flat.view(dtype)
        if n == self.rows:
            parts = typed.split([n * w for w in self.widths.values()])
            return {b: t.view(n, *shapes[b]) for b, t in zip(self.widths, parts)}
        return {b: typed[o:o + n * self.widths[b]].view(n, *shapes[b]) for b, o in self.offsets.items()}

    def _next(self) -> None:
        self.i = (self.i + 1) % len(self.slots)
        if self.events[self.i] is not None:
            self.events[self.i].synchronize()  # the copy that read this slot is done (producer thread only)

    def __call__(self, n: int) -> dict[str, torch.Tensor]:
        self._next()
        return self.views(self.slots[self.i], n)

    def arrays(self, n: int) -> dict[str, np.ndarray]:
        """The next slot (as ``__call__``) as {block: (n, width) int16} numpy views, made once per slot and size."""
        self._next()
        key = (self.i, n)
        if key not in self._arrays:
            self._arrays[key] = {b: v.numpy() for b, v in self.views(self.slots[self.i], n).items()}
        return self._arrays[key]

    @property
    def current(self) -> torch.Tensor:
        return self.slots[self.i]

    def mark(self, done: torch.cuda.Event) -> None:
        self.events[self.i] = done


class DeviceCopier:
    """Host-to-device copies of prefetched batches on a side CUDA stream (called from the prefetch thread): the
    ring's current slot in one copy and nothing else; ``ready`` (in the consumer) makes the consumer's stream wait
    for that copy, without blocking the host, and views the copy as the blocks (those torch calls run in the
    consumer's thread, where they wait for no one)."""

    def __init__(self, device: torch.device, ring: PinnedRing, dtype: torch.dtype, shapes: dict[str, tuple[int, ...]]):
        self.device, self.ring, self.dtype = device, ring, dtype
        self.shapes = {b: tuple(shapes[b]) for b in ring.widths}
        self.stream = side_stream(device, "copy")  # the process's one, never a capture's (tasks/cuda_streams.py)

    def send(self, batch: tuple[np.ndarray, int]):
        rows, n = batch  # the batch is in the ring's current slot (ring_batches)
        with torch.cuda.stream(self.stream):
            flat = self.ring.current.to(self.device, non_blocking=True)  # the whole slot: one copy
            done = torch.cuda.Event()
            done.record(self.stream)
        self.ring.mark(done)
        return self, rows, n, flat, done

    @staticmethod
    def ready(item) -> tuple[np.ndarray, dict[str, torch.Tensor]]:
        copier, rows, n, flat, done = item
        current = torch.cuda.current_stream(flat.device)
        current.wait_event(done)
        flat.record_stream(current)  # the allocator must not reuse this memory before the consumer is done
        return rows, copier.ring.typed(flat, n, copier.dtype, copier.shapes)


_DONE = object()


class Prefetcher:
    """Runs ``gen`` in a daemon thread, from construction on, feeding a queue of ``depth`` items; iterating yields
    them (errors re-raise in the consumer); ``close`` (also when the consumer stops early) stops the thread.
    ``arm(callback)``: ``callback`` runs once, in whichever thread comes second, when the producer has produced
    everything and the stream was armed (and not closed)."""

    def __init__(self, gen: Iterator, depth: int):
        self._q: queue.Queue = queue.Queue(maxsize=max(1, depth))
        self._stop, self._lock = threading.Event(), threading.Lock()
        self._produced, self._callback = False, None
        self._thread = threading.Thread(target=self._work, args=(gen,), name="healsweep-prefetch", daemon=True)
        self._thread.start()

    def _put(self, item) -> bool:
        while not self._stop.is_set():
            try:
                self._q.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def _work(self, gen: Iterator) -> None:
        try:
            for item in gen:
                if not self._put(item):
                    return
            with self._lock:
                self._produced, callback = True, self._callback
            if callback is not None and not self._stop.is_set():
                callback()
            self._put(_DONE)
        except BaseException as e:  # noqa: BLE001 - handed to the consumer
            self._put(e)

    def arm(self, callback: Callable[[], None]) -> None:
        with self._lock:
            self._callback, fire = callback, self._produced
        if fire and not self._stop.is_set():
            callback()

    def __iter__(self) -> Iterator:
        try:
            while True:
                item = self._q.get()
                if item is _DONE:
                    return
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            self.close()

    def close(self) -> None:
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=5)


class EpochAhead:
    """At most one epoch streamed ahead. ``stream(key, epoch, make, depth)`` returns epoch ``epoch`` of the stream
    ``key`` (``make(epoch)``: its batches), taken over from the one started ahead when it matches; once that epoch's
    batches are all produced, epoch + 1's start (``depth`` of them, then the producer waits). An ahead stream no
    one asks for is closed by the next ``stream`` call or by ``close``."""

    def __init__(self):
        self._lock = threading.Lock()
        self._ahead: tuple[Hashable, int, Prefetcher] | None = None
        self._closed = False

    def _take(self) -> tuple[Hashable, int, Prefetcher] | None:
        with self._lock:
            ahead, self._ahead = self._ahead, None
        return ahead

    def _start_ahead(self, key: Hashable, epoch: int, make: Callable[[int], Iterator], depth: int) -> None:
        stale = self._take()  # (none unless two consumers share a reader) closed before the next producer starts
        if stale is not None:
            stale[2].close()
        try:
            gen = make(epoch)
        except Exception:  # noqa: BLE001 - not this epoch's error: asked for, epoch + 1 is made again and raises then
            return
        with self._lock:
            if not self._closed:
                self._ahead = (key, epoch, Prefetcher(gen, depth))

    def stream(self, key: Hashable, epoch: int, make: Callable[[int], Iterator], depth: int) -> Prefetcher:
        ahead = self._take()
        if ahead is not None and ahead[:2] == (key, epoch):
            p = ahead[2]
        else:
            if ahead is not None:
                ahead[2].close()
            p = Prefetcher(make(epoch), depth)
        p.arm(lambda: self._start_ahead(key, epoch + 1, make, depth))
        return p

    def close(self) -> None:
        with self._lock:
            self._closed, ahead, self._ahead = True, self._ahead, None
        if ahead is not None:
            ahead[2].close()
