"""The store's fast stream for accelerators: batches gathered straight from the memory-mapped shards into pinned
host memory (one copy per row, ``torch.index_select`` on the process's threads), then copied to the device on a
side CUDA stream by the prefetch thread, so that reading, the host-to-device copy and the healing step overlap.

Same rows, same order, same values as ``TargetReader._produce`` (the CPU path); only where the bytes go differs.
"""
from __future__ import annotations

import warnings
from typing import Iterator

import numpy as np
import torch

Segment = tuple[dict[str, torch.Tensor], torch.Tensor, np.ndarray]  # (window sources, local index (m,), rows (m,))


def _as_int16(a: np.ndarray) -> torch.Tensor:
    """(rows, width) uint16 view -> int16 tensor sharing it (read-only memory maps included)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # a read-only memory map: the tensor is only read
        return torch.from_numpy(a.view(np.int16))


def shard_columns(reader, si: int) -> dict[str, np.ndarray]:
    """{block: (rows, width) uint16} of shard ``si`` below num_rows: zero-copy views of the memory-mapped file when
    it holds one record batch (the store writes <= 256 rows per batch), else one concatenated copy."""
    table, keep = reader.read_table(si, reader.open_shard(si))  # the map stays open while its views are used
    parts = [reader._columns(b, reader._infos[si]["file"]) for b in table.slice(0, keep).to_batches()]
    if len(parts) == 1:
        return parts[0]
    return {n: np.concatenate([p[n] for p in parts]) for n in reader.block_names}


def window_sources(reader, group: list[int], order: np.ndarray) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """One window: ({block: (k, width) int16 source}, (k,) int64 position of each row of ``order`` in it)."""
    cols = [shard_columns(reader, s) for s in group]
    sizes = [len(c[reader.block_names[0]]) for c in cols]
    off = np.zeros(len(reader._infos), np.int64)  # shard -> (position in the window) - (global row)
    off[group] = np.concatenate([[0], np.cumsum(sizes)[:-1]]) - reader._starts[group]
    local = order + off[np.searchsorted(reader._starts, order, side="right") - 1]  # (k,)
    src = {n: _as_int16(cols[0][n] if len(cols) == 1 else np.concatenate([c[n] for c in cols]))
           for n in reader.block_names}
    return src, torch.from_numpy(np.ascontiguousarray(local))


def assemble(reader, segments: list[Segment], pin: bool) -> tuple[np.ndarray, dict[str, torch.Tensor]]:
    """One batch from its segments: each block gathered into one (optionally pinned) buffer, viewed as the
    store dtype and block shape. -> (rows (B,), {block: (B, *shape)})."""
    n = sum(len(idx) for _, idx, _ in segments)
    out = {}
    for name in reader.block_names:
        buf = torch.empty((n, reader._widths[name]), dtype=torch.int16, pin_memory=pin)  # (B, width)
        pos = 0
        for src, idx, _ in segments:
            torch.index_select(src[name], 0, idx, out=buf[pos:pos + len(idx)])
            pos += len(idx)
        out[name] = buf.view(reader.dtype).reshape(n, *reader.block_shapes[name])
    return np.concatenate([rows for _, _, rows in segments]), out


def gathered_batches(reader, batch_size: int, drop_last: bool, wins, pin: bool
                     ) -> Iterator[tuple[np.ndarray, dict[str, torch.Tensor]]]:
    """Batches of ``batch_size`` rows over the epoch's windows (a batch may span two windows), like
    ``TargetReader._produce``."""
    carry: list[Segment] = []
    have = 0
    for group, order in wins:
        src, local = window_sources(reader, group, order)
        i = 0
        while i < len(order):
            take = min(batch_size - have, len(order) - i)
            carry.append((src, local[i:i + take], order[i:i + take]))
            have, i = have + take, i + take
            if have == batch_size:
                yield assemble(reader, carry, pin)
                carry, have = [], 0
    if carry and not drop_last:
        yield assemble(reader, carry, pin)


class DeviceCopier:
    """Host-to-device copies of prefetched batches on a side CUDA stream (called from the prefetch thread);
    ``ready`` (in the consumer) makes the consumer's stream wait for that copy, without blocking the host."""

    def __init__(self, device: torch.device):
        self.device = device
        self.stream = torch.cuda.Stream(device=device)

    def send(self, batch: tuple[np.ndarray, dict[str, torch.Tensor]]):
        rows, tgt = batch
        with torch.cuda.stream(self.stream):
            out = {n: t.to(self.device, non_blocking=True) for n, t in tgt.items()}
            done = torch.cuda.Event()
            done.record(self.stream)
        return rows, out, done

    def ready(self, item) -> tuple[np.ndarray, dict[str, torch.Tensor]]:
        rows, out, done = item
        current = torch.cuda.current_stream(self.device)
        current.wait_event(done)
        for t in out.values():
            t.record_stream(current)  # the allocator must not reuse this memory before the consumer is done
        return rows, out
