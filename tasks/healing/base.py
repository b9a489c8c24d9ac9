"""The healer contract: configuration, context, result, the ``Healer`` base class and the ``HEALERS`` registry.
A leaf of the healing package: every healer imports it; it imports no healer."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping

import torch
import torch.nn as nn

from tasks.registry import Registry
from tasks.models.adapter import ScopeEntry

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
    steps: int = 0  # > 0: stop after exactly this many optimizer steps (within ``epochs``); 0: whole epochs
    precision: str = "fp32"  # fp32 (the authors') | tf32 | bf16: tasks/healing/precision.py
    compile: str = "off"  # off (the authors': eager) | blocks (regional torch.compile): tasks/healing/compiled.py
    graph: str = "off"  # off (the authors': eager) | step (one CUDA graph per step): tasks/healing/graphed.py


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
    # reads the calibration images (or their dense targets): another draw of them can change what it gives
    # (search.calib_draws re-evaluates a closed-form cell on the draws only then: orchestrator/search/records.py)
    uses_calibration = False
    quick_settings: dict[str, Any] = {}  # cheap settings (image or batch counts) for dry runs and contract tests

    def check(self, settings: Mapping[str, Any]) -> None:
        for k, v in settings.items():
            if k not in self.settings_schema:
                raise ValueError(f"unknown setting {k!r} for healer {self.name!r}; allowed: "
                                 f"{', '.join(self.settings_schema) or 'none'}")
            allowed = self.settings_schema[k]
            if isinstance(allowed, tuple) and v not in allowed:
                raise ValueError(f"healer {self.name!r} setting {k!r} must be one of {allowed}, got {v!r}")

    def may_change(self, model: nn.Module, entries: list[ScopeEntry],
                   settings: Mapping[str, Any] | None = None) -> set[str]:
        """state_dict names outside the prunable scope that this healer is allowed to change under ``settings``
        (e.g. BatchNorm running statistics for CR+BN or STARFISH's bn='train', an fc2 bias for CORP). Default: none."""
        return set()

    def resolved_settings(self, settings: Mapping[str, Any]) -> dict[str, Any]:
        """``settings`` with every default filled in: what run identities and MLflow params record, so a changed
        default never reuses results computed under the old one (docs/methods.md#run-identity)."""
        return dict(settings)

    def check_cell(self, model: nn.Module, adapter: Any, pruner: str, pruner_settings: Mapping[str, Any],
                   settings: Mapping[str, Any]) -> None:
        """Raise ValueError naming both sides when this healer cannot serve the pruner/model combination."""

    def check_data(self, dataset: Any, settings: Mapping[str, Any]) -> None:
        """Raise ValueError when the sweep's dataset (tasks.data.DatasetSplits) lacks what this healer reads."""

    def reads_targets(self, block_names: list[str], settings: Mapping[str, Any]) -> list[str]:
        """The target columns (block names, the ``logits`` pseudo-block) heal() reads from ``ctx.batches`` under
        ``settings``: the trial's store reader hands out only these. Default: none (closed-form healers)."""
        return []

    def epochs(self, cfg: HealConfig) -> int:
        """How many on_epoch reports heal() makes under cfg (0: none; the trial then reports final metrics only)."""
        return 0

    def heal(self, ctx: HealContext, cfg: HealConfig, on_epoch: EpochCallback | None = None) -> HealResult:
        raise NotImplementedError


HEALERS: Registry[Healer] = Registry("healer", instances=True)
