"""healsweep validate SPEC: check a spec and print its grid size, without running anything."""
from __future__ import annotations

import json
from collections import Counter, defaultdict

from orchestrator.commands.common import load_spec_or_exit, plural
from orchestrator.spec.grids import cell_trials, views
from orchestrator.spec.registries import get, resolve_healer
from tasks.catalog import changes_with_draw


def add_parser(sub):
    p = sub.add_parser("validate", help="validate a sweep spec and print its grid size",
                       description="Check SPEC against the registries (models, datasets, pruners, healers, scopes) "
                                   "and the bounds of every field, then print its number of cells and trials (per "
                                   "grid when it has extra grids). Nothing is trained or logged; Ray and MLflow are "
                                   "not started. The verdicts of the model/method checks are cached in "
                                   "./.healsweep/checks (HEALSWEEP_CHECK_CACHE: another directory, or off). A bad "
                                   "spec is one line naming the field, exit code 2.")
    p.add_argument("spec", metavar="SPEC", help="sweep spec (YAML), e.g. configs/tiny.yaml")
    p.set_defaults(func=main)
    return p


def main(args) -> int:
    spec = load_spec_or_exit(args.spec)  # a bad spec is answered in one line (exit 2)
    cells = cell_grids(spec)
    trials, fixed, drawn, per = Counter(), 0, 0, Counter()
    searches = {name: view.search for name, view in views(spec)}
    for grid, healer, redrawn in cells:
        n = cell_trials(searches[grid], spec.search.calib_draws, healer.trains, redrawn)
        trials[grid] += n
        fixed += not healer.trains
        drawn += not healer.trains and n > 1  # closed form, also on each other calibration draw
        per[grid] += 1
    notes = [f"{plural(fixed, 'cell')} whose healer does not train run{'s' * (fixed == 1)} 1 trial"
             + (f", {drawn} of them also once on each of their grid's other calibration draws (it can change them)"
                if drawn else "")] \
        if fixed else []
    notes += _grid_design_notes(searches)
    upto = {g: "up to " if s.converge is not None else "" for g, s in searches.items()}
    total = "up to " if any(upto.values()) else ""  # search.converge: trials_per_cell and re-evaluations are caps
    if total:
        notes.append("search.converge: a cell stops when its search converges, so these are caps")
    notes += _search_notes(searches)
    if spec.search.calib_draws:  # orchestrator/sweep/draws.py: what each draw adds before the trials
        notes.append(f"re-evaluations heal on {spec.search.calib_draws} other calibration draw(s), each with its own "
                     "dense targets and, for pruners that read images, masks")
    note = f" ({'; '.join(notes)})" if notes else ""
    print(f"{args.spec}: ok: {plural(len(cells), 'cell')}, {total}{plural(sum(trials.values()), 'trial')}{note}")
    if spec.grids:
        print("  " + "; ".join(f"grid {g}: {plural(per[g], 'cell')}, {upto[g]}{plural(trials[g], 'trial')}"
                               for g in searches))
    return 0


def _search_notes(searches: dict) -> list[str]:
    """Settings that change the count: ``search.widen`` adds rounds (not counted: how many cells sit on the
    boundary is known only after the search); ``startup_trials`` is TPE's, unused by the other designs."""
    out = []
    for g, s in searches.items():
        where = f"grid {g}: " if len(searches) > 1 else ""
        if s.widen:
            out.append(f"{where}search.widen: up to {s.widen['rounds']} more round(s) of trials for the cells whose "
                       "winner sits on the search boundary, not counted here")
        if s.startup_trials is not None and s.design != "tpe":
            out.append(f"{where}search.startup_trials (TPE's random trials) is not used by design '{s.design}'")
    return list(dict.fromkeys(out))


def _grid_design_notes(searches: dict) -> list[str]:
    """Design ``grid`` runs every lattice point: a ``trials_per_cell`` that differs is not used (said, not refused:
    a grid's search inherits the top level's trials_per_cell)."""
    out = []
    for g, s in searches.items():
        points = s.points
        if s.design == "grid" and s.trials_per_cell != points:
            where = f"grid {g}: " if len(searches) > 1 else ""
            of = "" if points == s.lattice[0] * s.lattice[1] else ": its distinct points"
            out.append(f"{where}design 'grid' runs all {points} lattice points of a cell (search.lattice "
                       f"{s.lattice[0]} x {s.lattice[1]}{of}); search.trials_per_cell {s.trials_per_cell} is not used")
    return out


def cell_grids(spec) -> list[tuple[str, object, bool]]:
    """(grid, healer, whether another calibration draw can change its number) of every cell of the sweep, as
    orchestrator.spec.plan.expand_cells lists them (a cell two grids produce counted once, for the first), from the
    registries' static table: no torch. A spec restricted to ``cells`` (a widening round) needs the cell ids, so it
    is expanded by orchestrator.spec.plan itself."""
    if spec.cells:
        from orchestrator.spec.plan import expand_cells

        return [(c.grid, h := resolve_healer(c.healer, c.healer_settings), changes_with_draw(get("pruner", c.pruner), h))
                for c in expand_cells(spec, defaultdict(str))]
    out, seen = [], set()
    for name, view in views(spec):
        for ident, healer, pruner in _cells(view):
            key = json.dumps(ident, sort_keys=True)  # the identity plan.Cell's id is the content key of
            if key not in seen:
                seen.add(key)
                out.append((name, healer, changes_with_draw(pruner, healer)))
    return out


def _cells(view):
    """(identity, healer, pruner) of each cell of one grid, in orchestrator.spec.plan.grid's order (scopes unresolved: '')."""
    for model in view.models:
        for p in (p for p in view.pruners if p.applies_to(model)):
            pruner = get("pruner", p.name)
            fixed = pruner.fixed_sparsity(p.settings)
            resolved = pruner.resolved_settings(p.settings)
            for s in ([fixed] if fixed is not None else list(p.sparsities or view.sparsities)):
                for n in view.calib_sizes:
                    for h in (h for h in view.healers if h.applies_to(model)):
                        healer = resolve_healer(h.name, h.settings)
                        for seed in view.seeds:
                            yield ([model, p.name, resolved, float(s), pruner.pattern(s, p.settings), p.scope or "", n,
                                    h.name, healer.resolved_settings(h.settings), seed], healer, pruner)
