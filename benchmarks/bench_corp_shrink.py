"""Dense vs physically shrunk CORP ViT: params, FLOPs, p50 latency, throughput, speedup (issue 3, item 2).

    python benchmarks/bench_corp_shrink.py [--cache DIR] [--batch 64] [--threads 1] [--device cpu]

Uses the embedded vit_digits reference model (shipped weights, tasks/models/weights). Masks: CORP activation ranking on
256 calibration images, scope mlp / qk / mlp_qk, s in {0.25, 0.5}; compensation (healer corp) folded in
before the shrink, whose outputs are checked against the masked model (max |diff|).
"""
from __future__ import annotations

import argparse
import copy
from pathlib import Path

import torch

from tasks.healing import HEALERS, HealConfig, HealContext, dense_targets, in_memory_batches, steps_per_epoch
from tasks.models import get_adapter, load_model
from tasks.pruning import PruneContext, apply_masks, make_masks
from tasks.pruning.shrink import efficiency_metrics


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cache", default=str(Path(__file__).resolve().parents[1] / ".healsweep" / "models"))
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    lm = load_model("vit_digits", args.cache, progress=True)
    dense = lm.model.to(args.device)
    ad = get_adapter(dense)
    cal = lm.dataset["calibration"].images[:256]
    example = lm.dataset["evaluation"].images[: args.batch].to(args.device)
    tg = dense_targets(dense, ad.blocks(dense), cal)
    print(f"vit_digits, batch {args.batch}, {args.threads} thread(s), device {args.device}, p50 of {args.repeats}")
    print(f"{'scope':7} {'s':>5} {'params':>17} {'MFLOPs':>15} {'latency ms':>15} {'img/s':>15} {'speedup':>8} {'max|diff|':>9}")
    for scope in ("mlp", "qk", "mlp_qk"):
        for s in (0.25, 0.5):
            model = copy.deepcopy(dense)
            e = ad.scope(model, scope)
            masks = make_masks(model, e, "corp", s, seed=0, ctx=PruneContext(model, ad, e, calib_images=cal))
            apply_masks(model, masks)
            ctx = HealContext(model, ad.blocks(model), e, masks, cal, in_memory_batches(tg, 64, 0),
                              steps_per_epoch(len(cal), 64), "token", dense_model=lambda: copy.deepcopy(dense))
            HEALERS.get("corp").heal(ctx, HealConfig())
            m = efficiency_metrics(model, masks, example, repeats=args.repeats)
            print(f"{scope:7} {s:5.2f} {int(m['dense_params']):>8}->{int(m['shrunk_params']):<8}"
                  f" {m['dense_flops'] / 1e6:7.1f}->{m['shrunk_flops'] / 1e6:<7.1f}"
                  f" {m['dense_latency_ms']:7.2f}->{m['shrunk_latency_ms']:<7.2f}"
                  f" {m['dense_throughput']:7.0f}->{m['shrunk_throughput']:<7.0f} {m['speedup']:8.2f}"
                  f" {m['shrink_max_abs_diff']:9.1e}")


if __name__ == "__main__":
    main()
