"""Healer ``crbn``: the CR+BN repair operator (tasks/pruning/repair.py) as a closed-form healer (no gradients).

It reports no epochs (no ``train_loss``); like every healer its trial logs ``heldout_align``, the STARFISH cosine
alignment loss on held-out calibration images, comparable across healers. lr/epochs of the search are ignored.

BN recalibration settings (docs/methods.md#relative-repairability-crbn-rr; defaults = the paper):
``bn_momentum`` (null: the module's own, 0.1; a float in (0, 1]; "cumulative"), ``bn_reset`` (false: start from
the dense statistics; true with bn_momentum null = the earlier reset + cumulative average), ``bn_batches`` 20,
``bn_batch_size`` 128, ``bn_source`` ("calib": batches drawn with replacement from the calibration images by a
seeded generator; "calib_once": each calibration image at most once, the earlier behaviour; "train": drawn from
the budget-matched unlabeled train images of ``HealContext.labeled``, labels unused).
"""
from __future__ import annotations

import time

import torch

from tasks.healing.base import HEALERS, HealConfig, HealContext, Healer, HealResult
from tasks.pruning.repair import BN_SOURCES, TAU_RULES, bn_state_names, check_finite, crbn_repair, has_batchnorm, scaled_bias_names


@HEALERS.register("crbn")
class CRBNHealer(Healer):
    settings_schema = {"tau": TAU_RULES, "no_bn": ("variance_match", "reject"), "bn_batches": int,
                       "bn_batch_size": int, "bn_momentum": object, "bn_reset": (False, True),
                       "bn_source": BN_SOURCES}
    uses_calibration = True  # CR's statistics and (bn_source calib) BN's batches come from the calibration images
    quick_settings = {"bn_batches": 2, "bn_batch_size": 8}  # the paper's 20 x 128 images: slow at 224 px on a CPU

    def check(self, settings):
        super().check(settings)
        for k in ("bn_batches", "bn_batch_size"):
            v = settings.get(k, 1)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"healer 'crbn' setting {k!r} must be a positive integer, got {v!r}")
        m = settings.get("bn_momentum")
        ok = m is None or m in ("module", "cumulative") or (
            isinstance(m, (int, float)) and not isinstance(m, bool) and 0 < m <= 1)
        if not ok:
            raise ValueError(f"healer 'crbn' setting 'bn_momentum' must be null, 'module', 'cumulative' or a "
                             f"number in (0, 1], got {m!r}")

    def resolved_settings(self, settings):
        reset = bool(settings.get("bn_reset", False))
        m = settings.get("bn_momentum")
        m = ("cumulative" if reset else "module") if m is None else (m if isinstance(m, str) else float(m))
        return {"tau": settings.get("tau", "median"), "no_bn": settings.get("no_bn", "variance_match"),
                "bn_batches": int(settings.get("bn_batches", 20)), "bn_batch_size": int(settings.get("bn_batch_size", 128)),
                "bn_momentum": m, "bn_reset": reset, "bn_source": settings.get("bn_source", "calib")}

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
        s = self.resolved_settings(cfg.settings)
        bn_images = None
        if s["bn_source"] == "train":
            if ctx.labeled is None:
                raise ValueError("healer 'crbn' bn_source='train' needs unlabeled train images (HealContext.labeled)")
            bn_images = ctx.labeled[0]
        t0 = time.perf_counter()
        dense = ctx.dense_model()
        gammas = crbn_repair(ctx.model, dense, ctx.entries, ctx.images, tau=s["tau"], bn_batches=s["bn_batches"],
                             bn_batch_size=s["bn_batch_size"],
                             bn_momentum=None if s["bn_momentum"] == "cumulative" else s["bn_momentum"],
                             bn_reset=s["bn_reset"], bn_source="train" if bn_images is not None else s["bn_source"],
                             bn_images=bn_images, seed=cfg.seed)
        check_finite(gammas)
        return HealResult([], time.perf_counter() - t0, 0)  # closed form: no epochs to report
