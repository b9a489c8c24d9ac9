"""STARFISH with train-mode BatchNorm (``bn: train``, the authors) vs eval-mode (``bn: frozen``, the project's
earlier loop), on real reference models (docs/methods.md#starfish).

Setting of issue 12: magnitude masks, scope ``conv`` (ResNet) / the adapter's default scope (ViT), 128
calibration images, lr 2e-3, 6 epochs, batch 32, heal seeds 0, 1, 2. Prints evaluation top-1 (%) per sparsity,
mean ± sd over seeds. Reference (the authors' loop on resnet_digits): 97.5 / 91.1 / 17.0 at 0.7 / 0.8 / 0.9.

    python benchmarks/bench_starfish_bn.py [--model resnet_digits] [--sparsities 0.7 0.8 0.9]
"""
from __future__ import annotations

import argparse
import copy
import statistics

import torch

from tasks.evaluate import accuracy
from tasks.healing import HEALERS, HealConfig, HealContext, dense_targets, in_memory_batches, steps_per_epoch
from tasks.models import get_adapter, load_model
from tasks.pruning import apply_masks, make_masks


def heal_once(lm, scope, sparsity, seed, bn, a) -> float:
    model = copy.deepcopy(lm.model)
    adapter = get_adapter(model)
    blocks = adapter.blocks(model)
    images = lm.dataset["calibration"].images[: a.calib]
    targets = dense_targets(model, blocks, images)  # dense, eval mode
    entries = adapter.scope(model, scope)
    masks = make_masks(model, entries, "magnitude", sparsity, seed=0)
    apply_masks(model, masks)
    ctx = HealContext(model=model, blocks=blocks, entries=entries, masks=masks, images=images,
                      batches=in_memory_batches(targets, a.batch, seed), steps_per_epoch=steps_per_epoch(len(images), a.batch),
                      default_granularity=adapter.default_granularity)
    HEALERS.get("starfish").heal(ctx, HealConfig(lr=a.lr, epochs=a.epochs, batch_size=a.batch, seed=seed,
                                                 settings={"bn": bn}))
    ev = lm.dataset["evaluation"]
    return 100 * accuracy(model, ev.images, ev.labels)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="resnet_digits")
    ap.add_argument("--scope", default=None, help="default: conv for CNNs, the adapter's default scope otherwise")
    ap.add_argument("--sparsities", type=float, nargs="+", default=[0.7, 0.8, 0.9])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--calib", type=int, default=128)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--epochs", type=int, default=6)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--cache", default=".healsweep/models")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    lm = load_model(a.model, a.cache)
    adapter = get_adapter(lm.model)
    scope = a.scope or ("conv" if "conv" in adapter.scopes else adapter.default_scope)
    ev = lm.dataset["evaluation"]
    print(f"{a.model} scope={scope} calib={a.calib} lr={a.lr:g} epochs={a.epochs} batch={a.batch} "
          f"seeds={a.seeds}; dense top-1 {100 * accuracy(lm.model, ev.images, ev.labels):.1f} %")
    print(f"{'sparsity':>8} | {'bn=train':>14} | {'bn=frozen':>14} | per-seed train / frozen")
    for s in a.sparsities:
        res = {bn: [heal_once(lm, scope, s, seed, bn, a) for seed in a.seeds] for bn in ("train", "frozen")}
        cells = [f"{statistics.mean(v):6.1f} ± {statistics.pstdev(v):4.1f}" for v in res.values()]
        print(f"{s:>8} | {cells[0]:>14} | {cells[1]:>14} | "
              f"{' '.join(f'{x:.1f}' for x in res['train'])} / {' '.join(f'{x:.1f}' for x in res['frozen'])}")


if __name__ == "__main__":
    main()
