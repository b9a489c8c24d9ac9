"""Allocation rules for unstructured magnitude pruning, registered as pruners (docs/methods.md#relative-repairability-crbn-rr).

Each rule decides per-layer sparsities (tasks/pruning/allocation_math.py); the pruner turns them into exact integer counts
and removes the smallest-|w| weights of each layer. Global count: ``uniform`` rounds per layer like
``magnitude``; every other rule prunes exactly n_pruned(Σ n_l, target) weights in total (largest remainder).

The repairability family (``raw_shift``: g = D_raw, ``repair_residual``: g = D_repair, ``rr``: g = R) reads
its diagnostics table from ``PruneContext.diagnostics["rr"]`` (columnar, tasks/pruning/rr.py ``COLUMNS``), computed by
the orchestrator's cached diagnostics stage. Outside a sweep (library use, unit tests) a missing table is
computed from ``ctx.calib_images`` on the spot. Greedy allocations on the grid overshoot the target by at most
one step; ``fit_budget`` scales them by one common factor to the exact target (also below the grid's first
candidate, where every layer gets the target).
"""
from __future__ import annotations

from typing import Any, Mapping

import torch

from tasks.pruning.allocation_math import (CANDIDATE_GRID, allocate_counts, erk_sparsities, fit_budget,
                                           global_magnitude_sparsities, greedy_allocate, lamp_sparsities, n_pruned,
                                           uniform_sparsities)
from tasks.pruning.base import PRUNERS, PruneContext, Pruner, _keep_all_but_smallest
from tasks.pruning.repair import TAU_RULES, unrepairable_reason
from tasks.pruning.rr import MEASURE_AT, cost_table, model_diagnostics

DIAG_KEY = "rr"  # PruneContext.diagnostics[DIAG_KEY] = columnar diagnostics table


def prune_to_counts(weights: Mapping[str, torch.Tensor], counts: Mapping[str, int]) -> dict[str, torch.Tensor]:
    return {k: _keep_all_but_smallest(w.detach().abs(), counts[k]) for k, w in weights.items()}


class AllocationPruner(Pruner):
    """Subclasses define ``sparsities(weights, target, ctx, settings)``."""

    def sparsities(self, weights, target, ctx, settings) -> dict[str, float]:
        raise NotImplementedError

    def __call__(self, weights, sparsity, *, seed, ctx=None, **settings):
        sizes = {k: w.numel() for k, w in weights.items()}
        alloc = self.sparsities(weights, sparsity, ctx, settings)
        counts = allocate_counts(sizes, alloc, n_pruned(sum(sizes.values()), sparsity))
        return prune_to_counts(weights, counts)


@PRUNERS.register("uniform")
class UniformPruner(AllocationPruner):

    def __call__(self, weights, sparsity, *, seed, ctx=None, **settings):
        return prune_to_counts(weights, {k: n_pruned(w.numel(), sparsity) for k, w in weights.items()})

    def sparsities(self, weights, target, ctx, settings):
        return uniform_sparsities({k: w.numel() for k, w in weights.items()}, target)


@PRUNERS.register("global")
class GlobalPruner(AllocationPruner):

    def sparsities(self, weights, target, ctx, settings):
        return global_magnitude_sparsities(weights, target)


@PRUNERS.register("erk")
class ERKPruner(AllocationPruner):
    settings_schema = {"floor": float, "cap": float}

    def check(self, settings):
        super().check(settings)
        f, c = settings.get("floor", 0.025), settings.get("cap", 1.0)
        if not 0.0 <= f <= c <= 1.0:
            raise ValueError(f"pruner 'erk' needs 0 <= floor <= cap <= 1, got floor={f}, cap={c}")

    def sparsities(self, weights, target, ctx, settings):
        return erk_sparsities({k: tuple(w.shape) for k, w in weights.items()}, target,
                              settings.get("floor", 0.025), settings.get("cap", 1.0))


@PRUNERS.register("lamp")
class LAMPPruner(AllocationPruner):

    def sparsities(self, weights, target, ctx, settings):
        return lamp_sparsities(weights, target)


