"""Per-epoch time of every gradient healer relative to ``starfish`` on the same cell (same mask, same data).

A reference model (shipped weights, tasks/models/weights), one magnitude mask, dense targets streamed from a target store
exactly as in a trial (each reader hands out only the columns its healer reads: ``kl`` the logits; ``kl`` / ``ce``
install no block hooks; ``ce`` iterates the labeled set, the first ``calib`` train items; "kl, every column" is kl
with a reader of every column, as before 2026-11-30). Healers run interleaved (the order rotates every repeat), one
epoch each on a fresh copy of the pruned model; the table shows medians. Prints figures only.

    python benchmarks/bench_healers.py [--model vit_digits] [--calib 256] [--repeats 5] [--cache DIR]
"""
from __future__ import annotations

import argparse
import copy
import statistics
import tempfile
import time
from pathlib import Path

import torch

from tasks.healing import HEALERS, GradientHealer, HealConfig, HealContext, dense_targets, steps_per_epoch
from tasks.models import get_adapter, load_model
from tasks.pruning import apply_masks, make_masks
from tasks.store import TargetStore


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="vit_digits")
    ap.add_argument("--calib", type=int, default=256)
    ap.add_argument("--sparsity", type=float, default=0.9)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--cache", default=".healsweep/models")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    names = [n for n in HEALERS.names() if isinstance(HEALERS.get(n), GradientHealer)]

    lm = load_model(a.model, a.cache)
    adapter = get_adapter(lm.model)
    images = lm.dataset["calibration"].images[: a.calib]
    train = lm.dataset["train"]
    labeled = (train.images[: a.calib], train.labels[: a.calib])
    targets = dense_targets(lm.model, adapter.blocks(lm.model), images)
    entries = adapter.scope(lm.model, adapter.default_scope)
    masks = make_masks(lm.model, entries, "magnitude", a.sparsity, seed=0)

    with tempfile.TemporaryDirectory() as tmp:
        store = TargetStore(Path(tmp))
        key = "0" * 32
        infos = [store.write_shard(key, i, s, {k: v[s:e] for k, v in targets.items()})
                 for i, s, e in store.shard_plan(a.calib, 64)]
        store.finalize(key, meta={}, block_shapes={k: list(v.shape[1:]) for k, v in targets.items()},
                       dtype="float16", num_rows=a.calib, shard_infos=infos)
        block_names = [b for b, _ in adapter.blocks(lm.model)]
        # Each healer's reader hands out only the columns it reads, as in a trial; "kl, every column" is kl as it
        # ran before 2026-11-30 (its reader streamed every block's outputs too).
        readers = {n: store.open(key, blocks=HEALERS.get(n).reads_targets(block_names, {}) or None) for n in names}
        readers["kl, every column"] = store.open(key)
        names.append("kl, every column")

        def one_epoch(label: str) -> float:
            model = copy.deepcopy(lm.model)
            apply_masks(model, masks)
            reader = readers[label]
            ctx = HealContext(model, adapter.blocks(model), entries, masks, images,
                              lambda e: reader.iter_batches(a.batch, shuffle=True, seed=0, epoch=e),
                              steps_per_epoch(a.calib, a.batch), adapter.default_granularity, labeled=labeled)
            t = time.perf_counter()
            HEALERS.get(label.split(",")[0]).heal(ctx, HealConfig(lr=1e-3, epochs=1, batch_size=a.batch))
            return time.perf_counter() - t

        for n in names:  # warm-up
            one_epoch(n)
        times: dict[str, list[float]] = {n: [] for n in names}
        for r in range(a.repeats):
            for n in names[r % len(names):] + names[: r % len(names)]:
                times[n].append(one_epoch(n))
        for reader in readers.values():
            reader.close()
    med = {n: statistics.median(t) for n, t in times.items()}
    print(f"model={a.model} sparsity={a.sparsity} calib={a.calib} batch={a.batch} threads={a.threads}, "
          f"one epoch, median of {a.repeats} interleaved repeats")
    print(f"{'healer':<18}{'s/epoch':>10}{'vs starfish':>13}{'min':>9}{'max':>9}")
    for n in names:
        print(f"{n:<18}{med[n]:>10.4f}{med[n] / med['starfish']:>13.3f}{min(times[n]):>9.4f}{max(times[n]):>9.4f}")


if __name__ == "__main__":
    main()
