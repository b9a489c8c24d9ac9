"""Healers beyond STARFISH (SPEC §3 objectives) and healer composition.

Every gradient healer runs ``GradientHealer``'s loop (AdamW, cosine schedule, masking, NaN handling, per-epoch
reports); only the objective differs:

- ``mse``:         mean squared error to the same cached dense block outputs as STARFISH.
- ``kl``:          KL(dense || pruned) on logits (T = 1, batchmean); dense logits come from the target store's
                   pseudo-block ``tasks.targets.LOGITS``. No block hooks are installed.
- ``ce``:          cross-entropy on labels, the fine-tuning baseline. Its labeled set is ``HealContext.labeled``:
                   the first calib_size items of the dataset's TRAIN split (budget-matched to the calibration
                   set; train is disjoint from calibration/selection/evaluation, and the calibration split is
                   unlabeled by contract). It iterates its own seeded batches of that set; no block hooks.
- ``starfish_kl``: w_align * cosine + w_kl * KL (0.5 / 0.5 by default; settings ``w_align``, ``w_kl``).
- ``none``:        the pruned model as is: no epochs, nothing changes.

Composition: ``ComposedHealer`` runs registered healers in order on the same masked model; its name is the
parts' names joined by ``+`` (e.g. ``corp+starfish``). Each gradient part gets the trial's lr and epochs.
"""
from __future__ import annotations

import time
from dataclasses import replace
from typing import Any, Iterator, Mapping, Sequence

import torch

from tasks.heal import (HEALERS, EpochCallback, GradientHealer, Healer, HealConfig, HealContext, HealResult,
                        StarfishHealer)
from tasks.losses import ce_loss, cosine_align_loss, kl_logit_loss, mse_align_loss, weighted_sum
from tasks.targets import LOGITS

LABELED_SPLITS = ("train",)  # splits a supervised healer may train on (selection/evaluation never: SPEC §1)


class MseHealer(GradientHealer):
    """MSE between every block output and the dense model's (paper 000, Table 1 ablation)."""

    name = "mse"

    def loss(self, outputs, targets, settings):
        return mse_align_loss(outputs, targets)


class KlHealer(GradientHealer):
    """Logit distillation: KL(dense || pruned), T = 1, batchmean. Reads only the cached dense logits."""

    name = "kl"
    uses_blocks = False

    def objective(self, blocks, logits, targets, block_names, settings):
        return kl_logit_loss(logits, targets[LOGITS].to(logits.device, non_blocking=True))  # (B, K) vs (B, K)


class CeHealer(GradientHealer):
    """Cross-entropy fine-tuning on ``ctx.labeled`` (see the module docstring for which items)."""

    name = "ce"
    uses_blocks = False
    settings_schema = {"split": LABELED_SPLITS}

    def check_data(self, dataset, settings):
        split = settings.get("split", "train")
        if split not in dataset.splits:
            raise ValueError(f"healer 'ce' needs a labeled {split!r} split but dataset {dataset.name!r} has only "
                             f"{', '.join(dataset.splits)}")
        if dataset[split].labels is None or len(dataset[split]) == 0:
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
        for i in range(0, len(order), cfg.batch_size):
            rows = order[i : i + cfg.batch_size]
            yield images[rows], {"labels": labels[rows]}

    def objective(self, blocks, logits, targets, block_names, settings):
        return ce_loss(logits, targets["labels"].to(logits.device))


class StarfishKlHealer(StarfishHealer):
    """w_align * STARFISH cosine + w_kl * KL(dense || pruned logits); 0.5 / 0.5 by default (SPEC §3)."""

    name = "starfish_kl"
    settings_schema = {**StarfishHealer.settings_schema, "w_align": float, "w_kl": float}

    def check(self, settings):
        super().check(settings)
        w = [settings.get(k, 0.5) for k in ("w_align", "w_kl")]
        for k, v in zip(("w_align", "w_kl"), w):
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v >= 0 or v == float("inf"):
                raise ValueError(f"healer 'starfish_kl' setting {k!r} must be a finite number >= 0, got {v!r}")
        if not any(w):
            raise ValueError("healer 'starfish_kl' needs w_align or w_kl > 0, got both 0")

    def resolve(self, ctx, settings):
        return {**super().resolve(ctx, settings), "w_align": float(settings.get("w_align", 0.5)),
                "w_kl": float(settings.get("w_kl", 0.5))}

    def objective(self, blocks, logits, targets, block_names, settings):
        dev = logits.device
        terms = []
        if settings["w_align"]:
            terms.append((settings["w_align"], cosine_align_loss(
                [blocks[b] for b in block_names], [targets[b].to(dev) for b in block_names], settings["granularity"])))
        if settings["w_kl"]:
            terms.append((settings["w_kl"], kl_logit_loss(logits, targets[LOGITS].to(dev))))
        return weighted_sum(terms)


