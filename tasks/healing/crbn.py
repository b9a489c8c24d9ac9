"""Healer ``crbn``: the CR+BN repair operator (tasks/repair.py) as a closed-form healer (no gradients).

It reports one "epoch": ``align_loss`` is the STARFISH cosine alignment loss of the repaired model's block
outputs against the dense targets (one pass over the calibration targets), so it is comparable to the gradient
healers' losses. lr/epochs of the search are ignored.
"""
from __future__ import annotations

import time

import torch

from tasks.healing.base import HEALERS, HealConfig, HealContext, Healer, HealResult
from tasks.pruning.repair import TAU_RULES, bn_state_names, check_finite, crbn_repair, has_batchnorm, scaled_bias_names


@HEALERS.register("crbn")
class CRBNHealer(Healer):
    settings_schema = {"tau": TAU_RULES, "no_bn": ("variance_match", "reject"), "bn_batches": int,
                       "bn_batch_size": int}

    def check(self, settings):
        super().check(settings)
        for k in ("bn_batches", "bn_batch_size"):
            v = settings.get(k, 1)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"healer 'crbn' setting {k!r} must be a positive integer, got {v!r}")

    def may_change(self, model, entries, settings=None):
        return bn_state_names(model) | scaled_bias_names(model, entries)

    def check_cell(self, model, adapter, pruner, pruner_settings, settings):
        if any(isinstance(m, torch.nn.MultiheadAttention) for m in model.modules()):
            raise ValueError(f"{type(model).__name__} ({adapter.family}) uses fused nn.MultiheadAttention "
                             f"projections whose outputs CR+BN cannot observe")
        if settings.get("no_bn", "variance_match") == "reject" and not has_batchnorm(model):
            raise ValueError(f"{type(model).__name__} ({adapter.family}) has no BatchNorm to recalibrate and "
                             f"healer 'crbn' has no_bn='reject' (use no_bn='variance_match' for the "
                             f"per-output-feature operator)")

    def heal(self, ctx: HealContext, cfg: HealConfig, on_epoch=None) -> HealResult:
        if ctx.dense_model is None:
            raise ValueError("healer 'crbn' needs the dense model (HealContext.dense_model)")
        s = cfg.settings
        t0 = time.perf_counter()
        dense = ctx.dense_model()
        gammas = crbn_repair(ctx.model, dense, ctx.entries, ctx.images, tau=s.get("tau", "median"),
                             bn_batches=s.get("bn_batches", 20), bn_batch_size=s.get("bn_batch_size", 128))
        check_finite(gammas)
        return HealResult([], time.perf_counter() - t0, 0)  # closed form: no epochs to report
