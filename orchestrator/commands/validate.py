"""healsweep validate SPEC: check a spec and print its grid size, without running anything."""
from __future__ import annotations

from orchestrator.commands.common import load_spec_or_exit


def add_parser(sub):
    p = sub.add_parser("validate", help="validate a sweep spec and print its grid size")
    p.add_argument("spec")
    p.set_defaults(func=main)
    return p


def main(args) -> int:
    from tasks.pruners import PRUNERS

    spec = load_spec_or_exit(args.spec)
    n = sum(1 if PRUNERS.get(p.name).fixed_sparsity(p.settings) is not None else len(spec.sparsities)
            for p in spec.pruners)
    cells = len(spec.models) * n * len(spec.calib_sizes) * len(spec.healers) * len(spec.seeds)
    from tasks.heal import resolve_healer

    fixed = sum(not resolve_healer(h.name, h.settings).trains for h in spec.healers)  # 1 trial per cell (none)
    trials = cells * spec.search.trials_per_cell - cells // len(spec.healers) * fixed * (spec.search.trials_per_cell - 1)
    note = f" ({fixed} healer(s) without training run 1 trial per cell)" if fixed else ""
    print(f"{args.spec}: ok: {cells} cells x {spec.search.trials_per_cell} trials = {trials} trials{note}")
    return 0
