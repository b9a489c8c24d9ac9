"""Which configuration a converged cell quotes (``search.converge.pick``; docs/methods.md#search-design, rule 4).

The search's ``winner`` is the cell's best draw. Among draws within noise of each other that is mostly the luckiest
one, and on a plateau of ties it is an edge as often as not. Measured 2026-11-29 (benchmarks/results/
retest_default_2026-11-29_bracket.*): grid ``healers``' largest move between sampler seeds (STARFISH-KL at 0.85,
seed 1: 3.29 pp) was a flat cell whose first of two tied 95.0 % draws won (4 epochs, alone at its length) and
re-evaluated at 83-94 %; and 3 of run B's 7 edge winners in that grid sat at the end of a plateau of ties (KL at
0.9, seed 0: lr 7.6e-3 .. 2.1e-2 at 93.3-93.9 %, the winner the last by one draw; it re-evaluated at 88.0 %).

With ``pick`` on (the default) the cell quotes the *centre of its best plateau*: at the length of its best point
(exact ties between best points: the length whose plateau is longest, then the cheaper), the run of points (in lr
order, each its mean over its draws) within one noise unit of the best (the binomial noise of rule 1: indistinct
from it, a tighter test than "resolved worse" at 2 units, which at 180 images spans 5-10 pp) around it, and of
that run its middle point (``lattice.plateau_centre``; a run of 2 keeps the best). ``pick: 0`` quotes the best draw.
The search's own decisions (converge.py) still follow the best draw.
"""
from __future__ import annotations

from optuna.trial import TrialState

from orchestrator.search import lattice
from orchestrator.search.base import N_SELECTION
from orchestrator.search.converge import Converging


class Picking(Converging):
    """Mixed into ``SharedDesign``: ``pick`` under ``search.converge`` (module docstring)."""

    def pick(self, cell_id: str):
        best = self.winner(cell_id)
        c = self.conv(cell_id) if cell_id in self.budgets else None
        if best is None or c is None or not c.pick or self.direction != "maximize":
            return best
        done = [t for t in self.study(cell_id).get_trials(deepcopy=False) if t.state == TrialState.COMPLETE]
        if not any(N_SELECTION in t.user_attrs for t in done):
            return best  # no draw noise on record (another objective, an older sweep)
        at: dict[tuple[int, int], list] = {}
        for t in done:
            at.setdefault(self.index(cell_id, t.params), []).append(t)
        worse = self._worse(cell_id, c.min_noise, z=1.0)  # tied: within one noise unit of the best
        chosen = lattice.plateau_pick({k: sum(t.value for t in ts) / len(ts) for k, ts in at.items()},
                                      {k: min(t.number for t in ts) for k, ts in at.items()},
                                      lambda top, v: not worse(top, v))
        return max(at[chosen], key=lambda t: (t.value, -t.number))