class RepairabilityPruner(AllocationPruner):
    """Greedy allocation on the candidate grid with diagnostic column ``column`` as g (the Relative Repairability paper)."""

    column = ""
    uses_calibration = True
    settings_schema = {"grid": list, "diag_images": int, "tau": str, "at": str}
    quick_settings = {"diag_images": 8}

    def grid(self, settings) -> tuple[float, ...]:
        return tuple(float(g) for g in settings.get("grid", CANDIDATE_GRID))

    def check(self, settings):
        super().check(settings)
        g = settings.get("grid", CANDIDATE_GRID)
        if not g or not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in g):
            raise ValueError(f"pruner {self.name!r} setting 'grid' must be a non-empty list of numbers")
        g = self.grid(settings)
        if any(b <= a for a, b in zip(g, g[1:])) or g[0] < 0 or g[-1] > 1:
            raise ValueError(f"pruner {self.name!r} grid must be strictly increasing within [0, 1], got {list(g)}")
        if settings.get("diag_images", 128) < 1:
            raise ValueError(f"pruner {self.name!r} setting 'diag_images' must be >= 1")

        if settings.get("tau", "median") not in TAU_RULES:
            raise ValueError(f"pruner {self.name!r} setting 'tau' must be one of {TAU_RULES}")
        if settings.get("at", "conv") not in MEASURE_AT:
            raise ValueError(f"pruner {self.name!r} setting 'at' must be one of {MEASURE_AT}, got {settings['at']!r}")

    def check_sparsity(self, sparsity: float, settings: Mapping[str, Any]) -> None:
        """Spec validation: the grid must reach every requested sparsity (before any compute)."""
        g = self.grid(settings)
        if sparsity > g[-1] + 1e-12:
            raise ValueError(f"candidate grid {list(g)} cannot reach sparsity {sparsity} (largest candidate "
                             f"{g[-1]})")

    def check_model(self, model, adapter, scope, settings):
        for e in adapter.scope(model, scope):
            why = unrepairable_reason(model, e.param)
            if why:
                raise ValueError(f"RR diagnostics cannot measure scope {scope!r}: {why}")

    def resolved_settings(self, settings):
        return {**dict(settings), **self.diagnostic_settings(settings)}

    def diagnostic_settings(self, settings) -> dict[str, Any]:
        """What determines the diagnostics table (part of its content key)."""
        return {"grid": list(self.grid(settings)), "diag_images": int(settings.get("diag_images", 128)),
                "tau": settings.get("tau", "median"), "at": settings.get("at", "conv")}

    def table(self, ctx: PruneContext | None, settings) -> Mapping[str, list]:
        if ctx is not None and DIAG_KEY in ctx.diagnostics:
            return ctx.diagnostics[DIAG_KEY]
        if ctx is None or ctx.calib_images is None:
            raise ValueError(f"pruner {self.name!r} needs RR diagnostics or calibration images")

        d = self.diagnostic_settings(settings)
        return model_diagnostics(ctx.model, ctx.entries, ctx.calib_images[: d["diag_images"]], d["grid"], tau=d["tau"],
                                 at=d["at"])

    def sparsities(self, weights, target, ctx, settings):
        grid = self.grid(settings)
        self.check_sparsity(target, settings)
        cost, sizes = cost_table(self.table(ctx, settings), self.column, list(weights), grid)
        for k, w in weights.items():
            if sizes[k] != w.numel():
                raise ValueError(f"diagnostics table has {sizes[k]} weights for {k}, the model {w.numel()}")
        return fit_budget(greedy_allocate(cost, sizes, grid, target), sizes, target)


@PRUNERS.register("raw_shift")
class RawShiftPruner(RepairabilityPruner):
    column = "D_raw"


@PRUNERS.register("repair_residual")
class RepairResidualPruner(RepairabilityPruner):
    column = "D_repair"


@PRUNERS.register("rr")
class RRPruner(RepairabilityPruner):
    column = "R"
