"""Expand a spec into grid cells and the distinct jobs they need (dense targets, masks).

Without torch: pruners and healers are asked through orchestrator/spec/registries.py (the static table, the live
registry only for a plugin's method) and keys come from tasks.store's torch-free face."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Mapping

from orchestrator.spec import SweepSpec, registries
from tasks.store import content_key

# The RR diagnostics' version (orchestrator/sweep/diagnostics.py): part of a diagnostics table's key and of the mask
# key of every pruner that allocates from one. Bump it when their computation changes (tasks/pruning/rr.py, the CR+BN
# operator in tasks/pruning/repair.py): 2 since CR+BN's τ is floored at ε (2026-12-01).
DIAGNOSTICS_KIND = "rr-diagnostics/2"

TARGETS_FORMAT = "healsweep-targets/1"


@dataclass(frozen=True)
class Cell:
    """One grid cell: model x pattern x calibration size x pruner x healer x seed."""

    model: str
    pruner: str
    pruner_settings: Mapping[str, Any]
    sparsity: float  # requested (for N:M: 1 - N/M)
    pattern: str  # "0.9" or "2:4"
    scope: str
    calib_size: int
    healer: str
    healer_settings: Mapping[str, Any]
    seed: int
    cell_id: str = field(default="", compare=False)
    grid: str = field(default="main", compare=False)  # the spec grid that listed it first (not its identity)

    def identity(self) -> dict:
        d = asdict(self)
        d.pop("cell_id")
        d.pop("grid")
        return d

    def mask_identity(self, model_digest: str, calib_digest: str) -> dict:
        """What determines this cell's mask; calibration data only for pruners that read it, and the diagnostics'
        version for pruners that allocate from RR diagnostics (their mask follows the table)."""
        ident = {"kind": "mask/1", "model_digest": model_digest, "pruner": self.pruner,
                 "settings": dict(self.pruner_settings), "sparsity": self.sparsity, "scope": self.scope,
                 "seed": self.seed}
        pruner = registries.get("pruner", self.pruner)
        if pruner.uses_calibration:
            ident.update(calibration=calib_digest, calib_size=self.calib_size)
        if registries.diagnostic_settings(pruner, self.pruner_settings) is not None:
            ident["diagnostics"] = DIAGNOSTICS_KIND
        return ident


def grid(spec: SweepSpec, scopes: Mapping[str, str]):
    """Yield every cell's fields in a stable order (pruner/healer entries may be restricted to some models,
    a pruner entry may bring its own sparsities and scope)."""
    for model in spec.models:
        for p in spec.pruners:
            if not p.applies_to(model):
                continue
            pruner = registries.get("pruner", p.name)
            fixed = pruner.fixed_sparsity(p.settings)
            for s in ([fixed] if fixed is not None else list(p.sparsities or spec.sparsities)):
                for n in spec.calib_sizes:
                    for h in spec.healers:
                        if not h.applies_to(model):
                            continue
                        for seed in spec.seeds:
                            # resolved settings (defaults filled in): a changed default changes every key
                            # (cell, mask, diagnostics) and the logged params (docs/methods.md#run-identity)
                            yield (model, p.name, pruner.resolved_settings(p.settings), float(s),
                                   pruner.pattern(s, p.settings), p.scope or scopes[model], n, h.name,
                                   registries.resolve_healer(h.name, h.settings).resolved_settings(h.settings), seed)


def expand_cells(spec: SweepSpec, scopes: Mapping[str, str]) -> list[Cell]:
    """All cells of the sweep in a stable order: the main grid's, then each extra grid's (``spec.grids``) that
    are not already listed (only ``spec.cells`` when given); ``scopes`` maps model -> resolved scope name."""
    from orchestrator.spec.grids import views

    cells, seen = [], set()
    for name, view in views(spec):
        for fields in grid(view, scopes):
            ident = Cell(*fields).identity()
            cid = content_key(ident)[:12]
            if cid not in seen and (not spec.cells or cid in spec.cells):
                seen.add(cid)
                cells.append(Cell(**ident, cell_id=cid, grid=name))
    return cells


def grid_searches(spec: SweepSpec) -> dict:
    """Grid name -> its SearchSpec (the top-level search with that grid's overrides)."""
    from orchestrator.spec.grids import views

    return {name: view.search for name, view in views(spec)}


def targets_identity(model_digest: str, dataset_digest: str, calib_order_digest: str, blocks: list[str],
                     dtype: str) -> dict:
    """What determines a dense target set; the row count is not part of it (nested calibration sizes), nor the
    model's display name or file path (the weights' digest identifies it: the same file shares one entry)."""
    return {"format": TARGETS_FORMAT, "model_digest": model_digest, "dataset": dataset_digest,
            "calibration_order": calib_order_digest, "blocks": blocks, "dtype": dtype}
