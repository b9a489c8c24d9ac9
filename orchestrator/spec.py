"""Sweep spec: YAML (safe loader) -> a frozen, validated ``SweepSpec``.

Every error is a ``SpecError`` whose one-line message names the field and what is allowed. Validation runs
before any work: no Ray, no MLflow, nothing written.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Mapping

import yaml


class SpecError(ValueError):
    def __init__(self, path: str, message: str) -> None:
        super().__init__(f"{path}: {message}" if path else message)
        self.path, self.message = path, message


@dataclass(frozen=True)
class MethodRef:
    name: str
    settings: Mapping[str, Any] = field(default_factory=dict)
    # Optional restrictions of one pruner/healer entry (the grid is otherwise a full cross product):
    models: tuple[str, ...] | None = None  # only these models of the sweep
    sparsities: tuple[float, ...] | None = None  # pruners: this sparsity list instead of the sweep's
    scope: str | None = None  # pruners: this scope instead of the model's (e.g. CORP's mlp_qk on a ViT)

    def applies_to(self, model: str) -> bool:
        return self.models is None or model in self.models


@dataclass(frozen=True)
class SearchSpec:
    trials_per_cell: int = 4
    lr: tuple[float, float] = (1e-4, 3e-3)  # log-uniform bounds
    epochs: tuple[int, int] = (1, 8)  # integer bounds, inclusive
    objective: str = "selection_acc"
    sampler_seed: int = 0
    startup_trials: int | None = None  # random trials before TPE per cell; None: trials_per_cell // 2 (1..10)
    scheduler: str = "fifo"  # fifo | asha (ASHA: Optuna searches lr only, every trial gets epochs[1] epochs)
    asha_grace_period: int = 1  # epochs before ASHA may stop a trial
    asha_reduction_factor: int = 2


@dataclass(frozen=True)
class HealSpec:
    batch_size: int = 32
    weight_decay: float = 0.0
    lr_min: float = 1e-6


@dataclass(frozen=True)
class ResourceSpec:
    cpus_per_trial: float = 1.0
    gpus_per_trial: float = 0.0
    max_concurrent: int | None = None  # None: as many as the cluster's CPUs allow
    cpus_per_dense_task: float = 1.0
    gpus_per_dense_task: float = 0.0
    max_failures: int = 2  # retries of a failed trial, each from its last per-epoch checkpoint
    reuse_actors: bool = True


@dataclass(frozen=True)
class StoreSpec:
    shard_size: int = 64
    dtype: str = "float16"
    uri: str | None = None  # where dense targets live: a path or pyarrow.fs URI; None: <--store>/targets
    budget_gb: float | None = None  # disk budget of the target store; None: unlimited
    on_budget: str = "refuse"  # over budget: "refuse" (error before any compute) | "recompute" (in each trial)


@dataclass(frozen=True)
class MlflowSpec:
    tracking_uri: str | None = None  # None: sqlite database in the run directory
    experiment: str = "healsweep"


@dataclass(frozen=True)
class SweepSpec:
    name: str
    models: tuple[str, ...]
    sparsities: tuple[float, ...]
    calib_sizes: tuple[int, ...]
    pruners: tuple[MethodRef, ...]
    healers: tuple[MethodRef, ...]
    dataset: str = "digits"
    data_seed: int = 0
    seeds: tuple[int, ...] = (0,)
    scope: Mapping[str, str] = field(default_factory=dict)  # model -> scope; missing: the adapter's default
    search: SearchSpec = SearchSpec()
    heal: HealSpec = HealSpec()
    resources: ResourceSpec = ResourceSpec()
    store: StoreSpec = StoreSpec()
    mlflow: MlflowSpec = MlflowSpec()
    plugins: tuple[str, ...] = ()  # modules imported before validation and in every trial (custom methods)
    model_refs: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)  # name -> tasks.sources.ModelRef dict
    dataset_settings: Mapping[str, Any] = field(default_factory=dict)  # `dataset: {name: ..., <settings>}`
    offline: bool = False  # no downloads: weights must be in the local cache
    grids: tuple = ()  # extra grids run in the same sweep (orchestrator/grids.py GridSpec)

    def to_dict(self) -> dict:
        return asdict(self)

    def load_kwargs(self, model: str) -> dict:
        """Extra ``tasks.models.load_model`` arguments for a model; {} for reference models (unchanged path)."""
        ref = self.model_refs.get(model)
        if not ref or ref.get("source", "reference") == "reference":
            return {}
        return {"source": dict(ref), "dataset": {"name": self.dataset, **self.dataset_settings}}


# --- parsing helpers ---------------------------------------------------------------------------------

def _keys(d: Any, path: str, allowed: set[str], required: set[str] = frozenset()) -> dict:
    if not isinstance(d, Mapping):
        raise SpecError(path or "spec", f"must be a mapping, got {type(d).__name__}")
    unknown = sorted(set(d) - allowed)
    if unknown:
        raise SpecError(f"{path + '.' if path else ''}{unknown[0]}", f"unknown key; allowed: {', '.join(sorted(allowed))}")
    missing = sorted(required - set(d))
    if missing:
        raise SpecError(f"{path + '.' if path else ''}{missing[0]}", "required key is missing")
    return dict(d)


def _num(v: Any, path: str, kind: type = float, lo: float | None = None, hi: float | None = None,
         lo_open: bool = False, hi_open: bool = False) -> Any:
    ok = isinstance(v, (int, float)) and not isinstance(v, bool) and (kind is float or isinstance(v, int))
    if not ok or (isinstance(v, float) and not math.isfinite(v)):
        raise SpecError(path, f"must be {'an integer' if kind is int else 'a number'}, got {v!r}")
    if lo is not None and (v < lo or (lo_open and v == lo)):
        raise SpecError(path, f"must be {'>' if lo_open else '>='} {lo}, got {v!r}")
    if hi is not None and (v > hi or (hi_open and v == hi)):
        raise SpecError(path, f"must be {'<' if hi_open else '<='} {hi}, got {v!r}")
    return kind(v)


def _list(v: Any, path: str) -> list:
    if not isinstance(v, list) or not v:
        raise SpecError(path, f"must be a non-empty list, got {v!r}")
    return v


def _methods(v: Any, path: str, registry, kind: str, models: tuple[str, ...] | None = None) -> tuple[MethodRef, ...]:
    """Method entries: a name, or {name, settings, models?, sparsities? (pruners), scope? (pruners)}."""
    extra = {"models"} | ({"sparsities", "scope"} if kind == "pruner" else set())
    out = []
    for i, item in enumerate(_list(v, path)):
        p = f"{path}[{i}]"
        if isinstance(item, str):
            item = {"name": item}
        if isinstance(item, Mapping):  # null = no restriction (what SweepSpec.to_dict writes)
            item = {k: v for k, v in item.items() if v is not None or k not in ("models", "sparsities", "scope")}
        d = _keys(item, p, {"name", "settings"} | (extra if models is not None else set()), {"name"})
        if d["name"] not in registry:
            raise SpecError(f"{p}.name", f"unknown {kind} {d['name']!r}; allowed: {', '.join(registry.names())}")
        settings = d.get("settings") or {}
        if not isinstance(settings, Mapping):
            raise SpecError(f"{p}.settings", "must be a mapping")
        try:
            registry.get(d["name"]).check(settings)
        except ValueError as e:
            raise SpecError(f"{p}.settings", str(e)) from None
        only = None
        if "models" in d:
            only = tuple(_list(d["models"], f"{p}.models"))
            for j, m in enumerate(only):
                if m not in models:
                    raise SpecError(f"{p}.models[{j}]", f"{m!r} is not a model of this sweep; models: {', '.join(models)}")
        sps = None
        if "sparsities" in d:
            sps = tuple(_num(x, f"{p}.sparsities[{j}]", float, 0.0, 1.0, hi_open=True)
                        for j, x in enumerate(_list(d["sparsities"], f"{p}.sparsities")))
        scope = d.get("scope")
        if scope is not None and not isinstance(scope, str):
            raise SpecError(f"{p}.scope", f"must be a scope name, got {scope!r}")
        out.append(MethodRef(d["name"], dict(settings), only, sps, scope))
    return tuple(out)


def _section(cls, d: Any, path: str):
    if d is None:
        return cls()
    fields = {f for f in cls.__dataclass_fields__}
    return cls(**_keys(d, path, fields))


def parse_spec(raw: Any) -> SweepSpec:
    """Validate a parsed YAML document."""
    from orchestrator.healer_spec import check_healer_data, parse_healers
    from orchestrator.spec_sources import from_dict_form
    from tasks.data import DATASETS, load_dataset
    from tasks.models import ADAPTERS, MODELS
    from tasks.pruning import PRUNERS

    raw = from_dict_form(raw)
    top = {f for f in SweepSpec.__dataclass_fields__}
    plugins = _plugins(raw.get("plugins") if isinstance(raw, Mapping) else None)
    d = _keys(raw, "", top, {"name", "models", "sparsities", "calib_sizes", "pruners", "healers"})
    if not isinstance(d["name"], str) or not d["name"].replace("-", "").replace("_", "").isalnum():
        raise SpecError("name", f"must be letters, digits, '-' or '_', got {d['name']!r}")
    from orchestrator.spec_sources import parse_dataset, parse_models

    offline = d.get("offline", False)
    if not isinstance(offline, bool):
        raise SpecError("offline", f"must be true or false, got {offline!r}")
    dataset, dataset_settings, calib_capacity = parse_dataset(d.get("dataset", "digits"), DATASETS)
    models, refs = parse_models(d["models"], dataset, offline, MODELS)
    sparsities = tuple(_num(s, f"sparsities[{i}]", float, 0.0, 1.0, hi_open=True)
                       for i, s in enumerate(_list(d["sparsities"], "sparsities")))
    data_seed = _num(d.get("data_seed", 0), "data_seed", int, 0)
    data = load_dataset(dataset, seed=data_seed) if calib_capacity is None else None
    n_calib = calib_capacity if calib_capacity is not None else len(data["calibration"])
    calib = tuple(_num(n, f"calib_sizes[{i}]", int, 1, n_calib) for i, n in enumerate(_list(d["calib_sizes"], "calib_sizes")))
    pruners = _methods(d["pruners"], "pruners", PRUNERS, "pruner", tuple(models))
    healers = parse_healers(d["healers"], "healers", tuple(models))  # single healers and chains (orchestrator/healer_spec.py)
    seeds = tuple(_num(s, f"seeds[{i}]", int, 0) for i, s in enumerate(_list(d.get("seeds", [0]), "seeds")))

    scope = d.get("scope") or {}
    if not isinstance(scope, Mapping):
        raise SpecError("scope", "must map model names to scope names")
    for m, s in scope.items():
        if m not in models:
            raise SpecError(f"scope.{m}", f"not a model of this sweep; models: {', '.join(models)}")
    search = _section(SearchSpec, d.get("search"), "search")
    lr = search.lr
    if not (isinstance(lr, (list, tuple)) and len(lr) == 2):
        raise SpecError("search.lr", f"must be [low, high], got {lr!r}")
    lo = _num(lr[0], "search.lr[0]", float, 0.0, lo_open=True)
    hi = _num(lr[1], "search.lr[1]", float, lo)
    ep = search.epochs
    if not (isinstance(ep, (list, tuple)) and len(ep) == 2):
        raise SpecError("search.epochs", f"must be [low, high], got {ep!r}")
    e_lo = _num(ep[0], "search.epochs[0]", int, 1)
    e_hi = _num(ep[1], "search.epochs[1]", int, e_lo)
    if search.objective != "selection_acc":
        raise SpecError("search.objective", f"must be 'selection_acc', got {search.objective!r}")
    if search.scheduler not in ("fifo", "asha"):
        raise SpecError("search.scheduler", f"must be 'fifo' or 'asha', got {search.scheduler!r}")
    search = SearchSpec(_num(search.trials_per_cell, "search.trials_per_cell", int, 1), (lo, hi), (e_lo, e_hi),
                        search.objective, _num(search.sampler_seed, "search.sampler_seed", int, 0),
                        None if search.startup_trials is None else
                        _num(search.startup_trials, "search.startup_trials", int, 1), search.scheduler,
                        _num(search.asha_grace_period, "search.asha_grace_period", int, 1, e_hi),
                        _num(search.asha_reduction_factor, "search.asha_reduction_factor", int, 2))
    heal = _section(HealSpec, d.get("heal"), "heal")
    heal = HealSpec(_num(heal.batch_size, "heal.batch_size", int, 1), _num(heal.weight_decay, "heal.weight_decay", float, 0.0),
                    _num(heal.lr_min, "heal.lr_min", float, 0.0))
    res = _section(ResourceSpec, d.get("resources"), "resources")
    res = ResourceSpec(_num(res.cpus_per_trial, "resources.cpus_per_trial", float, 0.0, lo_open=True),
                       _num(res.gpus_per_trial, "resources.gpus_per_trial", float, 0.0),
                       None if res.max_concurrent is None else _num(res.max_concurrent, "resources.max_concurrent", int, 1),
                       _num(res.cpus_per_dense_task, "resources.cpus_per_dense_task", float, 0.0, lo_open=True),
                       _num(res.gpus_per_dense_task, "resources.gpus_per_dense_task", float, 0.0),
                       _num(res.max_failures, "resources.max_failures", int, 0), res.reuse_actors)
    for f in ("gpus_per_trial", "gpus_per_dense_task"):
        g = getattr(res, f)
        if g > 1 and g != int(g):
            raise SpecError(f"resources.{f}", f"must be a fraction below 1 or a whole number, got {g!r}")
    if not isinstance(res.reuse_actors, bool):
        raise SpecError("resources.reuse_actors", f"must be true or false, got {res.reuse_actors!r}")
    store = _section(StoreSpec, d.get("store"), "store")
    if store.dtype not in ("float16", "bfloat16"):
        raise SpecError("store.dtype", f"must be float16 or bfloat16, got {store.dtype!r}")
    if store.on_budget not in ("refuse", "recompute"):
        raise SpecError("store.on_budget", f"must be refuse or recompute, got {store.on_budget!r}")
    if store.uri is not None and (not isinstance(store.uri, str) or not store.uri):
        raise SpecError("store.uri", f"must be a non-empty path or pyarrow.fs URI, got {store.uri!r}")
    store = StoreSpec(_num(store.shard_size, "store.shard_size", int, 1), store.dtype, store.uri,
                      None if store.budget_gb is None else _num(store.budget_gb, "store.budget_gb", float, 0.0),
                      store.on_budget)
    mlf = _section(MlflowSpec, d.get("mlflow"), "mlflow")

    spec = SweepSpec(d["name"], tuple(models), sparsities, calib, pruners, healers, dataset, data_seed, seeds,
                     dict(scope), search, heal, res, store, mlf, plugins, refs, dataset_settings, offline)
    if data is not None:
        check_healer_data(spec, data)
    _check_scopes(spec, ADAPTERS, MODELS)
    if d.get("grids"):  # [] (what to_dict writes for none) = no extra grids
        from dataclasses import replace

        from orchestrator.grids import parse_grids

        spec = replace(spec, grids=parse_grids(d["grids"], spec, lambda g, s, p: _parse_view(raw, g, s, p)))
    return spec


def _parse_view(raw: Mapping, grid: Mapping, search: Mapping, path: str) -> SweepSpec:
    """One extra grid as a whole spec (orchestrator/grids.py ``view_raw``), validated by ``parse_spec`` itself so
    that every rule holds for it; error paths gain ``path`` in front."""
    from orchestrator.grids import view_raw

    view = view_raw(raw, grid, search, path)  # its own errors carry the grid's path already
    try:
        return parse_spec(view)
    except SpecError as e:
        raise SpecError(f"{path}.{e.path}" if e.path else path, e.message) from None


def _plugins(v: Any) -> tuple[str, ...]:
    """Import the spec's plugin modules (they register methods) so validation sees their names."""
    import importlib

    if v is None:
        return ()
    if not isinstance(v, list) or not all(isinstance(m, str) for m in v):
        raise SpecError("plugins", f"must be a list of module names, got {v!r}")
    for i, m in enumerate(v):
        try:
            importlib.import_module(m)
        except ImportError as e:
            raise SpecError(f"plugins[{i}]", f"cannot import module {m!r}: {e}") from None
    return tuple(v)


