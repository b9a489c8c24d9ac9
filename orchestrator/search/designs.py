"""The registered search designs (``search.design``): ``shared`` (the default), ``tpe`` and ``grid``.

- ``shared``: a lattice over (lr, length); a first wave of space-filling points per cell (one scrambled Sobol
  sequence per family: cells of one grid, model and healer), then waves in which every cell tries the lattice
  point the *family's* evidence ranks best that it has not tried yet (a quadratic fitted to every cell's results
  with a level per cell: lattice.surface). A cell's answer is still its own best trial; the family only decides where it
  looks. A wave waits for the family's earlier waves (reproducible: the same results give the same asks).
- ``tpe``: the previous default: every cell its own TPE study (random start-up, then TPE), continuous space.
- ``grid``: every lattice point in every cell: the oracle of benchmarks/bench_regret.py.
"""
from __future__ import annotations

import math
from typing import Any, Mapping

import optuna
from optuna.trial import TrialState

from orchestrator.search import lattice
from orchestrator.search.base import SEARCH, Budget, SearchDesign, _Slot, cell_sampler_seed
from orchestrator.search.pick import Picking
from orchestrator.search.registry import DESIGNS


class _LatticeDesign(SearchDesign):
    """Designs whose points lie on the budget's lattice."""

    def axes(self, cell_id: str) -> tuple[list[float], list[float]]:
        b: Budget = self.budgets[cell_id]
        name, (lo, hi) = b.length
        return lattice.log_axis(b.lr[0], b.lr[1], b.lattice[0]), lattice.log_axis(lo, hi, b.lattice[1], integer=True)

    def sizes(self, cell_id: str) -> tuple[int, int]:
        a, b = self.axes(cell_id)
        return len(a), len(b)

    def point(self, cell_id: str, p: tuple[int, int]) -> dict:
        lrs, lengths = self.axes(cell_id)
        return {"lr": lrs[p[0]], self.budgets[cell_id].length[0]: int(lengths[p[1]])}

    def index(self, cell_id: str, params: Mapping[str, Any]) -> tuple[int, int]:
        """The lattice point nearest (in log space) to a trial's parameters."""
        lrs, lengths = self.axes(cell_id)
        length = float(params.get(self.budgets[cell_id].length[0], lengths[0]))

        def near(axis, v):
            return min(range(len(axis)), key=lambda i: abs(math.log(axis[i]) - math.log(max(v, 1e-30))))
        return near(lrs, float(params["lr"])), near(lengths, length)

    def tried(self, cell_id: str) -> list[tuple[int, int]]:
        return [self.index(cell_id, t.params) for t in self.study(cell_id).get_trials(deepcopy=False) if t.params]


