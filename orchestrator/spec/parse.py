"""``parse_spec``: a parsed YAML document -> a frozen, validated ``SweepSpec``, one small parser per section.

Every error is a ``SpecError`` whose one-line message names the field and what is allowed. Validation runs
before any work: no Ray, no MLflow, nothing written. Sections that need no registry (names, numbers, search,
heal, resources, store, mlflow, bounds) are checked first; then the registries (dataset, models, methods: their
static table, tasks/catalog.py, so no torch) and the model/method compatibility checks (orchestrator/spec/compat.py:
architectures, so torch, unless their verdict is cached).
"""
from __future__ import annotations

import importlib
from dataclasses import replace
from pathlib import Path
from typing import Any, Mapping

from orchestrator.spec.checks import (
    DESIGNS,
    DEVICES,
    MAX_EPOCHS,
    MAX_LATTICE,
    MAX_LR,
    MAX_REEVALUATE,
    MAX_SEED,
    MAX_STEPS,
    MAX_TRIALS_PER_CELL,
    MAX_WIDEN_FACTOR,
    MAX_WIDEN_ROUNDS,
    OBJECTIVES,
    PRECISIONS,
    COMPILE_MODES,
    GRAPH_MODES,
    SpecError,
    check_bool,
    check_choice,
    check_keys,
    check_list,
    check_name,
    check_num,
    check_pair,
    check_str,
    check_unique,
    excerpt,
    join,
    local_path,
    not_a_dir,
)
from orchestrator.spec.axes import axis_sizes
from orchestrator.spec.compat import check_models, check_outputs, check_size
from orchestrator.spec.grids import parse_grids, view_raw, views
from orchestrator.spec.methods import check_healer_data, parse_healers, parse_methods
from orchestrator.spec.schema import HealSpec, MlflowSpec, ResourceSpec, SearchSpec, StoreSpec, SweepSpec
from orchestrator.spec.sources import dataset_layout, from_dict_form, parse_dataset, parse_models

REQUIRED = {"name", "models", "sparsities", "calib_sizes", "pruners", "healers"}
# SweepSpec fields a user does not write: `cells` (a widening round's spec names its cells), and the dict form's
# `model_refs`/`dataset_settings` (from_dict_form folds them into `models` and `dataset` before the key check).
INTERNAL_KEYS = {"cells", "model_refs", "dataset_settings"}
STORE_SCHEMES = ("file", "s3", "gs", "gcs", "hdfs")  # pyarrow.fs.FileSystem.from_uri schemes


def check_plain(raw: Any, base_dir: str | Path | None = None) -> tuple:
    """The checks that need no registry, plugin or torch import (keys, names, numbers, the search, heal,
    resources, store and mlflow sections): ``healsweep run`` makes them before Ray starts.
    -> (top-level mapping, name, offline, sparsities, data_seed, calib_sizes, seeds, sections)."""
    raw = from_dict_form(raw)
    d = check_keys(raw, "", set(SweepSpec.__dataclass_fields__) - INTERNAL_KEYS, REQUIRED, hidden={"cells"})
    name = check_name(d["name"], "name")
    offline = check_bool(d.get("offline", False), "offline")
    sparsities = check_unique(tuple(check_num(s, f"sparsities[{i}]", float, 0.0, 1.0, hi_open=True)
                                    for i, s in enumerate(check_list(d["sparsities"], "sparsities"))), "sparsities")
    data_seed = check_num(d.get("data_seed", 0), "data_seed", int, 0, MAX_SEED)
    calib = check_unique(tuple(check_num(n, f"calib_sizes[{i}]", int, 1)
                               for i, n in enumerate(check_list(d["calib_sizes"], "calib_sizes"))), "calib_sizes")
    seeds = check_unique(tuple(check_num(s, f"seeds[{i}]", int, 0, MAX_SEED)
                               for i, s in enumerate(check_list(d.get("seeds", [0]), "seeds"))), "seeds")
    sections = dict(search=parse_search(d.get("search")), heal=parse_heal(d.get("heal")),
                    resources=parse_resources(d.get("resources")), store=parse_store(d.get("store"), base_dir),
                    mlflow=parse_mlflow(d.get("mlflow")))
    return d, name, offline, sparsities, data_seed, calib, seeds, sections


