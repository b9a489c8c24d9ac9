"""Authors' defaults vs the project's earlier behaviour for the closed-form methods (issue 12), on the cached
digits reference models. Prints evaluation top-1 (%).

- CR+BN on resnet_digits (scope conv, magnitude `uniform` and `global` at 0.9): paper recalibration (momentum 0.1,
  no reset, 20 × 128 seeded draws) vs the earlier reset + cumulative average over the calibration images once.
- CORP on vit_digits (scope mlp_qk, corp masks at 0.5 / 0.75): lambda authors vs oas.
- SnapViT on vit_digits (scope qkv_out_mlp, 0.3 / 0.5, no healing): variant authors vs joint.

    python benchmarks/bench_method_defaults.py [--calib 128]
"""
from __future__ import annotations

import argparse
import copy

import torch

from tasks.evaluate import accuracy
from tasks.healing import HEALERS, HealConfig, HealContext
from tasks.models import get_adapter, load_model
from tasks.pruning import PruneContext, apply_masks, make_masks
from tasks.pruning.repair import crbn_repair, recalibrate_bn

EARLIER_CRBN = {"bn_momentum": None, "bn_reset": True, "bn_source": "calib_once"}


def _acc(model, lm) -> float:
    ev = lm.dataset["evaluation"]
    return 100 * accuracy(model, ev.images, ev.labels)


def crbn_rows(a) -> None:
    lm = load_model("resnet_digits", a.cache)
    cal = lm.dataset["calibration"].images[: a.calib]
    entries = get_adapter(lm.model).scope(lm.model, "conv")
    for pruner in ("uniform", "global"):
        base = copy.deepcopy(lm.model)
        apply_masks(base, make_masks(base, entries, pruner, 0.9, seed=0))
        row = [f"{_acc(base, lm):5.1f}"]
        for kw in ({}, EARLIER_CRBN):
            m, bn_only = copy.deepcopy(base), copy.deepcopy(base)
            crbn_repair(m, lm.model, entries, cal, **kw)
            recalibrate_bn(bn_only, cal, 20, 128, momentum=kw.get("bn_momentum", "module"),
                           reset=kw.get("bn_reset", False), source=kw.get("bn_source", "calib"))
            row.append(f"{_acc(m, lm):5.1f} (γ = 1: {_acc(bn_only, lm):5.1f})")
        print(f"crbn resnet_digits {pruner:>7} 0.9 calib {a.calib}: pruned {row[0]} | paper recal {row[1]} | "
              f"earlier {row[2]}")


def corp_rows(a) -> None:
    lm = load_model("vit_digits", a.cache)
    ad = get_adapter(lm.model)
    cal = lm.dataset["calibration"].images[: a.calib]
    entries = ad.scope(lm.model, "mlp_qk")
    for s in (0.5, 0.75):
        masks = make_masks(lm.model, entries, "corp", s, seed=0, ctx=PruneContext(lm.model, ad, entries, calib_images=cal))
        out = []
        for lam in ("authors", "oas"):
            m = copy.deepcopy(lm.model)
            apply_masks(m, masks)
            ctx = HealContext(m, ad.blocks(m), entries, masks, cal, lambda e: iter(()), 0, "token",
                              dense_model=lambda: copy.deepcopy(lm.model))
            HEALERS.get("corp").heal(ctx, HealConfig(settings={"lambda": lam}))
            out.append(f"{_acc(m, lm):5.1f}")
        print(f"corp vit_digits mlp_qk {s}: lambda authors {out[0]} | oas {out[1]}")


def snapvit_rows(a) -> None:
    lm = load_model("vit_digits", a.cache)
    ad = get_adapter(lm.model)
    cal = lm.dataset["calibration"].images[: a.calib]
    entries = ad.scope(lm.model, "qkv_out_mlp")
    ctx = PruneContext(lm.model, ad, entries, calib_images=cal)
    for s in (0.3, 0.5):
        out = []
        for variant in ("authors", "joint"):
            m = copy.deepcopy(lm.model)
            apply_masks(m, make_masks(m, entries, "snapvit", s, seed=0, settings={"variant": variant}, ctx=ctx))
            out.append(f"{_acc(m, lm):5.1f}")
        print(f"snapvit vit_digits qkv_out_mlp {s} (pruned, no healing): authors {out[0]} | joint {out[1]}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calib", type=int, default=128)
    ap.add_argument("--only", choices=["crbn", "corp", "snapvit"], default=None)
    ap.add_argument("--cache", default=".healsweep/models")
    a = ap.parse_args()
    torch.set_num_threads(1)
    for name, fn in (("crbn", crbn_rows), ("corp", corp_rows), ("snapvit", snapvit_rows)):
        if a.only in (None, name):
            fn(a)


if __name__ == "__main__":
    main()