def _check_scopes(spec: SweepSpec, adapters, models) -> None:
    """Scopes must exist for the model family (checked on an untrained instance: no training here)."""
    from orchestrator.spec_sources import untrained
    from tasks.models import get_adapter

    for m in spec.models:
        model = untrained(spec, m)
        adapter = get_adapter(model)
        model_scope = spec.scope.get(m, adapter.default_scope)
        try:
            adapter.scope(model, model_scope)
        except ValueError as e:
            raise SpecError(f"scope.{m}", str(e)) from None
        from tasks.healing import resolve_healer
        from tasks.pruning import PRUNERS

        for i, p in enumerate(spec.pruners):
            if not p.applies_to(m):
                continue
            s = p.scope or model_scope
            try:
                adapter.scope(model, s)
            except ValueError as e:
                raise SpecError(f"pruners[{i}].scope", f"model {m!r}: {e}") from None
            try:
                PRUNERS.get(p.name).check_model(model, adapter, s, p.settings)
            except ValueError as e:
                where = "settings.m" if p.name == "nm" else "name"
                raise SpecError(f"pruners[{i}].{where}", f"pruner {p.name!r} cannot serve model {m!r}: {e}") from None
            check_sparsity = getattr(PRUNERS.get(p.name), "check_sparsity", None)  # e.g. an RR candidate grid
            for sp in (p.sparsities or spec.sparsities) if check_sparsity else ():
                try:
                    check_sparsity(sp, p.settings)
                except ValueError as e:
                    raise SpecError(f"pruners[{i}].settings.grid", f"pruner {p.name!r} on model {m!r}: {e}") from None
            for j, h in enumerate(spec.healers):
                if not h.applies_to(m):
                    continue
                try:
                    resolve_healer(h.name, h.settings).check_cell(model, adapter, p.name, p.settings, h.settings)
                except ValueError as e:
                    raise SpecError(f"healers[{j}].name", f"healer {h.name!r} with pruner {p.name!r} on model "
                                    f"{m!r}: {e}") from None


def load_spec(path: str | Path) -> SweepSpec:
    p = Path(path)
    if not p.is_file():
        raise SpecError("spec", f"file not found: {p}")
    try:
        raw = yaml.safe_load(p.read_text())
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise SpecError("spec", f"malformed YAML{where}: {getattr(e, 'problem', e)}") from None
    return parse_spec(raw)
