"""Extra grids of a sweep spec: ``grids:``, a list of sub-grids run in the same sweep as the top-level grid.

The top-level keys describe the main grid (a full cross product, restricted per pruner/healer entry). A sweep
often needs a second, differently shaped grid beside it, e.g. the default sweep's healer comparison (every
gradient healer and ``none`` on the ViT at three sparsities, three seeds, one calibration size) next to its
pruner/allocation ladder (two healers, one seed). Each ``grids`` item is such a grid::

    grids:
      - name: healers               # letters, digits, '-' or '_'; logged as the trial's `grid` param
        models: [vit_digits]        # a subset of the top-level models (their sources are defined there)
        sparsities: [0.85, 0.9, 0.95]
        calib_sizes: [128]
        pruners: [magnitude]
        healers: [starfish, mse, kl, ce, starfish_kl, none]
        seeds: [0, 1, 2]
        search: {trials_per_cell: 4, lr: [1.0e-3, 1.0e-2], epochs: [3, 8]}   # overrides of the top-level search

A key left out is inherited from the top level (``search`` key by key). Dataset, heal, resources, store and
MLflow settings are the sweep's. The sweep's cells are the union of every grid's cells; a cell that two grids
both produce (same model, pruner, pattern, calibration size, healer and seed) runs once, with the search of
the first grid listing it (the main grid first). Validation runs every check of the main grid on each grid,
with error paths ``grids[i].<key>``.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Any, Iterator, Mapping

from orchestrator.spec.checks import SpecError, check_keys, check_list, check_name, excerpt
from orchestrator.spec.schema import GridSpec
from tasks.catalog import REFERENCE_MODELS

MAIN = "main"  # the `grid` name of the top-level grid's cells
GRID_KEYS = ("models", "sparsities", "calib_sizes", "pruners", "healers", "seeds")
# one scheduler and one search design per sweep: no scheduler or design keys per grid
SEARCH_KEYS = ("trials_per_cell", "lr", "epochs", "steps", "startup_trials", "reevaluate", "explore", "lattice")
LENGTH_KEYS = ("epochs", "steps")  # a grid that sets one of them replaces the top level's choice


def views(spec) -> Iterator[tuple[str, Any]]:
    """(grid name, a SweepSpec whose grid keys and search are that grid's), the main grid first."""
    yield MAIN, replace(spec, grids=())
    for g in spec.grids:
        over = {k: getattr(g, k) for k in GRID_KEYS if getattr(g, k) is not None}
        yield g.name, replace(spec, grids=(), search=replace(spec.search, **dict(g.search)), **over)


def cell_trials(search, calib_draws: int, trains: bool, redrawn: bool) -> int:
    """Trials one cell of a grid whose search settings are ``search`` runs (``healsweep validate``, refine's plan):
    a searched cell's search trials and re-evaluations (``max_per_cell``); a closed-form cell 1, and 1 more on each
    other calibration draw that can change it (``redrawn``: tasks.catalog.changes_with_draw; search.calib_draws, as
    many draws as the grid re-evaluates: orchestrator/sweep/draws.py)."""
    if trains:
        return search.max_per_cell
    return 1 + (min(calib_draws, search.max_reevaluations) if redrawn else 0)


def parse_grids(raw: Any, spec, parse_view) -> tuple[GridSpec, ...]:
    """Validate ``raw`` (the ``grids`` value) against the parsed top-level ``spec``.

    ``parse_view(view_raw, path)`` parses the grid keys of one grid, given as a full top-level mapping (the
    spec's own parser, so every rule is the same), and returns the resulting SweepSpec view; errors are
    re-raised with ``path`` in front."""
    if raw is None:
        return ()
    out, names = [], {MAIN}
    for i, item in enumerate(check_list(raw, "grids")):
        p = f"grids[{i}]"
        if isinstance(item, Mapping):  # null = inherited (what SweepSpec.to_dict writes)
            item = {k: v for k, v in item.items() if v is not None}
        d = check_keys(item, p, {"name", *GRID_KEYS, "search"}, {"name"})
        name = check_name(d["name"], f"{p}.name")
        if name in names:
            raise SpecError(f"{p}.name", f"grid name {name!r} is used twice ({MAIN!r} is the top-level grid)")
        names.add(name)
        search = d.get("search") or {}
        if isinstance(search, Mapping):  # to_dict writes every search field; keep the ones a grid may set
            search = {k: v for k, v in search.items() if v is not None}
        search = check_keys(search, f"{p}.search", set(SEARCH_KEYS))
        if "epochs" in search and spec.search.scheduler == "asha":
            raise SpecError(f"{p}.search.epochs", "cannot be set per grid with scheduler 'asha' (one ASHA "
                                                  "max_t per sweep); set search.epochs at the top level")
        for j, m in enumerate(check_list(d["models"], f"{p}.models") if "models" in d else ()):
            if not isinstance(m, str) or m not in spec.models:
                raise SpecError(f"{p}.models[{j}]", f"{excerpt(m)} is not a model of this sweep (a grid's models are "
                                                    f"defined at the top level); models: {', '.join(spec.models)}")
        view = parse_view({k: d[k] for k in GRID_KEYS if k in d}, search, p)
        over = {k: getattr(view.search, k) for k in search}
        if any(k in search for k in LENGTH_KEYS):  # steps replace epochs (or back): the other one is unset
            over.update({k: getattr(view.search, k) for k in LENGTH_KEYS})
        out.append(GridSpec(name, *(getattr(view, k) if k in d else None for k in GRID_KEYS), over))
    return tuple(out)


def view_raw(raw: Mapping, grid: Mapping, search: Mapping, path: str) -> dict:
    """The top-level spec document with one grid's keys and search overrides: what ``parse_spec`` validates for
    that grid. With a ``models`` subset, the top-level model entries (sources) of those names are used, the
    ``scope`` map keeps those models, and inherited pruner/healer entries restricted to other models are left
    out (those restricted to some of the grid's models keep just those)."""
    view = {k: v for k, v in raw.items() if k != "grids"}
    top = dict(raw.get("search") or {})
    if any(k in search for k in LENGTH_KEYS):
        top = {k: v for k, v in top.items() if k not in LENGTH_KEYS}
    view.update(grid, search={**top, **search})
    if "models" not in grid:
        return view
    names = list(grid["models"])
    entries = {_model_name(m, bool(raw.get("offline", False))): m for m in raw["models"]}
    view["models"] = [entries.get(m, m) for m in names]
    if isinstance(raw.get("scope"), Mapping):
        view["scope"] = {m: s for m, s in raw["scope"].items() if m in names}
    for key in ("pruners", "healers"):
        if key in grid or not isinstance(raw.get(key), list):
            continue
        kept = []
        for item in raw[key]:
            only = item.get("models") if isinstance(item, Mapping) else None
            if only is None:
                kept.append(item)
            elif any(m in names for m in only):
                kept.append({**item, "models": [m for m in only if m in names]})
        if not kept:
            raise SpecError(f"{path}.{key}", f"no top-level {key[:-1]} entry applies to the grid's models "
                                             f"({', '.join(names)}); list {key} in the grid")
        view[key] = kept
    return view


def _model_name(entry: Any, offline: bool) -> str:
    """The display name of a top-level ``models`` entry (a reference name: from the table, without torch)."""
    if isinstance(entry, str) and entry in REFERENCE_MODELS:
        return entry
    from tasks.models import MODELS, parse_ref

    return entry if isinstance(entry, str) and entry in MODELS else parse_ref(entry, offline=offline).name