@DESIGNS.register("grid")
class GridDesign(_LatticeDesign):
    """Every lattice point in every cell, lr-major: the exhaustive oracle (costly by construction)."""

    name = "grid"

    def trials_of(self, cell_id: str) -> int:
        if cell_id in self.fixed:
            return 1
        a, b = self.sizes(cell_id)  # the distinct points (equal bounds, integer lengths rounding together: fewer)
        return a * b

    def propose(self, cell_id: str, number: int, wave: int) -> dict:
        a, b = self.sizes(cell_id)
        return self.point(cell_id, (number // b % a, number % b))


@DESIGNS.register("tpe")
class TPEDesign(SearchDesign):
    """Per-cell TPE (cells never share history): a seeded random start-up, then TPE. A cell's trial past the
    start-up waits until the cell's earlier trials are told (not under ASHA, whose stops depend on timing)."""

    name = "tpe"

    def startup(self, cell_id: str) -> int:
        b = self.budgets[cell_id]
        return b.startup_trials or max(1, min(10, b.trials // 2))

    def sampler(self, cell_id: str, number: int) -> optuna.samplers.BaseSampler:
        return optuna.samplers.TPESampler(seed=cell_sampler_seed(self.sampler_seed, cell_id, number),
                                          n_startup_trials=self.startup(cell_id))

    def ready(self, slot: _Slot) -> bool:
        if slot.stage != SEARCH or slot.number is not None or slot.cell_id in self.fixed or self.asha:
            return super().ready(slot)
        if self.n_trials(slot.cell_id) < self.startup(slot.cell_id):
            return True  # seeded random start-up: independent of the history
        return self.counts.settled((slot.cell_id, SEARCH))


class _Shared(_LatticeDesign):
    """Space-filling first wave, then family-ranked lattice points (module docstring; docs/methods.md#search-design)."""

    name = "shared"

    def __init__(self, *a, **kw) -> None:
        self._first: dict[tuple, dict[str, list[tuple[int, int]]]] = {}  # family -> cell -> first-wave points
        self._decisions: dict = {}  # (cell, wave) -> (stop reason, next point): search.converge (converge.py)
        self.stops: dict[str, str] = {}  # cell -> why its search stopped (converge)
        self.reeval_target: dict[str, int] = {}  # cell -> re-evaluations it gets (converge)
        super().__init__(*a, **kw)

    def explore(self, cell_id: str) -> int:
        b = self.budgets[cell_id]
        return max(1, min(b.explore, b.trials))

    def wave_of(self, cell_id: str, number: int) -> int:
        e = self.explore(cell_id) if cell_id in self.budgets else 1
        return 0 if number < e else number - e + 1

    def members(self, family: tuple) -> list[str]:
        return [c for c in self.cells if c not in self.fixed and self.family(c) == family]

    def ready(self, slot: _Slot) -> bool:
        if slot.stage != SEARCH or slot.number is not None or slot.wave == 0:
            return super().ready(slot)
        fam = self.family(slot.cell_id)
        return all(self.done((fam, w)) for w in range(slot.wave))  # the family's earlier waves are told

    def first_wave(self, cell_id: str) -> list[tuple[int, int]]:
        fam = self.family(cell_id)
        if fam not in self._first:
            cells = self.members(fam)
            k = self.explore(cell_id)
            pts = lattice.sobol_points(k * len(cells), self.sizes(cell_id),
                                       cell_sampler_seed(self.sampler_seed, repr(fam)) % (2 ** 32))
            self._first[fam] = {c: lattice.distinct(pts[i * k:(i + 1) * k], self.sizes(cell_id))
                                for i, c in enumerate(cells)}
        return self._first[fam][cell_id]

    def evidence(self, cell_id: str, before_wave: int,
                 others_before: int | None = None) -> tuple[list[tuple[int, int]], list[float], list[str]]:
        """The family's completed search trials of waves before ``before_wave`` (the family's other cells: before
        ``others_before`` when given, e.g. only the pooled waves of ``search.converge``): lattice points, objective
        values (signed so that larger is better) and their cells."""
        sign = 1.0 if self.direction == "maximize" else -1.0
        pts, vals, groups = [], [], []
        for c in self.members(self.family(cell_id)):
            limit = before_wave if c == cell_id or others_before is None else min(before_wave, others_before)
            for t in self.study(c).get_trials(deepcopy=False, states=(TrialState.COMPLETE,)):
                if self.wave_of(c, t.number) < limit:
                    pts.append(self.index(c, t.params))
                    vals.append(sign * float(t.value))
                    groups.append(c)
        return pts, vals, groups

    def propose(self, cell_id: str, number: int, wave: int) -> dict:
        if wave == 0:
            return self.point(cell_id, self.first_wave(cell_id)[number])
        surf = lattice.surface(*self.evidence(cell_id, wave), self.sizes(cell_id))
        tried = set(self.tried(cell_id))
        best = next((p for p in lattice.ranked(surf) if p not in tried), None)
        if best is None:  # every lattice point tried already: repeat the family's best (a new healing draw)
            best = lattice.ranked(surf)[0]
        return self.point(cell_id, best)


@DESIGNS.register("shared")
class SharedDesign(Picking, _Shared):
    """``_Shared``; with ``search.converge`` its cells stop when their search converges (converge.py)."""
