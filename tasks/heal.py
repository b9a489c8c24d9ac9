"""Healers (SPEC §3), registered by name, and the one gradient training loop they share.

A gradient healer is an objective plus the shared loop: AdamW over the prunable tensors only, a per-step
cosine schedule from lr to lr_min, gradients of masked and out-of-region entries zeroed, and after every
step every entry a healer may not change is restored (masked entries stay exactly 0; the rest of the model is
frozen with requires_grad=False). BatchNorm/Dropout run in eval mode so no buffer outside the scope changes.
The per-epoch report key ``align_loss`` is the healer's own training objective (cosine, MSE, KL, CE, ...).
Healers other than STARFISH and chains of healers: tasks/healers.py.
"""
from __future__ import annotations

import math
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator, Mapping

import torch
import torch.nn as nn

from tasks._registry import Registry
from tasks.adapters import ScopeEntry
from tasks.losses import GRANULARITIES, cosine_align_loss
from tasks.pruners import train_masks
from tasks.targets import block_tap

Batches = Callable[[int], Iterable[tuple[Any, dict[str, torch.Tensor]]]]  # epoch -> (rows, {block: targets})


class HealingDiverged(RuntimeError):
    """The healing loss became NaN or Inf; the weights are left as they were before that step."""


@dataclass(frozen=True)
class HealConfig:
    lr: float = 6e-4
    epochs: int = 10
    batch_size: int = 32
    weight_decay: float = 0.0
    lr_min: float = 1e-6
    seed: int = 0
    settings: Mapping[str, Any] = field(default_factory=dict)  # healer-specific (e.g. granularity)


@dataclass
class HealContext:
    model: nn.Module  # already pruned (masks applied)
    blocks: list[tuple[str, nn.Module]]  # target blocks, in store order
    entries: list[ScopeEntry]  # prunable scope
    masks: Mapping[str, torch.Tensor]  # full-shape bool, True = keep
    images: torch.Tensor  # (N, C, H, W) calibration images, row i = store row i
    batches: Batches  # streams (rows, targets) for an epoch, in batches of cfg.batch_size
    steps_per_epoch: int
    default_granularity: str = "token"
    dense_model: Callable[[], nn.Module] | None = None  # lazily builds an unpruned copy (repair operators)
    # (images (N, C, H, W), labels (N,)) for supervised baselines (``ce``); the trial passes the first calib_size
    # items of the dataset's TRAIN split: budget-matched, disjoint from calibration/selection/evaluation.
    labeled: tuple[torch.Tensor, torch.Tensor] | None = None
    # Fault tolerance (gradient healers): ``resume`` = a state passed to ``checkpoint`` earlier (the model
    # already holds that epoch's healed weights); ``checkpoint(epoch, state)`` runs after each epoch, before
    # ``on_epoch``, with the loop state needed to continue bit-identically (optimizer, schedule, epoch, losses).
    resume: Mapping[str, Any] | None = None
    checkpoint: Callable[[int, dict[str, Any]], None] | None = None


@dataclass
class HealResult:
    epoch_losses: list[float]
    seconds: float
    steps: int


EpochCallback = Callable[[int, dict[str, float]], None]


class Healer:
    name = ""
    settings_schema: dict[str, tuple] = {}  # setting -> allowed values (tuple) or a type
    trains = False  # uses lr/epochs (gradient steps); False: the search runs one trial per cell (plan.trials_for)

    def check(self, settings: Mapping[str, Any]) -> None:
        for k, v in settings.items():
            if k not in self.settings_schema:
                raise ValueError(f"unknown setting {k!r} for healer {self.name!r}; allowed: "
                                 f"{', '.join(self.settings_schema) or 'none'}")
            allowed = self.settings_schema[k]
            if isinstance(allowed, tuple) and v not in allowed:
                raise ValueError(f"healer {self.name!r} setting {k!r} must be one of {allowed}, got {v!r}")

    def may_change(self, model: nn.Module, entries: list[ScopeEntry]) -> set[str]:
        """state_dict names outside the prunable scope that this healer is allowed to change (e.g. BatchNorm
        running statistics for CR+BN, an fc2 bias for CORP). Default: none."""
        return set()

    def check_cell(self, model: nn.Module, adapter: Any, pruner: str, pruner_settings: Mapping[str, Any],
                   settings: Mapping[str, Any]) -> None:
        """Raise ValueError naming both sides when this healer cannot serve the pruner/model combination."""

    def check_data(self, dataset: Any, settings: Mapping[str, Any]) -> None:
        """Raise ValueError when the sweep's dataset (tasks.data.DatasetSplits) lacks what this healer reads."""

    def epochs(self, cfg: HealConfig) -> int:
        """How many on_epoch reports heal() makes under cfg (0: none; the trial then reports final metrics only)."""
        return 0

    def heal(self, ctx: HealContext, cfg: HealConfig, on_epoch: EpochCallback | None = None) -> HealResult:
        raise NotImplementedError


