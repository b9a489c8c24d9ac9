"""The ``pruners:`` and ``healers:`` lists of a sweep spec: method entries, and ordered healer chains.

Syntax (one list item each)::

    pruners:
      - magnitude                                  # a registered pruner
      - {name: nm, settings: {n: 2, m: 4}}
      - {name: corp, models: [vit_digits], sparsities: [0.5], scope: mlp_qk}   # restricted entry
    healers:
      - starfish                                   # a registered healer
      - {name: starfish_kl, settings: {w_kl: 0.3}}
      - {chain: [corp, {name: starfish, settings: {granularity: token}}]}   # corp, then starfish

A chain runs its steps in order on the same masked model. It becomes one ``MethodRef`` named after its steps
joined by ``+`` (``corp+starfish``: that name is the healer in MLflow and the report) whose settings are
``{"chain": [{"name": ..., "settings": {...}}, ...]}``; ``tasks.healing.resolve_healer`` rebuilds it.
Names and settings are checked against the registries' static table (tasks/catalog.py, no torch); a name it does
not list (a plugin's) against the live registry (orchestrator/spec/registries.py).
"""
from __future__ import annotations

import json
from typing import Any, Mapping

from orchestrator.spec.checks import SpecError, check_keys, check_list, check_num, check_unique, excerpt
from orchestrator.spec.registries import get, known, names, resolve_healer
from orchestrator.spec.schema import MethodRef

RESTRICTIONS = ("models", "sparsities", "scope")


def parse_methods(v: Any, path: str, kind: str, models: tuple[str, ...] | None = None) -> tuple[MethodRef, ...]:
    """Pruner or healer entries: a name, or {name, settings, models?, sparsities? (pruners), scope? (pruners)}.
    ``models=None``: no restriction keys allowed (chain steps); else the same entry twice is an error."""
    out = tuple(parse_method(item, f"{path}[{i}]", kind, models) for i, item in enumerate(check_list(v, path)))
    if models is not None:
        _once([(r.name, _same_as(kind, r), r.models, r.sparsities, r.scope) for r in out], out, path, kind)
    return out


def _same_as(kind: str, ref: MethodRef) -> str:
    """The entry's settings with its method's defaults filled in (``Method.same_as``), as a comparable string."""
    try:
        m = resolve_healer(ref.name, ref.settings) if kind == "healer" else get(kind, ref.name)
        s = m.same_as(ref.settings) if hasattr(m, "same_as") else m.resolved_settings(ref.settings)
    except (KeyError, TypeError, ValueError):  # a method the checks above let through but cannot resolve
        s = dict(ref.settings)
    return json.dumps(s, sort_keys=True, default=str)  # sorted at every depth: a chain's steps' settings too


def _once(keys: list[tuple], refs, path: str, kind: str) -> None:
    """No entry twice: a repeat, also one whose settings differ only by the defaults written out (``nm`` and ``nm
    {n: 2, m: 4}``), would be dropped silently or run the same cells twice (``keys[j][0]`` is the method's name)."""
    for j, key in enumerate(keys):
        if key in keys[:j]:
            i = keys.index(key)
            how = "" if refs[i].settings == refs[j].settings else ", the same once its defaults are filled in"
            raise SpecError(f"{path}[{j}]", f"{kind} {key[0]!r} with these settings is listed twice "
                                            f"(also at [{i}]{how})")