def parse_spec(raw: Any, base_dir: str | Path | None = None) -> SweepSpec:
    """Validate a parsed YAML document. Relative local paths (``store.uri``, a model's checkpoint ``path``, a
    dataset's ``root`` or ``path``) are resolved against ``base_dir`` (``load_spec`` passes the spec file's
    directory), else against the current directory, so trials see absolute paths (checks.local_path)."""
    d, name, offline, sparsities, data_seed, calib, seeds, sections = check_plain(raw, base_dir)
    plugins = parse_plugins(d.get("plugins"))  # before the registries: plugins register methods

    dataset, dataset_settings, capacity = parse_dataset(d.get("dataset", "digits"), base_dir)
    models, refs = parse_models(d["models"], dataset, offline, data_seed, base_dir)
    layout = dataset_layout(dataset, data_seed, dataset_settings if capacity is not None else None)
    capacity = len(layout["calibration"]) if capacity is None else capacity
    for i, n in enumerate(calib):
        check_num(n, f"calib_sizes[{i}]", int, 1, capacity)
    spec = SweepSpec(name, tuple(models), sparsities, calib, parse_methods(d["pruners"], "pruners", "pruner", tuple(models)),
                     parse_healers(d["healers"], "healers", tuple(models)), dataset, data_seed, seeds,
                     parse_scope(d.get("scope"), models), plugins=plugins, model_refs=refs,
                     dataset_settings=dataset_settings, offline=offline,
                     calib_seed=check_num(d.get("calib_seed", 0), "calib_seed", int, 0, MAX_SEED), **sections)
    check_heldout(spec, capacity)
    if layout is not None:  # None: a plugin's dataset that gives no layout
        check_healer_data(spec, layout)
    check_models(spec)
    check_outputs(spec)
    if d.get("cells"):
        spec = replace(spec, cells=parse_cells(d["cells"]))
    if d.get("grids"):  # [] (what to_dict writes for none) = no extra grids
        spec = replace(spec, grids=parse_grids(d["grids"], spec, lambda g, s, p: _parse_view(raw, g, s, p)))
    check_calib_draws(spec)
    check_size(spec)
    return spec


def _parse_view(raw: Mapping, grid: Mapping, search: Mapping, path: str) -> SweepSpec:
    """One extra grid as a whole spec (``view_raw``), validated by ``parse_spec`` itself so that every rule
    holds for it; error paths gain ``path`` in front."""
    # calib_draws is the sweep's (checked against every grid's re-evaluations together: check_calib_draws)
    view = view_raw(raw, grid, {**search, "calib_draws": 0}, path)  # its own errors carry the grid's path already
    try:
        return parse_spec(view)
    except SpecError as e:
        raise SpecError(f"{path}.{e.path}" if e.path else path, e.message) from None


def parse_scope(v: Any, models: list[str]) -> dict[str, str]:
    scope = v or {}
    if not isinstance(scope, Mapping):
        raise SpecError("scope", "must map model names to scope names")
    for m, s in scope.items():
        if not isinstance(m, str) or m not in models:
            raise SpecError(join("scope", m), f"not a model of this sweep; models: {', '.join(models)}")
        if not isinstance(s, str):
            raise SpecError(f"scope.{m}", f"must be a scope name, got {excerpt(s)}")
    return dict(scope)


ASHA_EPOCHS = (1, 8)  # scheduler asha without search.epochs: it stops trials at epoch boundaries