HEALERS: Registry[Healer] = Registry("healer")


class GradientHealer(Healer):
    """The shared loop. A subclass defines its objective: ``loss(outputs, targets, settings)`` on the tapped block
    outputs (block-target healers), or ``objective(...)`` for anything else (logits, labels, mixtures). Healers that
    do not read block outputs set ``uses_blocks = False``: no forward hooks are installed at all."""

    trains = True
    uses_blocks = True

    def resolve(self, ctx: HealContext, settings: Mapping[str, Any]) -> dict[str, Any]:
        return dict(settings)

    def epochs(self, cfg: HealConfig) -> int:
        return cfg.epochs

    def steps_per_epoch(self, ctx: HealContext, cfg: HealConfig) -> int:
        return ctx.steps_per_epoch

    def stream(self, ctx: HealContext, cfg: HealConfig, epoch: int) -> Iterator[tuple[torch.Tensor, dict[str, torch.Tensor]]]:
        """(images (B, C, H, W), {name: (B, ...)}) for one epoch: calibration images and their dense targets."""
        for rows, tgt in ctx.batches(epoch):
            yield ctx.images[torch.as_tensor(rows)], tgt

    def loss(self, outputs: list[torch.Tensor], targets: list[torch.Tensor], settings: Mapping[str, Any]
             ) -> torch.Tensor:
        raise NotImplementedError

    def objective(self, blocks: Mapping[str, torch.Tensor], logits: torch.Tensor, targets: Mapping[str, torch.Tensor],
                  block_names: list[str], settings: Mapping[str, Any]) -> torch.Tensor:
        """Scalar loss of one batch. ``blocks``: tapped outputs (empty when uses_blocks is False); ``logits``:
        (B, K) model output; ``targets``: the batch's stream dict (on CPU, store dtype)."""
        dev = logits.device
        return self.loss([blocks[b] for b in block_names], [targets[b].to(dev, non_blocking=True) for b in block_names],
                         settings)

    def heal(self, ctx: HealContext, cfg: HealConfig, on_epoch: EpochCallback | None = None) -> HealResult:
        model = ctx.model
        settings = self.resolve(ctx, cfg.settings)
        params = dict(model.named_parameters())
        names = sorted({e.param for e in ctx.entries})
        trainable = train_masks(model, ctx.entries, ctx.masks)
        for p in model.parameters():
            p.requires_grad_(False)
        dev = params[names[0]].device
        keep = {n: trainable[n].to(dev) for n in names}
        frozen = {n: params[n].detach().clone() for n in names}  # pruned values: masked entries are 0
        for n in names:
            params[n].requires_grad_(True)
        opt = torch.optim.AdamW([params[n] for n in names], lr=cfg.lr, weight_decay=cfg.weight_decay)
        total = max(cfg.epochs * self.steps_per_epoch(ctx, cfg), 1)
        sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=total, eta_min=cfg.lr_min)
        torch.manual_seed(cfg.seed)
        model.eval()
        block_names = [b for b, _ in ctx.blocks] if self.uses_blocks else []
        losses, steps, t0, start = [], 0, time.perf_counter(), 0
        if ctx.resume is not None:
            opt.load_state_dict(ctx.resume["optimizer"])
            sched.load_state_dict(ctx.resume["scheduler"])
            start, steps, losses = int(ctx.resume["epoch"]), int(ctx.resume["steps"]), list(ctx.resume["losses"])
        try:
            with (block_tap(ctx.blocks) if self.uses_blocks else nullcontext({})) as cap:
                for epoch in range(start, cfg.epochs):
                    run, n = 0.0, 0
                    for x, tgt in self.stream(ctx, cfg, epoch):
                        logits = model(x.to(dev, non_blocking=True))
                        loss = self.objective(cap, logits, tgt, block_names, settings)
                        where = f"epoch {epoch + 1}, step {steps + 1} (lr={cfg.lr:g})"
                        if not torch.isfinite(loss):
                            raise HealingDiverged(f"healer {self.name!r}: loss became {loss.item()} at {where}")
                        opt.zero_grad(set_to_none=True)
                        loss.backward()
                        with torch.no_grad():
                            for name in names:
                                g = params[name].grad
                                if g is None:  # e.g. a classifier after the last target block: untouched
                                    continue
                                g.mul_(keep[name])
                                if not torch.isfinite(g).all():
                                    raise HealingDiverged(f"healer {self.name!r}: non-finite gradient for {name} at {where}")
                            before = {name: params[name].detach().clone() for name in names}
                        opt.step()
                        sched.step()
                        with torch.no_grad():
                            for name in names:
                                params[name].copy_(torch.where(keep[name], params[name], frozen[name]))
                            if not all(torch.isfinite(params[name]).all() for name in names):
                                for name in names:  # never leave NaN/Inf weights behind
                                    params[name].copy_(before[name])
                                raise HealingDiverged(f"healer {self.name!r}: weights became non-finite at {where}")
                        run += float(loss.detach()) * len(x)
                        n += len(x)
                        steps += 1
                    losses.append(run / max(n, 1))
                    if ctx.checkpoint is not None:
                        ctx.checkpoint(epoch + 1, {"epoch": epoch + 1, "steps": steps, "losses": list(losses),
                                                   "optimizer": opt.state_dict(), "scheduler": sched.state_dict()})
                    if on_epoch is not None:
                        on_epoch(epoch + 1, {"align_loss": losses[-1]})
        finally:
            for name in names:
                params[name].requires_grad_(False)
                params[name].grad = None
        return HealResult(losses, time.perf_counter() - t0, steps)


