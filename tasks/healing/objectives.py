"""The gradient healers (STARFISH and the objectives it is compared with) and ``none``.

Every gradient healer runs ``GradientHealer``'s loop (AdamW, cosine schedule, masking, NaN handling, per-epoch
reports); only the objective differs:

- ``starfish``:    cosine alignment of every block output with the dense model's (the method).
- ``mse``:         mean squared error to the same cached dense block outputs as STARFISH.
- ``kl``:          KL(dense || pruned) on logits (T = 1, batchmean); dense logits come from the target store's
                   pseudo-block ``tasks.healing.targets.LOGITS``. No block hooks are installed.
- ``ce``:          cross-entropy on labels, the fine-tuning baseline. Its labeled set is ``HealContext.labeled``:
                   the first calib_size items of the dataset's TRAIN split (budget-matched to the calibration
                   set; train is disjoint from calibration/selection/evaluation, and the calibration split is
                   unlabeled by contract). It iterates its own seeded batches of that set; no block hooks.
- ``starfish_kl``: w_align * cosine + w_kl * KL (0.5 / 0.5 by default; settings ``w_align``, ``w_kl``).
- ``none``:        the pruned model as is: no epochs, nothing changes.

Chains of healers: tasks/healing/chain.py.
"""
from __future__ import annotations

from typing import Iterator

import torch

from tasks.healing.base import HEALERS, HealContext, Healer, HealResult
from tasks.healing.loop import GradientHealer
from tasks.healing.losses import GRANULARITIES, ce_loss, cosine_align_loss, kl_logit_loss, mse_align_loss, weighted_sum
from tasks.healing.targets import LOGITS, take_rows

LABELED_SPLITS = ("train",)  # splits a supervised healer may train on (selection/evaluation never: docs/methods.md#data-splits)


@HEALERS.register("starfish")
class StarfishHealer(GradientHealer):
    """STARFISH: cosine alignment of every block output with the dense model's (the STARFISH paper)."""

    settings_schema = {**GradientHealer.settings_schema, "granularity": ("auto",) + GRANULARITIES}

    def resolved_settings(self, settings):
        return {**super().resolved_settings(settings), "granularity": settings.get("granularity", "auto")}

    def resolve(self, ctx, settings):
        g = settings.get("granularity", "auto")
        return {"granularity": ctx.default_granularity if g == "auto" else g}

    def loss(self, outputs, targets, settings):
        return cosine_align_loss(outputs, targets, settings["granularity"])


@HEALERS.register("mse")
class MSEHealer(GradientHealer):
    """MSE between every block output and the dense model's (the STARFISH paper, Table 1 ablation)."""


    def loss(self, outputs, targets, settings):
        return mse_align_loss(outputs, targets)


@HEALERS.register("kl")
class KLHealer(GradientHealer):
    """Logit distillation: KL(dense || pruned), T = 1, batchmean. Reads only the cached dense logits."""

    uses_blocks = False
    reads_logits = True

    def objective(self, blocks, logits, targets, block_names, settings):
        return kl_logit_loss(logits, targets[LOGITS].to(logits.device, non_blocking=True))  # (B, K) vs (B, K)


@HEALERS.register("ce")
class CEHealer(GradientHealer):
    """Cross-entropy fine-tuning on ``ctx.labeled`` (see the module docstring for which items)."""

    uses_blocks = False
    uses_calibration = False  # trains on labeled train images
    settings_schema = {**GradientHealer.settings_schema, "split": LABELED_SPLITS}

    def resolved_settings(self, settings):
        return {**super().resolved_settings(settings), "split": settings.get("split", "train")}

    def check_data(self, dataset, settings):
        split = settings.get("split", "train")
        if split not in dataset.splits:
            raise ValueError(f"healer 'ce' needs a labeled {split!r} split but dataset {dataset.name!r} has only "
                             f"{', '.join(dataset.splits)}")
        if len(dataset[split]) == 0:
            raise ValueError(f"healer 'ce' trains on labeled images of split {split!r}, and dataset {dataset.name!r} "
                             f"gives it none: set dataset.sizes.{split}")
        if dataset[split].labels is None:
            raise ValueError(f"healer 'ce' needs labels but split {split!r} of dataset {dataset.name!r} is unlabeled")

    def _labeled(self, ctx: HealContext) -> tuple[torch.Tensor, torch.Tensor]:
        if ctx.labeled is None:
            raise ValueError("healer 'ce' needs a labeled set (HealContext.labeled) and got none")
        return ctx.labeled

    def steps_per_epoch(self, ctx, cfg):
        return -(-len(self._labeled(ctx)[1]) // cfg.batch_size)

    def stream(self, ctx, cfg, epoch) -> Iterator[tuple[torch.Tensor, dict[str, torch.Tensor]]]:
        images, labels = self._labeled(ctx)  # (N, C, H, W), (N,)
        order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(cfg.seed * 100_003 + epoch))
        dev = next(ctx.model.parameters()).device
        for i in range(0, len(order), cfg.batch_size):
            rows = order[i : i + cfg.batch_size]
            yield take_rows(images, rows, dev), {"labels": take_rows(labels, rows, dev)}

    def objective(self, blocks, logits, targets, block_names, settings):
        return ce_loss(logits, targets["labels"].to(logits.device))


@HEALERS.register("starfish_kl")
class StarfishKLHealer(StarfishHealer):
    """w_align * STARFISH cosine + w_kl * KL(dense || pruned logits); 0.5 / 0.5 by default (docs/methods.md#starfish)."""

    settings_schema = {**StarfishHealer.settings_schema, "w_align": float, "w_kl": float}

    def check(self, settings):
        super().check(settings)
        w = [settings.get(k, 0.5) for k in ("w_align", "w_kl")]
        for k, v in zip(("w_align", "w_kl"), w):
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v >= 0 or v == float("inf"):
                raise ValueError(f"healer 'starfish_kl' setting {k!r} must be a finite number >= 0, got {v!r}")
        if not any(w):
            raise ValueError("healer 'starfish_kl' needs w_align or w_kl > 0, got both 0")

    @staticmethod
    def weights(settings) -> dict[str, float]:
        """{w_align, w_kl} with their 0.5 defaults."""
        return {k: float(settings.get(k, 0.5)) for k in ("w_align", "w_kl")}

    def resolved_settings(self, settings):
        return {**super().resolved_settings(settings), **self.weights(settings)}

    def resolve(self, ctx, settings):
        return {**super().resolve(ctx, settings), **self.weights(settings)}

    def reads_targets(self, block_names, settings):  # a term weighted 0 reads nothing
        w = self.weights(settings)
        return [*(block_names if w["w_align"] else []), *([LOGITS] if w["w_kl"] else [])]

    def objective(self, blocks, logits, targets, block_names, settings):
        dev = logits.device
        terms = []
        if settings["w_align"]:
            terms.append((settings["w_align"], cosine_align_loss(
                [blocks[b] for b in block_names], [targets[b].to(dev) for b in block_names], settings["granularity"])))
        if settings["w_kl"]:
            terms.append((settings["w_kl"], kl_logit_loss(logits, targets[LOGITS].to(dev))))
        return weighted_sum(terms)


@HEALERS.register("none")
class NoHealer(Healer):
    """The pruned model as is: no epochs, no steps, nothing changes (the lower bound of every paired table)."""


    def heal(self, ctx, cfg, on_epoch=None):
        return HealResult([], 0.0, 0)


# --- composition -------------------------------------------------------------------------------------------
