"""How much a healed cell moves when the calibration images are another draw of the same size, against how much
it moves with the healing seed alone (the noise the report claims).

A sweep's calibration set of size n is the first n items of one fixed permutation of the calibration split (per
dataset and data seed; tasks/data/splits.py), so every retest (benchmarks/bench_retest.py: sampler seed, healing
seeds) reuses the same images. Here draw k is what a sweep with ``calib_seed: k`` heals on (the first n items of
tasks.data.redraw_calibration's order; draw 0: the data seed's order); each draw is healed with fixed
hyperparameters (``--lr``, ``--steps``) on ``--seeds`` healing seeds, then evaluated on the evaluation split.
Prints per draw the mean over seeds, then the within-draw standard deviation (healing seed), the standard deviation
of the draw means and its seed-noise-corrected part (one-way random-effects ANOVA: sigma_draw^2 = var(means) -
sigma_seed^2 / seeds, floored at 0), the ratio sigma_draw / sigma_seed and the range of draw means. CR+BN (closed
form) has no healing seed: its spread is the draws' alone.

    python benchmarks/bench_calib_draw.py --model vit_digits --sparsity 0.9 --calib 64 --lr 3e-3 --steps 32
"""
from __future__ import annotations

import argparse
import copy
import json
import math
import statistics
import time
from pathlib import Path

import torch

from tasks.data import redraw_calibration
from tasks.evaluate import accuracy
from tasks.healing import HEALERS, GradientHealer, HealConfig, HealContext, dense_targets, in_memory_batches, steps_per_epoch
from tasks.models import get_adapter, load_model
from tasks.pruning import apply_masks, make_masks, mask_violations


def heal_once(lm, masks, entries, images, targets, healer: str, cfg: HealConfig) -> float:
    """Evaluation accuracy of a fresh pruned copy healed by ``healer`` on ``images`` (rows of ``targets``)."""
    adapter = get_adapter(lm.model)
    model = copy.deepcopy(lm.model)
    apply_masks(model, masks)
    n = images.shape[0]
    ctx = HealContext(model, adapter.blocks(model), entries, masks, images,
                      in_memory_batches(targets, cfg.batch_size, cfg.seed), steps_per_epoch(n, cfg.batch_size),
                      adapter.default_granularity, dense_model=lambda: copy.deepcopy(lm.model))
    HEALERS.get(healer).heal(ctx, cfg)
    assert mask_violations(model, masks) == 0  # masks intact after healing
    ev = lm.dataset["evaluation"]
    return accuracy(model, ev.images, ev.labels)


def spread(acc: dict[int, list[float]]) -> dict:
    """One-way random-effects decomposition of {draw: [accuracy per seed]}."""
    means = [statistics.fmean(v) for v in acc.values()]
    k = min(len(v) for v in acc.values())
    within = statistics.fmean(statistics.variance(v) for v in acc.values()) if k > 1 else 0.0
    between = statistics.variance(means) if len(means) > 1 else 0.0
    draw_var = max(0.0, between - within / k)
    return {"draw_means": means, "sd_seed": math.sqrt(within), "sd_means": math.sqrt(between),
            "sd_draw": math.sqrt(draw_var), "range": max(means) - min(means),
            "ratio": math.sqrt(draw_var) / math.sqrt(within) if within > 0 else float("inf")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="vit_digits")
    ap.add_argument("--sparsity", type=float, default=0.9)
    ap.add_argument("--calib", type=int, default=64)
    ap.add_argument("--draws", type=int, default=6)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--healers", nargs="+", default=["starfish", "crbn"])
    ap.add_argument("--cache", default=".healsweep/models")
    ap.add_argument("--json", default="")
    a = ap.parse_args()
    torch.set_num_threads(1)
    lm = load_model(a.model, a.cache)
    adapter = get_adapter(lm.model)
    entries = adapter.scope(lm.model, adapter.default_scope)
    masks = make_masks(lm.model, entries, "magnitude", a.sparsity, seed=0)
    ev = lm.dataset["evaluation"]
    pruned = copy.deepcopy(lm.model)
    apply_masks(pruned, masks)
    print(f"model={a.model} magnitude {a.sparsity} calib {a.calib} of {len(lm.dataset['calibration'])}, lr {a.lr:g}, "
          f"{a.steps} steps, {a.seeds} healing seeds x {a.draws} draws; dense "
          f"{accuracy(lm.model, ev.images, ev.labels):.4f}, pruned {accuracy(pruned, ev.images, ev.labels):.4f}")
    out: dict = {"args": vars(a), "healers": {}}
    drawn = {}  # draw -> (its images (n, C, H, W), their dense targets): computed once, healed by every healer
    for d in range(a.draws):
        images = redraw_calibration(lm.dataset, d)["calibration"].images[: a.calib]
        drawn[d] = images, dense_targets(lm.model, adapter.blocks(lm.model), images)
    epochs = math.ceil(a.steps / steps_per_epoch(a.calib, HealConfig.batch_size))
    for healer in a.healers:
        closed = not isinstance(HEALERS.get(healer), GradientHealer)
        t0 = time.perf_counter()
        acc = {d: [heal_once(lm, masks, entries, images, targets, healer,
                             HealConfig(lr=a.lr, epochs=epochs, steps=a.steps, seed=s))
                   for s in range(1 if closed else a.seeds)] for d, (images, targets) in drawn.items()}
        s = spread(acc)
        out["healers"][healer] = {"acc": acc, **s}
        print(f"{healer:<10} draws " + " ".join(f"{m:.4f}" for m in s["draw_means"])
              + f" | sd seed {100 * s['sd_seed']:.2f} pp, sd of means {100 * s['sd_means']:.2f} pp, sd draw "
              f"{100 * s['sd_draw']:.2f} pp (x{s['ratio']:.2f} seed), range {100 * s['range']:.2f} pp "
              f"[{time.perf_counter() - t0:.0f} s]")
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