class StarfishHealer(GradientHealer):
    """STARFISH: cosine alignment of every block output with the dense model's (paper 000)."""

    name = "starfish"
    settings_schema = {"granularity": ("auto",) + GRANULARITIES}

    def resolve(self, ctx, settings):
        g = settings.get("granularity", "auto")
        return {"granularity": ctx.default_granularity if g == "auto" else g}

    def loss(self, outputs, targets, settings):
        return cosine_align_loss(outputs, targets, settings["granularity"])


HEALERS.register("starfish")(StarfishHealer())


def steps_per_epoch(n_rows: int, batch_size: int) -> int:
    return math.ceil(n_rows / batch_size)


def in_memory_batches(targets: Mapping[str, torch.Tensor], batch_size: int, seed: int,
                      order: Callable[[int], Any] | None = None) -> Batches:
    """Targets held in RAM, shuffled per epoch with a seeded generator (tests, benchmarks, recompute mode).
    ``order(epoch)`` overrides the row order (e.g. a store reader's ``epoch_order``, to compare like with like)."""
    n = next(iter(targets.values())).shape[0]

    def batches(epoch: int) -> Iterator[tuple[torch.Tensor, dict[str, torch.Tensor]]]:
        if order is None:
            rows_all = torch.randperm(n, generator=torch.Generator().manual_seed(seed * 100_003 + epoch))
        else:
            rows_all = torch.as_tensor(order(epoch))
        for i in range(0, n, batch_size):
            rows = rows_all[i : i + batch_size]
            yield rows, {k: v[rows.to(v.device)] for k, v in targets.items()}

    return batches


from tasks import crbn_healer as _crbn_healer  # noqa: E402,F401  registers the CR+BN repair healer
# Every other healer (MSE, KL, CE, cosine+KL, none) and composition live in tasks.healers; importing it here keeps
# the registry complete on ``import tasks.heal``.
from tasks import healers as _healers  # noqa: E402,F401
from tasks.healers import resolve_healer  # noqa: E402,F401
from tasks import corp_heal as _corp_heal  # noqa: E402,F401  registers 'corp' (closed-form CORP compensation)