def parse_method(item: Any, p: str, kind: str, models: tuple[str, ...] | None = None) -> MethodRef:
    if isinstance(item, str):
        item = {"name": item}
    if isinstance(item, Mapping):  # null = no restriction (what SweepSpec.to_dict writes)
        item = {k: v for k, v in item.items() if v is not None or k not in RESTRICTIONS}
    extra = {"models"} | ({"sparsities", "scope"} if kind == "pruner" else set())
    d = check_keys(item, p, {"name", "settings"} | (extra if models is not None else set()), {"name"})
    name = d["name"]
    if not known(kind, name):
        raise SpecError(f"{p}.name", f"unknown {kind} {excerpt(name)}; allowed: {', '.join(names(kind))}")
    settings = d.get("settings") or {}
    if not isinstance(settings, Mapping) or not all(isinstance(k, str) for k in settings):
        raise SpecError(f"{p}.settings", "must be a mapping of setting names to values")
    try:
        get(kind, name).check(settings)
    except (ValueError, TypeError) as e:  # TypeError: a value of a type the method's checks cannot compare
        raise SpecError(f"{p}.settings", str(e)) from None
    only = _models(d, p, models) if "models" in d else None
    sps = None
    if "sparsities" in d:
        sps = check_unique(tuple(check_num(x, f"{p}.sparsities[{j}]", float, 0.0, 1.0, hi_open=True)
                                 for j, x in enumerate(check_list(d["sparsities"], f"{p}.sparsities"))),
                           f"{p}.sparsities")
        fixed = getattr(get(kind, name), "fixed_sparsity", lambda _: None)(settings)
        if fixed is not None:  # its cells are its one pattern: the list was ignored
            raise SpecError(f"{p}.sparsities", f"pruner {name!r} prunes to a fixed sparsity ({fixed:g} with these "
                                               f"settings); leave sparsities out")
    scope = d.get("scope")
    if scope is not None and not isinstance(scope, str):
        raise SpecError(f"{p}.scope", f"must be a scope name, got {excerpt(scope)}")
    return MethodRef(name, dict(settings), only, sps, scope)


def _models(d: Mapping, p: str, models: tuple[str, ...]) -> tuple[str, ...]:
    only = tuple(check_list(d["models"], f"{p}.models"))
    for j, m in enumerate(only):
        if not isinstance(m, str) or m not in models:
            raise SpecError(f"{p}.models[{j}]", f"{excerpt(m)} is not a model of this sweep; models: {', '.join(models)}")
    return only


def parse_healers(v: Any, path: str, models: tuple[str, ...] | None = None) -> tuple[MethodRef, ...]:
    """Healer entries: single healers (``parse_method``) and chains; the same healer twice is an error."""
    out = []
    for i, item in enumerate(check_list(v, path)):
        p = f"{path}[{i}]"
        if isinstance(item, Mapping) and "chain" in item:
            out.append(parse_chain(item, p))
        elif _is_written_chain(item):  # SweepSpec.to_dict's form of a chain (sweep.json: resume, refine)
            ref = parse_chain({"chain": item["settings"]["chain"]}, p)
            if ref.name != item["name"]:
                raise SpecError(f"{p}.name", f"chain of {ref.name!r} cannot be named {excerpt(item['name'])}")
            out.append(ref)
        else:
            out.append(parse_method(item, p, "healer", models))
    _once([(r.name, _same_as("healer", r)) for r in out], out, path, "healer")
    return tuple(out)


def _is_written_chain(item: Any) -> bool:
    """{name: "a+b", settings: {chain: [...]}, models: None}: a chain as ``SweepSpec.to_dict`` writes it."""
    return (isinstance(item, Mapping) and isinstance(item.get("name"), str) and "+" in item["name"]
            and isinstance(item.get("settings"), Mapping) and set(item["settings"]) == {"chain"}
            and all(item.get(k) is None for k in item if k not in ("name", "settings")))


def parse_chain(item: Mapping, p: str) -> MethodRef:
    d = check_keys(item, p, {"chain"}, {"chain"})
    steps = []
    for k, st in enumerate(check_list(d["chain"], f"{p}.chain")):
        sp = f"{p}.chain[{k}]"
        if isinstance(st, Mapping) and "chain" in st:
            raise SpecError(sp, "chains do not nest; list the steps in one chain")
        ref = parse_method(st, sp, "healer")
        steps.append({"name": ref.name, "settings": dict(ref.settings)})
    if len(steps) < 2:
        raise SpecError(f"{p}.chain", f"a chain needs at least 2 healers, got {len(steps)}")
    settings = {"chain": steps}
    try:
        healer = resolve_healer("+".join(s["name"] for s in steps), settings)
    except (ValueError, KeyError) as e:
        raise SpecError(f"{p}.chain", str(e.args[0] if e.args else e)) from None
    return MethodRef(healer.name, settings)


def check_healer_data(spec, dataset) -> None:
    """Every healer (chain steps included) must find what it reads in the dataset, e.g. ``ce`` a labeled split."""
    for j, h in enumerate(spec.healers):
        try:
            resolve_healer(h.name, h.settings).check_data(dataset, h.settings)
        except ValueError as e:
            raise SpecError(f"healers[{j}]", f"healer {h.name!r} with dataset {spec.dataset!r}: {e}") from None
