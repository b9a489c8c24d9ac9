"""Pruning: mask generators and allocation rules, registered by name in ``PRUNERS``, and the helpers that apply
masks. Each method is one module that registers its class with ``@PRUNERS.register(name)``; this package face
imports every one of them, so ``from tasks.pruning import PRUNERS`` sees the full registry."""
from tasks.pruning import allocation, corp, magnitude, snapvit  # noqa: F401 - register the pruners
from tasks.pruning.base import (PRUNERS, PruneContext, Pruner, achieved_sparsity, apply_masks, expand_masks, make_masks,
                                mask_digest, mask_violations, region, train_masks)
from tasks.pruning.allocation_math import n_pruned
from tasks.store.masks import MaskStore  # the mask files live beside the target store (no torch to check one)

__all__ = ["PRUNERS", "PruneContext", "Pruner", "achieved_sparsity", "apply_masks", "expand_masks", "make_masks",
           "mask_digest", "mask_violations", "n_pruned", "region", "train_masks", "MaskStore"]
