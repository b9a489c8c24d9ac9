"""Which model, scope, pruner and healer can go together, checked on untrained architectures (no training, no
download), and the size bounds of a whole sweep."""
from __future__ import annotations

from orchestrator.spec.checks import SpecError, max_trials
from orchestrator.spec.sources import architecture
from orchestrator.spec.verdicts import cached_check


def check_models(spec) -> None:
    """Scopes must exist for each model's family; every pruner entry must serve the model at its scope and
    sparsities; every healer must serve each (model, pruner) cell it is part of. A verdict already reached
    for the same entries and code is reused without building the model (orchestrator/spec/verdicts.py)."""
    for m in spec.models:
        cached_check(spec, m, lambda m=m: check_model(spec, m))


def check_outputs(spec) -> None:
    """Every external model predicts at least as many classes as a local image folder or table holds (counted from
    its class folders or label column); the models stage refused it only after Ray had started. Hub datasets are
    counted when they are loaded."""
    if not spec.dataset_settings:  # digits, or a preset named alone: no local files to count (and no torch here)
        return
    from orchestrator.spec.registries import live

    classes = getattr(live("dataset").get(spec.dataset), "classes", None)
    n = classes(spec.dataset_settings) if classes else None
    if n is None:
        return
    from tasks.models import too_few_outputs

    for i, m in enumerate(spec.models):
        if (spec.model_refs.get(m) or {}).get("source", "reference") != "reference":
            short = too_few_outputs(m, architecture(spec, m), spec.dataset, n)
            if short:
                raise SpecError(f"models[{i}]", short)


def check_model(spec, m: str) -> None:
    """The compatibility checks of one model of ``spec``, on its untrained architecture."""
    from tasks.models import ModelSourceError, UnsupportedModelError, get_adapter

    try:  # builder arguments the architecture refuses; an architecture no adapter serves: one line
        model = architecture(spec, m)
        adapter = get_adapter(model)
    except (ModelSourceError, UnsupportedModelError) as e:
        raise SpecError(f"models[{spec.models.index(m)}]", f"model {m!r}: {e}" if f"{m!r}" not in str(e)
                        else str(e)) from None
    model_scope = spec.scope.get(m, adapter.default_scope)
    try:
        adapter.scope(model, model_scope)
    except ValueError as e:
        raise SpecError(f"scope.{m}", str(e)) from None
    for i, p in enumerate(spec.pruners):
        if p.applies_to(m):
            _check_pruner(spec, i, p, m, model, adapter, p.scope or model_scope)
            _check_healers(spec, p, m, model, adapter)


def _check_pruner(spec, i: int, p, m: str, model, adapter, scope: str) -> None:
    from tasks.pruning import PRUNERS

    try:
        adapter.scope(model, scope)
    except ValueError as e:
        raise SpecError(f"pruners[{i}].scope", f"model {m!r}: {e}") from None
    pruner = PRUNERS.get(p.name)
    try:
        pruner.check_model(model, adapter, scope, p.settings)
    except ValueError as e:
        where = "settings.m" if p.name == "nm" else "name"
        raise SpecError(f"pruners[{i}].{where}", f"pruner {p.name!r} cannot serve model {m!r}: {e}") from None
    check_sparsity = getattr(pruner, "check_sparsity", None)  # e.g. an RR candidate grid
    for sp in (p.sparsities or spec.sparsities) if check_sparsity else ():
        try:
            check_sparsity(sp, p.settings)
        except ValueError as e:
            raise SpecError(f"pruners[{i}].settings.grid", f"pruner {p.name!r} on model {m!r}: {e}") from None


def _check_healers(spec, p, m: str, model, adapter) -> None:
    from tasks.healing import resolve_healer

    for j, h in enumerate(spec.healers):
        if not h.applies_to(m):
            continue
        try:
            resolve_healer(h.name, h.settings).check_cell(model, adapter, p.name, p.settings, h.settings)
        except ValueError as e:
            raise SpecError(f"healers[{j}].name", f"healer {h.name!r} with pruner {p.name!r} on model "
                                                  f"{m!r}: {e}") from None


def trials_upper_bound(spec) -> int:
    """At most this many trials (every grid; a cell counted once per grid listing it, every healer training)."""
    from orchestrator.spec.grids import views

    total = 0
    for _, v in views(spec):
        for m in v.models:
            n_sp = sum(len(p.sparsities or v.sparsities) for p in v.pruners if p.applies_to(m))
            n_h = sum(1 for h in v.healers if h.applies_to(m))
            total += n_sp * n_h * len(v.calib_sizes) * len(v.seeds) * v.search.per_cell
    return total


def check_size(spec) -> None:
    n, limit = trials_upper_bound(spec), max_trials()
    if n > limit:
        raise SpecError("spec", f"the grid has up to {n} trials; at most {limit} are allowed per sweep (split it, "
                                f"lower sparsities/seeds/trials_per_cell, or set HEALSWEEP_MAX_TRIALS to allow more)")
