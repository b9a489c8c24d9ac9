"""Bytes on disk and full-read throughput: the store's Arrow IPC shards vs Parquet for the same targets.

Synthetic float16 targets (random normal, the hard case for compression) shaped like ViT blocks. Parquet
is written with the same FixedSizeList<uint16> columns, uncompressed / snappy / zstd. Reads decode every
row into numpy (page cache warm). Prints figures only.

    python benchmarks/bench_store_formats.py [--rows 256 --blocks 12 --tokens 197 --dim 192]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.ipc as ipc
import pyarrow.parquet as pq
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tasks.store import TargetStore, content_key  # noqa: E402


def _read_ipc(path: Path) -> int:
    with pa.memory_map(str(path)) as f:
        t = ipc.open_file(f).read_all()
        return sum(np.array(c.combine_chunks().flatten()).nbytes for c in t.columns)  # copy out of the map


def _read_parquet(path: Path) -> int:
    t = pq.read_table(path)
    return sum(np.asarray(c.combine_chunks().flatten()).nbytes for c in t.columns)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--blocks", type=int, default=12)
    ap.add_argument("--tokens", type=int, default=197)
    ap.add_argument("--dim", type=int, default=192)
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()
    g = torch.Generator().manual_seed(0)
    data = {f"blocks.{b}": torch.randn(a.rows, a.tokens, a.dim, generator=g).half() for b in range(a.blocks)}
    raw = sum(v.numel() * 2 for v in data.values())
    with tempfile.TemporaryDirectory() as tmp:
        st = TargetStore(Path(tmp) / "store")
        key = content_key("formats")
        info = st.write_shard(key, 0, 0, data)
        ipc_path = st.key_dir(key) / info["file"]
        with pa.memory_map(str(ipc_path)) as f:
            table = ipc.open_file(f).read_all()
            variants = {"arrow-ipc (store)": (ipc_path, _read_ipc)}
            for comp in ("none", "snappy", "zstd"):
                p = Path(tmp) / f"t-{comp}.parquet"
                pq.write_table(table, p, compression=comp)
                variants[f"parquet {comp}"] = (p, _read_parquet)
        print(f"rows={a.rows} blocks={a.blocks} per-row=({a.tokens}, {a.dim}) float16 random normal; "
              f"raw {raw / 1e6:.1f} MB; median of {a.repeats} warm reads")
        print(f"{'format':<20}{'MB on disk':>11}{'vs raw':>8}{'read GB/s':>11}")
        for name, (p, fn) in variants.items():
            ts = []
            for _ in range(a.repeats):
                t = time.perf_counter()
                assert fn(p) == raw
                ts.append(time.perf_counter() - t)
            size = p.stat().st_size
            print(f"{name:<20}{size / 1e6:>11.1f}{size / raw:>8.3f}{raw / statistics.median(ts) / 1e9:>11.2f}")


if __name__ == "__main__":
    main()
