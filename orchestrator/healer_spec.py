"""The ``healers:`` list of a sweep spec: single healers and ordered chains.

Syntax (one list item each)::

    healers:
      - starfish                                   # a registered healer
      - {name: starfish_kl, settings: {w_kl: 0.3}}
      - {chain: [corp, {name: starfish, settings: {granularity: token}}]}   # corp, then starfish

A chain runs its steps in order on the same masked model. It becomes one ``MethodRef`` named after its steps
joined by ``+`` (``corp+starfish``: that name is the healer in MLflow and the report) whose settings are
``{"chain": [{"name": ..., "settings": {...}}, ...]}``; ``tasks.healing.resolve_healer`` rebuilds it.
"""
from __future__ import annotations

from typing import Any, Mapping


def parse_healers(v: Any, path: str, models: tuple[str, ...] | None = None) -> tuple:
    from orchestrator.spec import MethodRef, SpecError, _keys, _list, _methods
    from tasks.healing import HEALERS, resolve_healer

    out = []
    for i, item in enumerate(_list(v, path)):
        p = f"{path}[{i}]"
        if not (isinstance(item, Mapping) and "chain" in item):
            out.append(_one(item, p, _methods, SpecError, HEALERS, models))
            continue
        d = _keys(item, p, {"chain"}, {"chain"})
        steps = []
        for k, st in enumerate(_list(d["chain"], f"{p}.chain")):
            sp = f"{p}.chain[{k}]"
            if isinstance(st, Mapping) and "chain" in st:
                raise SpecError(sp, "chains do not nest; list the steps in one chain")
            ref = _one(st, sp, _methods, SpecError, HEALERS)
            steps.append({"name": ref.name, "settings": dict(ref.settings)})
        if len(steps) < 2:
            raise SpecError(f"{p}.chain", f"a chain needs at least 2 healers, got {len(steps)}")
        settings = {"chain": steps}
        healer = resolve_healer("+".join(s["name"] for s in steps), settings)
        out.append(MethodRef(healer.name, settings))
    names = [(r.name, repr(sorted(r.settings.items()))) for r in out]
    for j, key in enumerate(names):
        if key in names[:j]:
            raise SpecError(f"{path}[{j}]", f"healer {key[0]!r} with these settings is listed twice")
    return tuple(out)


def _one(item, p, methods, spec_error, registry, models=None):
    """spec._methods on one item, with error paths at ``p`` (not ``p[0]``)."""
    try:
        return methods([item], "@", registry, "healer", models)[0]
    except spec_error as e:
        raise spec_error(e.path.replace("@[0]", p, 1), str(e).split(": ", 1)[1]) from None


def check_healer_data(spec, dataset) -> None:
    """Every healer (chain steps included) must find what it reads in the dataset, e.g. ``ce`` a labeled split."""
    from orchestrator.spec import SpecError
    from tasks.healing import resolve_healer

    for j, h in enumerate(spec.healers):
        try:
            resolve_healer(h.name, h.settings).check_data(dataset, h.settings)
        except ValueError as e:
            raise SpecError(f"healers[{j}]", f"healer {h.name!r} with dataset {spec.dataset!r}: {e}") from None
