"""healsweep validate SPEC: check a spec and print its grid size, without running anything."""
from __future__ import annotations

from orchestrator.commands.common import load_spec_or_exit


def add_parser(sub):
    p = sub.add_parser("validate", help="validate a sweep spec and print its grid size")
    p.add_argument("spec")
    p.set_defaults(func=main)
    return p


def main(args) -> int:
    from collections import defaultdict

    from orchestrator.plan import grid
    from tasks.heal import resolve_healer

    spec = load_spec_or_exit(args.spec)
    cells, trials, fixed = 0, 0, 0
    trains = defaultdict(lambda: True)
    for *_, healer, settings, _seed in grid(spec, defaultdict(str)):
        key = (healer, repr(sorted(settings.items())))
        if key not in trains:
            trains[key] = resolve_healer(healer, settings).trains
        cells += 1
        trials += spec.search.trials_per_cell if trains[key] else 1  # healers without training: 1 trial
        fixed += not trains[key]
    note = f" ({fixed} cells whose healer does not train run 1 trial)" if fixed else ""
    print(f"{args.spec}: ok: {cells} cells, {trials} trials{note}")
    return 0
