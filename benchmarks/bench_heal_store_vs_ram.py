"""Heal epoch streaming targets from the store vs the same targets held in RAM (goal: ratio <= 1.05).

Real STARFISH epochs on a reference model (shipped weights, tasks/models/weights) at one sparsity; both variants visit
the same rows in the same order (the store's seeded epoch order), side by side and interleaved, median of
repeats. Prints figures only.

    python benchmarks/bench_heal_store_vs_ram.py [--model vit_digits] [--calib 320] [--repeats 5]
"""
from __future__ import annotations

import argparse
import copy
import statistics
import tempfile
import time
from pathlib import Path

import torch

from tasks.healing import HEALERS, HealConfig, HealContext, dense_targets, in_memory_batches, steps_per_epoch
from tasks.models import get_adapter, load_model
from tasks.pruning import apply_masks, make_masks
from tasks.store import TargetStore


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="vit_digits")
    ap.add_argument("--calib", type=int, default=320)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--shard-size", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--cache", default=".healsweep/models")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)

    lm = load_model(a.model, a.cache)
    adapter = get_adapter(lm.model)
    blocks = adapter.blocks(lm.model)
    images = lm.dataset["calibration"].images[: a.calib]
    targets = dense_targets(lm.model, blocks, images)
    entries = adapter.scope(lm.model, adapter.default_scope)
    masks = make_masks(lm.model, entries, "magnitude", 0.9, seed=0)

    with tempfile.TemporaryDirectory() as tmp:
        store = TargetStore(Path(tmp))
        key = "0" * 32
        infos = [store.write_shard(key, i, s, {k: v[s:e] for k, v in targets.items()})
                 for i, s, e in store.shard_plan(a.calib, a.shard_size)]
        store.finalize(key, meta={}, block_shapes={k: list(v.shape[1:]) for k, v in targets.items()},
                       dtype="float16", num_rows=a.calib, shard_infos=infos)
        reader = store.open(key)
        in_ram = reader.load_all()

        def store_batches(epoch):
            return reader.iter_batches(a.batch, shuffle=True, seed=0, epoch=epoch)

        # the same targets in RAM, visited in the store's row order
        ram_batches = in_memory_batches(in_ram, a.batch, 0,
                                        order=lambda epoch: reader.epoch_order(shuffle=True, seed=0, epoch=epoch))

        def one_epoch(batches) -> float:
            model = copy.deepcopy(lm.model)
            apply_masks(model, masks)
            ctx = HealContext(model, adapter.blocks(model), entries, masks, images, batches,
                              steps_per_epoch(a.calib, a.batch), adapter.default_granularity)
            t = time.perf_counter()
            HEALERS.get("starfish").heal(ctx, HealConfig(lr=1e-3, epochs=1, batch_size=a.batch))
            return time.perf_counter() - t

        one_epoch(ram_batches), one_epoch(store_batches)  # warm-up
        t_store, t_ram = [], []
        for _ in range(a.repeats):
            t_store.append(one_epoch(store_batches))
            t_ram.append(one_epoch(ram_batches))
        reader.close()
    s, r = statistics.median(t_store), statistics.median(t_ram)
    print(f"model={a.model} calib={a.calib} batch={a.batch} shards of {a.shard_size} rows, threads={a.threads}, "
          f"median of {a.repeats}")
    print(f"{'variant':<10}{'s/epoch':>10}")
    print(f"{'store':<10}{s:>10.4f}\n{'RAM':<10}{r:>10.4f}")
    print(f"store/RAM ratio: {s / r:.3f}  (goal <= 1.05)")


if __name__ == "__main__":
    main()
