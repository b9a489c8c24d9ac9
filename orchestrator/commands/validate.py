"""healsweep validate SPEC: check a spec and print its grid size, without running anything."""
from __future__ import annotations

from collections import Counter, defaultdict

from orchestrator.commands.common import load_spec_or_exit


def add_parser(sub):
    p = sub.add_parser("validate", help="validate a sweep spec and print its grid size",
                       description="Check SPEC against the registries (models, datasets, pruners, healers, scopes) "
                                   "and the bounds of every field, then print its number of cells and trials (per "
                                   "grid when it has extra grids). Nothing is trained, computed or logged; Ray and "
                                   "MLflow are not started. A bad spec is one line naming the field, exit code 2.")
    p.add_argument("spec", metavar="SPEC", help="sweep spec (YAML), e.g. configs/tiny.yaml")
    p.set_defaults(func=main)
    return p


def main(args) -> int:

    spec = load_spec_or_exit(args.spec)  # a bad spec is answered before torch is imported

    from orchestrator.spec.plan import expand_cells, grid_searches
    from tasks.healing import resolve_healer

    searches = grid_searches(spec)
    cells = expand_cells(spec, defaultdict(str))  # scopes are not needed to count cells
    trains, trials, fixed = {}, Counter(), 0
    for c in cells:
        key = (c.healer, repr(sorted(c.healer_settings.items())))
        if key not in trains:
            trains[key] = resolve_healer(c.healer, c.healer_settings).trains
        trials[c.grid] += searches[c.grid].per_cell if trains[key] else 1  # no training: 1 trial
        fixed += not trains[key]
    note = f" ({fixed} cells whose healer does not train run 1 trial)" if fixed else ""
    print(f"{args.spec}: ok: {len(cells)} cells, {sum(trials.values())} trials{note}")
    if spec.grids:
        per = Counter(c.grid for c in cells)
        print("  " + "; ".join(f"grid {g}: {per[g]} cells, {trials[g]} trials" for g in searches))
    return 0