def parse_search(v: Any) -> SearchSpec:
    d = {} if v is None else check_keys(v, "search", set(SearchSpec.__dataclass_fields__))
    d = {k: x for k, x in d.items() if x is not None or k not in ("epochs", "steps")}  # to_dict writes None
    if "steps" in d and "epochs" in d:
        raise SpecError("search.steps", "give either search.steps (optimizer steps) or search.epochs, not both")
    if "epochs" in d or ("steps" not in d and d.get("scheduler") == "asha"):  # epochs searched: no default steps
        d = {"epochs": ASHA_EPOCHS, **d, "steps": None}
    s = SearchSpec(**d)
    lo_hi = check_pair(s.lr, "search.lr", float, 0.0, lo_open=True, hi=MAX_LR)
    steps = None if s.steps is None else check_pair(s.steps, "search.steps", int, 1, hi=MAX_STEPS)
    epochs = None if steps is not None else check_pair(s.epochs, "search.epochs", int, 1, hi=MAX_EPOCHS)
    objective = check_choice(s.objective, "search.objective", tuple(OBJECTIVES))
    scheduler = check_choice(s.scheduler, "search.scheduler", ("fifo", "asha"))
    if scheduler == "asha" and objective != "selection_acc":
        raise SpecError("search.objective", f"{objective} is measured once, after healing; scheduler 'asha' needs "
                                            "a per-epoch objective: use scheduler 'fifo' or objective 'selection_acc'")
    if scheduler == "asha" and steps is not None:
        raise SpecError("search.steps", "scheduler 'asha' stops trials at epoch boundaries; use search.epochs with "
                                        "'asha', or scheduler 'fifo' with search.steps")
    out = SearchSpec(check_num(s.trials_per_cell, "search.trials_per_cell", int, 1, MAX_TRIALS_PER_CELL), lo_hi, epochs,
                      objective, check_num(s.sampler_seed, "search.sampler_seed", int, 0, MAX_SEED),
                      None if s.startup_trials is None else
                      check_num(s.startup_trials, "search.startup_trials", int, 1, MAX_TRIALS_PER_CELL),
                      scheduler, check_num(s.asha_grace_period, "search.asha_grace_period", int, 1,
                                           epochs[1] if epochs else MAX_EPOCHS),
                      check_num(s.asha_reduction_factor, "search.asha_reduction_factor", int, 2, 1000),
                      steps, parse_widen(s.widen), *parse_design(s, scheduler, lo_hi, steps or epochs))
    out = replace(out, converge=parse_converge(s.converge, out.design))
    return replace(out, calib_draws=check_num(s.calib_draws, "search.calib_draws", int, 0, MAX_REEVALUATE))


def check_calib_draws(spec: SweepSpec) -> None:
    """``search.calib_draws``: other calibration draws the re-evaluations cycle through; at most as many as some
    grid re-evaluates its winners (a draw no re-evaluation heals on would be computed for nothing)."""
    most = max(v.search.max_reevaluations for _, v in views(spec))
    if spec.search.calib_draws > most:
        raise SpecError("search.calib_draws", f"{spec.search.calib_draws} draws, but the winners are re-evaluated at "
                                              f"most {most} time(s) (search.reevaluate, or a grid's): raise it or "
                                              "lower calib_draws")


CONVERGE_KEYS = {"se_target": (float, 1e-4, 1.0), "reevaluate_max": (int, 1, MAX_REEVALUATE),
                 "min_noise": (float, 0.0, 1.0), "widen_steps": (int, 0, 16), "batch": (int, 1, 64),
                 "family_waves": (int, 1, 64), "widen_growth": (int, 1, 4),
                 "bracket": (int, 0, 1), "pick": (int, 0, 1)}  # orchestrator/search/converge.py Converge


def parse_converge(v: Any, design: str) -> dict | None:
    """``search.converge``: None (a fixed trial count), or {} / a mapping of ``CONVERGE_KEYS`` (design shared)."""
    if v is None or v is False:
        return None
    d = {} if v is True else check_keys(v, "search.converge", set(CONVERGE_KEYS))
    if design != "shared":
        raise SpecError("search.converge", f"works with design 'shared' only, got {design!r}")
    return {k: check_num(x, f"search.converge.{k}", CONVERGE_KEYS[k][0], *CONVERGE_KEYS[k][1:]) for k, x in d.items()}


