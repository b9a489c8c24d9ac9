"""Re-evaluations on other calibration draws (``search.calib_draws``): the draw in the quoted number's noise.

A cell heals on the first n images of one order of the calibration split (the data seed's, or ``calib_seed``'s).
Another draw of n images moves a cell as much as the healing seed does, or more at small n (docs/methods.md#
reading-the-noise), so a noise measured on one draw under-claims what a rerun on other images gives. With
``calib_draws: K`` the sweep prepares K more draws (``calib_seed`` of draw j: ``reevaluation_draws``) and
re-evaluation k of a winner heals on draw k mod K: its own dense targets, its own mask where the pruner reads
calibration images (RR's table, SnapViT, CORP; a magnitude mask is the same key on every draw) and its own
images for recomputed targets. The search still runs on the sweep's own draw; the quoted mean is over the
other draws, and its spread, and so the noise, contains the draw's. A closed-form cell (no search) whose healer or
pruner reads the calibration images (CR+BN, CORP; RR, SnapViT, CORP masks) heals once on each other draw too, and
the report quotes its mean over every draw, its own included (analysis/reported.py); one that reads none (``none``
on a magnitude mask) gives one number on every draw and runs once.

Each draw is the sweep itself at another ``calib_seed`` (``dataclasses.replace``): the same models, dense, RR
diagnostics and mask stages run on it, content-addressed like the sweep's own, so a resumed sweep or another
sweep computes nothing twice."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from typing import TYPE_CHECKING, Mapping

from orchestrator.spec import SweepSpec
from orchestrator.sweep.model_facts import ModelInfo

if TYPE_CHECKING:  # the plan imports the target store (pyarrow): end.py and parent.py import this module early
    from orchestrator.spec.plan import Cell


@dataclass
class Draw:
    """One other draw, prepared: its spec, model facts (store keys) and {cell id: mask key}; what its stages
    computed now (the rest was in the store): target images and shards, masks, RR layers, and the damaged shards
    or masks found and recomputed (``events``)."""
    spec: SweepSpec
    models: dict[str, ModelInfo]
    mask_keys: dict[str, str]
    dense: int = 0
    masks: int = 0
    shards: int = 0
    layers: int = 0
    events: list[str] = field(default_factory=list)


def totals(draws: list[Draw]) -> dict:
    """What every draw computed, summed: the parent run's counters add it to the sweep's own
    (orchestrator/sweep/end.py, parent.py)."""
    return {"dense": sum(d.dense for d in draws), "masks": sum(d.masks for d in draws),
            "shards": sum(d.shards for d in draws), "layers": sum(d.layers for d in draws),
            "events": [e for d in draws for e in d.events]}


def draw_specs(spec: SweepSpec) -> list[SweepSpec]:
    """The sweep at each other draw's ``calib_seed`` (none when ``search.calib_draws`` is 0)."""
    from orchestrator.search.records import reevaluation_draws  # the search package imports Ray Tune and Optuna

    return [replace(spec, calib_seed=d) for d in reevaluation_draws(spec.calib_seed, spec.search.calib_draws)]


def cells_of_draw(spec: SweepSpec, cells: list[Cell], index: int) -> list[Cell]:
    """The cells a re-evaluation heals on draw ``index`` for: those whose grid re-evaluates its winners more than
    ``index`` times (``spec``: this session's, so a widening round's added re-evaluations are counted)."""
    from orchestrator.spec.grids import MAIN, views

    most = {name: view.search.max_reevaluations for name, view in views(spec)}
    return [c for c in cells if most.get(c.grid or MAIN, 0) > index]


def trial_overrides(draw: Draw, cells: list[Cell], index: int) -> dict[str, dict]:
    """{cell id: the trial config keys that move a re-evaluation of the cell onto ``draw``} (orchestrator/search/
    tune.py ``DesignSearcher.draws``; the keys are ``raytune.tune_setup.trial_config``'s), for every cell the draw
    was prepared for: those it has a mask for (``prepare_draw`` got ``cells_of_draw``, less the closed-form cells no
    draw changes)."""
    return {c.cell_id: {"store_key": draw.models[c.model].store_key, "mask_key": draw.mask_keys[c.cell_id],
                        "load_kw": draw.spec.load_kwargs(c.model), "calib_draw": index}
            for c in cells if c.cell_id in draw.mask_keys}


def draw_store_keys(spec: SweepSpec, cache: str, on_cluster: bool) -> dict[str, list[str]]:
    """{model: the target key of each other draw}, before the draws stage: what ``store.budget_gb`` prices with the
    sweep's own keys (orchestrator/sweep/dense.py ``budget_modes``). Only asked for under a budget (a reference
    model's facts are cached; another model is loaded once per draw)."""
    from orchestrator.sweep.stages import prepare_models

    per = [prepare_models(d, cache, progress=False, on_workers=on_cluster) for d in draw_specs(spec)]
    return {m: [p[m].store_key for p in per] for m in spec.models}


def store_keys(draws: list[Draw]) -> dict[str, str]:
    """``targets.json`` entries of the draws' target keys, ``model@calib_seed`` -> key (``store gc
    --keep-referenced`` and ``doctor`` read every value)."""
    return {f"{m}@{d.spec.calib_seed}": i.store_key for d in draws for m, i in d.models.items()}


def prepare_draw(spec: SweepSpec, cells: list[Cell], rows: Mapping[str, int], modes: Mapping[str, str],
                 paths: Mapping[str, str], *, on_cluster: bool, in_driver: bool, progress: bool = False) -> Draw:
    """Models, dense targets (only what the store lacks; none for models whose targets are recomputed), RR
    diagnostics and masks of one draw for ``cells`` (``cells_of_draw``): the sweep's own stages at the draw's
    ``calib_seed``."""
    from orchestrator.raytune.resources import task_gpus
    from orchestrator.search.records import redrawn_cell
    from orchestrator.sweep.dense import DenseReport
    from orchestrator.sweep.diagnostics import diagnostics_stage
    from orchestrator.sweep.stages import dense_stage, mask_stage, prepare_models

    res, cache = spec.resources, paths["cache"]
    cells = [c for c in cells if redrawn_cell(asdict(c))]  # not closed-form cells the draw cannot change
    models = prepare_models(spec, cache, progress=False, on_workers=on_cluster)
    rep = DenseReport()
    dense = dense_stage(spec, models, dict(rows), paths["targets"], cache, progress=progress,
                        skip=tuple(m for m, v in modes.items() if v == "recompute"), report=rep,
                        in_driver=False if on_cluster else None)
    load_kw = {m: spec.load_kwargs(m) for m in models}
    diag = diagnostics_stage(cells, models, paths["diagnostics"], cache, spec.data_seed, int(res.cpus_per_dense_task),
                             load_kw=load_kw)
    masks = mask_stage(cells, models, paths["masks"], cache, spec.data_seed, diagnostics=diag.tables(
        paths["diagnostics"]), load_kw=load_kw, ranking_dir=paths["rankings"], in_driver=in_driver,
        resources=(res.cpus_per_dense_task, task_gpus(res)), device=res.device)
    return Draw(spec, models, dict(masks), sum(dense.values()), len(masks.computed), sum(rep.shards.values()),
                diag.computed_layers, [*rep.events, *masks.events])
