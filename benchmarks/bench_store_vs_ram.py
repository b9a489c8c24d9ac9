"""Heal-epoch read loop: memory-mapped TargetStore vs the same targets held in RAM.

Writes a synthetic float16 target set to a temporary store, then times, interleaved and repeated, one
shuffled epoch over all rows per method with a tiny amount of torch compute per batch (cosine similarity
of the batch against itself, per block). Both loops visit the same rows in the same order. Prints figures
only. The page cache is warm (the set was just written), so this measures decode/copy overhead, not disk.

    python benchmarks/bench_store_vs_ram.py --rows 2048 --blocks 6 --tokens 17 --dim 64
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from a source checkout
from tasks.store import TargetStore, content_key  # noqa: E402


def batch_compute(blocks: dict[str, torch.Tensor]) -> float:
    """Per block: (B, T, D) -> (B, T*D) float32 -> (B, B) cosine similarities; summed."""
    total = 0.0
    for x in blocks.values():
        xn = F.normalize(x.float().flatten(1), dim=1)  # (B, T*D)
        total += float((xn @ xn.T).sum())  # (B, B)
    return total


def epoch_store(reader, batch: int, epoch: int, compute: bool) -> float:
    acc = 0.0
    for _, blocks in reader.iter_batches(batch, shuffle=True, seed=0, epoch=epoch):
        acc += batch_compute(blocks) if compute else 0.0
    return acc


def epoch_ram(reader, ram: dict[str, torch.Tensor], batch: int, epoch: int, compute: bool) -> float:
    order = torch.from_numpy(reader.epoch_order(shuffle=True, seed=0, epoch=epoch))  # same rows, same order
    acc = 0.0
    for i in range(0, order.numel(), batch):
        idx = order[i:i + batch]
        blocks = {k: v[idx] for k, v in ram.items()}  # (B, T, D) gathered copies, like the store's
        acc += batch_compute(blocks) if compute else 0.0
    return acc


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=2048)
    ap.add_argument("--blocks", type=int, default=6)
    ap.add_argument("--tokens", type=int, default=17)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--shard-size", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()

    g = torch.Generator().manual_seed(0)
    data = {f"blocks.{b}": torch.randn(args.rows, args.tokens, args.dim, generator=g).half()
            for b in range(args.blocks)}
    with tempfile.TemporaryDirectory() as tmp:
        store = TargetStore(tmp)
        key = content_key({"bench": vars(args)})
        t0 = time.perf_counter()
        infos = [store.write_shard(key, i, a, {k: v[a:b] for k, v in data.items()})
                 for i, a, b in store.shard_plan(args.rows, args.shard_size)]
        store.finalize(key, meta={"bench": True}, block_shapes={k: list(v.shape[1:]) for k, v in data.items()},
                       dtype="float16", num_rows=args.rows, shard_infos=infos)
        t_write = time.perf_counter() - t0
        mib = sum(s["bytes"] for s in infos) / 2**20

        with store.open(key) as reader:
            t0 = time.perf_counter()
            ram = reader.load_all()
            t_load = time.perf_counter() - t0
            assert all(torch.equal(ram[k].view(torch.int16), data[k].view(torch.int16)) for k in data)
            times: dict[tuple[str, bool], list[float]] = {}
            for _ in range(args.repeats):  # interleaved: store, RAM, store, RAM, ...
                for compute in (True, False):
                    for name in ("store", "ram"):
                        t0 = time.perf_counter()
                        for e in range(args.epochs):
                            if name == "store":
                                epoch_store(reader, args.batch, e, compute)
                            else:
                                epoch_ram(reader, ram, args.batch, e, compute)
                        times.setdefault((name, compute), []).append((time.perf_counter() - t0) / args.epochs)

    print(f"rows={args.rows} blocks={args.blocks} per-row shape=({args.tokens}, {args.dim}) float16 "
          f"batch={args.batch} shard_size={args.shard_size} epochs={args.epochs} repeats={args.repeats} "
          f"torch_threads={torch.get_num_threads()}")
    print(f"store: {len(infos)} shards, {mib:.1f} MiB on disk; write {t_write:.3f} s; load_all {t_load:.3f} s")
    print(f"{'loop':<22}{'store s/epoch':>15}{'RAM s/epoch':>14}{'store/RAM':>11}")
    for compute, label in ((True, "heal loop (read+cos)"), (False, "read only")):
        s = statistics.median(times[("store", compute)])
        r = statistics.median(times[("ram", compute)])
        print(f"{label:<22}{s:>15.4f}{r:>14.4f}{s / r:>11.2f}")


if __name__ == "__main__":
    main()