def parse_design(s: SearchSpec, scheduler: str, lr: tuple[float, float], length: tuple[int, int]
                 ) -> tuple[str, int, int, tuple[int, int]]:
    """``search.design``, ``reevaluate``, ``explore`` and ``lattice``, checked against each other and against the
    distinct points of the box (``lr`` and ``length``, checked already)."""
    default = "tpe" if scheduler == "asha" else "shared"
    design = default if s.design is None else check_choice(s.design, "search.design", DESIGNS)
    reevaluate = check_num(s.reevaluate, "search.reevaluate", int, 0, MAX_REEVALUATE)
    if not (isinstance(s.lattice, (list, tuple)) and len(s.lattice) == 2):
        raise SpecError("search.lattice", f"must be [lr points, length points], got {excerpt(s.lattice)}")
    lattice = tuple(check_num(v, f"search.lattice[{i}]", int, 1, MAX_LATTICE) for i, v in enumerate(s.lattice))
    trials = check_num(s.trials_per_cell, "search.trials_per_cell", int, 1, MAX_TRIALS_PER_CELL)
    explore = min(2, trials) if s.explore is None else check_num(s.explore, "search.explore", int, 1, MAX_TRIALS_PER_CELL)
    if scheduler == "asha" and design != "tpe":
        raise SpecError("search.design", f"scheduler 'asha' stops trials by timing; it works with design 'tpe' only, "
                                         f"got {design!r}")
    a, b = axis_sizes(lr, length, lattice)
    if design == "shared" and trials > a * b:
        fewer = "" if (a, b) == lattice else (f" ({a} lr x {b} length values: equal bounds give one value, integer "
                                              "lengths that round to the same value count once)")
        raise SpecError("search.trials_per_cell", f"the box has {a * b} distinct lattice point(s){fewer}; design "
                                                  f"'shared' tries each at most once per cell, got {trials} trials "
                                                  "(widen the box, raise search.lattice or lower the trials)")
    if design == "shared" and explore > trials:
        raise SpecError("search.explore", f"first-wave points ({explore}) cannot exceed search.trials_per_cell "
                                          f"({trials})")
    return design, reevaluate, explore, lattice


def parse_cells(v: Any) -> tuple[str, ...]:
    """``cells``: restrict the sweep to these cell ids (12 hex digits; what a widening round runs)."""
    out = tuple(check_list(list(v) if isinstance(v, tuple) else v, "cells"))
    for i, c in enumerate(out):
        if not (isinstance(c, str) and len(c) == 12 and all(ch in "0123456789abcdef" for ch in c)):
            raise SpecError(f"cells[{i}]", f"must be a cell id (12 hex digits), got {excerpt(c)}")
    return out


def parse_widen(v: Any) -> dict | None:
    """``search.widen: {rounds: 1, factor: 4}`` (orchestrator/lifecycle/widen.py); None or absent: no widening."""
    if v is None:
        return None
    d = check_keys(v, "search.widen", {"rounds", "factor"})
    return {"rounds": check_num(d.get("rounds", 1), "search.widen.rounds", int, 1, MAX_WIDEN_ROUNDS),
            "factor": check_num(d.get("factor", 4.0), "search.widen.factor", float, 1.0, MAX_WIDEN_FACTOR,
                                        lo_open=True)}


def check_heldout(spec: SweepSpec, capacity: int) -> None:
    """objective heldout_align needs calibration images no trial trains on (tasks/healing/heldout.py)."""
    if spec.search.objective != "heldout_align":
        return
    from tasks.healing.heldout import HELDOUT, heldout_slice

    for i, n in enumerate(spec.calib_sizes):
        if heldout_slice(capacity, n) is None:
            raise SpecError(f"calib_sizes[{i}]", f"{n} leaves no held-out calibration images for objective "
                                                 f"heldout_align (the last {HELDOUT} of {capacity}): use at most "
                                                 f"{capacity - HELDOUT}, or objective selection_acc")


def parse_heal(v: Any) -> HealSpec:
    h = HealSpec(**({} if v is None else check_keys(v, "heal", set(HealSpec.__dataclass_fields__))))
    check_choice(h.precision, "heal.precision", PRECISIONS)
    check_choice(h.compile, "heal.compile", COMPILE_MODES)
    check_choice(h.graph, "heal.graph", GRAPH_MODES)
    if h.channels_last not in ("auto", True, False):
        raise SpecError("heal.channels_last", f"must be auto, true or false, got {excerpt(h.channels_last)}")
    return HealSpec(check_num(h.batch_size, "heal.batch_size", int, 1, 1 << 20),
                    check_num(h.weight_decay, "heal.weight_decay", float, 0.0),
                    check_num(h.lr_min, "heal.lr_min", float, 0.0), h.precision, h.channels_last, h.compile,
                    check_num(h.latency_rounds, "heal.latency_rounds", int, 1, 1000), h.graph)


