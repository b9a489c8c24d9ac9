"""One epoch streamed from the target store with every column vs only the columns a healer reads.

A DeiT-B-shaped target set by default (12 blocks of 197 x 768 and 1,000 logits per row, float16: 3.63 MB a row;
random values, written once): ``kl``'s trial reads only the logits (2 KB a row), ``starfish``'s only the blocks.
Each reader streams the same shuffled epoch on the CPU path (prefetch thread, windowed shuffle); variants run
interleaved, median of repeats. Prints figures only.

    python benchmarks/bench_store_columns.py [--rows 256] [--blocks 12] [--tokens 197] [--width 768] [--repeats 5]
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from tasks.store import TargetStore


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--blocks", type=int, default=12)
    ap.add_argument("--tokens", type=int, default=197)
    ap.add_argument("--width", type=int, default=768)
    ap.add_argument("--classes", type=int, default=1000)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--shard-size", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5)
    a = ap.parse_args()
    shapes = {**{f"blocks.{i}": (a.tokens, a.width) for i in range(a.blocks)}, "logits": (a.classes,)}
    blocks = [n for n in shapes if n != "logits"]
    variants = {"every column": None, "blocks (starfish)": blocks, "logits (kl)": ["logits"]}
    with tempfile.TemporaryDirectory() as tmp:
        store, key = TargetStore(Path(tmp)), "0" * 32
        g = torch.Generator().manual_seed(0)
        infos = [store.write_shard(key, i, s, {n: torch.randn((e - s, *sh), generator=g).half()
                                                for n, sh in shapes.items()})
                 for i, s, e in store.shard_plan(a.rows, a.shard_size)]
        store.finalize(key, meta={}, block_shapes={n: list(s) for n, s in shapes.items()}, dtype="float16",
                       num_rows=a.rows, shard_infos=infos)
        readers = {v: store.open(key, verify=False, blocks=cols) for v, cols in variants.items()}
        times: dict[str, list[float]] = {v: [] for v in variants}
        mb = {v: sum(r._widths.values()) * 2 / 1e6 for v, r in readers.items()}  # MB a row handed out
        names = list(variants)
        for r in range(a.repeats + 1):  # round 0: warm-up (page cache)
            for v in names[r % len(names):] + names[: r % len(names)]:
                t = time.perf_counter()
                n = sum(len(rows) for rows, _ in readers[v].iter_batches(a.batch, shuffle=True, seed=0, epoch=r))
                assert n == a.rows
                if r:
                    times[v].append(time.perf_counter() - t)
        for rd in readers.values():
            rd.close()
    print(f"rows={a.rows} shapes: {a.blocks} x ({a.tokens}, {a.width}) + logits ({a.classes},) float16, batch={a.batch},"
          f" one epoch, CPU stream, median of {a.repeats} interleaved repeats")
    print(f"{'columns':<20}{'MB/row':>9}{'s/epoch':>10}{'rows/s':>10}{'vs every':>10}")
    base = statistics.median(times["every column"])
    for v in names:
        m = statistics.median(times[v])
        print(f"{v:<20}{mb[v]:>9.4f}{m:>10.3f}{a.rows / m:>10.0f}{m / base:>10.4f}")


if __name__ == "__main__":
    main()