class NoHealer(Healer):
    """The pruned model as is: no epochs, no steps, nothing changes (the lower bound of every paired table)."""

    name = "none"

    def heal(self, ctx, cfg, on_epoch=None):
        return HealResult([], 0.0, 0)


for _h in (MseHealer(), KlHealer(), CeHealer(), StarfishKlHealer(), NoHealer()):
    HEALERS.register(_h.name)(_h)


# --- composition -------------------------------------------------------------------------------------------

CHAIN_SEP = "+"


def chain_name(names: Sequence[str]) -> str:
    return CHAIN_SEP.join(names)


class ComposedHealer(Healer):
    """Registered healers run in order on the same masked model. Built from a spec entry's ``steps`` setting:
    ``[{"name": ..., "settings": {...}}, ...]``; every gradient part gets the trial's lr and epochs, and epoch
    reports continue counting across parts (part 2's epoch 1 is reported as epochs(part 1) + 1)."""

    def __init__(self, steps: Sequence[Mapping[str, Any]]) -> None:
        if len(steps) < 2:
            raise ValueError(f"a healer chain needs at least 2 steps, got {len(steps)}")
        self.parts: list[tuple[Healer, dict]] = []
        for i, st in enumerate(steps):
            try:
                part = HEALERS.get(st["name"])
            except KeyError as e:
                raise ValueError(f"chain[{i}]: {e.args[0]}") from None
            self.parts.append((part, dict(st.get("settings") or {})))
        self.name = chain_name([p.name for p, _ in self.parts])
        self.trains = any(p.trains for p, _ in self.parts)

    def _each(self, fn):
        for i, (part, settings) in enumerate(self.parts):
            try:
                fn(part, settings)
            except ValueError as e:
                raise ValueError(f"chain[{i}] ({part.name!r}): {e}") from None

    def check(self, settings):
        if set(settings) - {"steps"}:
            raise ValueError(f"a healer chain takes no settings of its own; set them per step, got {sorted(settings)}")
        self._each(lambda part, s: part.check(s))

    def check_cell(self, model, adapter, pruner, pruner_settings, settings):
        self._each(lambda part, s: part.check_cell(model, adapter, pruner, pruner_settings, s))

    def check_data(self, dataset, settings):
        self._each(lambda part, s: part.check_data(dataset, s))

    def may_change(self, model, entries):
        return set().union(*(part.may_change(model, entries) for part, _ in self.parts))

    def epochs(self, cfg):
        return sum(part.epochs(replace(cfg, settings=s)) for part, s in self.parts)

    def heal(self, ctx: HealContext, cfg: HealConfig, on_epoch: EpochCallback | None = None) -> HealResult:
        t0, losses, steps, offset = time.perf_counter(), [], 0, 0
        for part, settings in self.parts:
            pcfg = replace(cfg, settings=settings)
            cb = None if on_epoch is None else (lambda e, m, o=offset: on_epoch(o + e, m))
            res = part.heal(ctx, pcfg, cb)
            losses += res.epoch_losses
            steps += res.steps
            offset += part.epochs(pcfg)
        return HealResult(losses, time.perf_counter() - t0, steps)


def resolve_healer(name: str, settings: Mapping[str, Any] | None = None) -> Healer:
    """A registered healer, or the composition a spec entry describes (name ``a+b`` with settings {"steps": ...})."""
    settings = settings or {}
    if name in HEALERS:
        return HEALERS.get(name)
    if "steps" in settings:
        h = ComposedHealer(settings["steps"])
        if h.name != name:
            raise ValueError(f"healer chain name {name!r} does not match its steps ({h.name!r})")
        return h
    return HEALERS.get(name)  # raises the registry's "unknown healer" error