def parse_resources(v: Any) -> ResourceSpec:
    r = ResourceSpec(**({} if v is None else check_keys(v, "resources", set(ResourceSpec.__dataclass_fields__))))
    p = "resources."
    out = ResourceSpec(check_num(r.cpus_per_trial, p + "cpus_per_trial", float, 0.0, 1e6, lo_open=True),
                       check_num(r.gpus_per_trial, p + "gpus_per_trial", float, 0.0, 1e6),
                       None if r.max_concurrent is None else check_num(r.max_concurrent, p + "max_concurrent", int, 1, 1e6),
                       check_num(r.cpus_per_dense_task, p + "cpus_per_dense_task", float, 0.0, 1e6, lo_open=True),
                       check_num(r.gpus_per_dense_task, p + "gpus_per_dense_task", float, 0.0, 1e6),
                       check_num(r.max_failures, p + "max_failures", int, 0, 1000), check_bool(r.reuse_actors, p + "reuse_actors"),
                       check_choice(r.device, p + "device", DEVICES))
    if out.device == "cuda" and out.gpus_per_trial == 0:
        raise SpecError(p + "device", "cuda needs resources.gpus_per_trial > 0: Ray shows a trial a GPU only when "
                                      "it asks for one (a fraction such as 0.25 lets 4 trials share one)")
    for f in ("gpus_per_trial", "gpus_per_dense_task"):
        g = getattr(out, f)
        if g > 1 and g != int(g):
            raise SpecError(p + f, f"must be a fraction below 1 or a whole number, got {g!r}")
    return out


def parse_store(v: Any, base_dir: str | Path | None) -> StoreSpec:
    s = StoreSpec(**({} if v is None else check_keys(v, "store", set(StoreSpec.__dataclass_fields__))))
    check_choice(s.dtype, "store.dtype", ("float16", "bfloat16"))
    check_choice(s.on_budget, "store.on_budget", ("refuse", "recompute"))
    check_choice(s.targets, "store.targets", ("auto", "store", "recompute"))
    uri = None if s.uri is None else store_uri(s.uri, base_dir)
    return StoreSpec(check_num(s.shard_size, "store.shard_size", int, 1, 1 << 20), s.dtype, uri,
                     None if s.budget_gb is None else check_num(s.budget_gb, "store.budget_gb", float, 0.0), s.on_budget,
                     s.targets)


def store_uri(v: Any, base_dir: str | Path | None) -> str:
    """An absolute local path, or a URI of a scheme pyarrow.fs opens; a relative path is made absolute."""
    uri = check_str(v, "store.uri")
    if "://" in uri:
        scheme = uri.split("://", 1)[0].lower()
        if scheme not in STORE_SCHEMES:
            shown = scheme[:20] if scheme.isalnum() else excerpt(scheme, 20)
            raise SpecError("store.uri", f"unknown scheme {shown}://; allowed: a local path or "
                                         f"{', '.join(s + '://' for s in STORE_SCHEMES)}")
        return uri
    path = local_path(uri, base_dir)
    if why := not_a_dir(path):  # else refused only by `healsweep run`, after `validate` had said ok
        raise SpecError("store.uri", why)
    return path


def parse_mlflow(v: Any) -> MlflowSpec:
    m = MlflowSpec(**({} if v is None else check_keys(v, "mlflow", set(MlflowSpec.__dataclass_fields__))))
    experiment = check_str(m.experiment, "mlflow.experiment", 256)
    uri = m.tracking_uri
    if uri is not None:
        uri = check_str(uri, "mlflow.tracking_uri")
    return MlflowSpec(uri, experiment)


def parse_plugins(v: Any) -> tuple[str, ...]:
    """Import the spec's plugin modules (they register methods) so validation sees their names."""
    if v is None:
        return ()
    if not isinstance(v, list) or not all(isinstance(m, str) for m in v):
        raise SpecError("plugins", f"must be a list of module names, got {excerpt(v)}")
    if len(v) > 100:
        raise SpecError("plugins", f"has {len(v)} items; at most 100 are allowed")
    for i, m in enumerate(v):
        if not all(part.isidentifier() for part in m.split(".")):
            raise SpecError(f"plugins[{i}]", f"must be an absolute module name (a.b.c), got {excerpt(m)}")
        try:
            importlib.import_module(m)
        except ImportError as e:
            raise SpecError(f"plugins[{i}]", f"cannot import module {excerpt(m)}: {excerpt(str(e), 200)}") from None
    return tuple(v)
