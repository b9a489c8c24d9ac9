"""A search that stops when its answer is stable, and re-evaluations that measure what they quote
(``search.converge``; docs/methods.md#search-design, which also keeps the measurements behind each rule).

Under ``converge`` the ``shared`` design treats ``search.trials_per_cell`` as a per-cell *cap*, not a count. After
the first wave (``explore`` space-filling points) each further wave of a cell (``batch`` points) is decided once
the family's first ``family_waves`` waves and every earlier trial of the cell are told: the surface pools the
family's results of those waves with all of the cell's own, so past them a cell never waits for its family
(a family-wide barrier per wave would serialize a big cluster: benchmarks/bench_slots.py). Deterministic: the
same results give the same decisions whatever order trials finish in. A wave's points:

0. the cell's winner is at the dense model's accuracy (objective ``selection_acc``: within 2 ``min_noise`` of the
   dense model's selection accuracy, which every trial reports): the search of this cell stops ("recovered"):
   nothing left to find beyond the noise floor, whatever edge the winner sits on. Easy cells stop after their
   first wave and the sweep spends its trials on hard ones. The floor, not the fit's noise: the fit's residual
   pools the family's misfit (6.6 pp in tests/e2e/test_converge_e2e.py's sweep), and a winner 8 pp below the
   dense model is not "recovered".
1. the cell's winner (its best told trial) sits on the lr edge of what the cell has tried *at the winner's length*
   and beats the cell's other trials (a tie does not count): nothing says its lr is an optimum until a worse
   point lies beyond it, so the wave is the winner's lr one lattice step further out, same length (the wave's other
   slot runs the design's own pick beside it, ``propose``; a winner alone at its length inside the box has no
   trend to follow). At or past the
   declared box's cap (floor) the box widens automatically: the wave's ``batch`` points reach (D + 1) 2^j steps
   past it (D: the winner's distance past it; ``walk_offsets``), at most ``widen_steps``. There a tie walks too (nothing
   tried past the box is no evidence of an optimum), unless the cell is flat. "Resolved worse", "a tie" and
   "flat" compare the cell's own draws by their binomial noise (sqrt(p (1 - p) / n) of a selection accuracy
   over n images), not by the fit's residual, which pools the family's misfit. The same holds for a plateau: when
   every point the cell tried past its winner on one side, at the winner's length, lies within 2 noise units of the
   winner (none resolved worse) and the cell is not flat (some trial is resolved worse), the wave is one step past
   the plateau's far end: a tie is not evidence of an optimum either.
1b. (decided *before* rule 1) a winner short of the declared healing budget (its length below the length axis's cap)
   with nothing tried longer at its lr or one lattice step from it, in a cell that is not flat (some trial resolved
   worse): the wave is the winner's lr at the budget (its other slot: the design's own pick); the lr walk of rule
   1 follows at the budget's length.
   The family surface pools easy cells, whose optimum length may be short, and would not ask a hard cell for a
   longer trial (two cells of the default spec moved by 16.5 and 22.7 pp between sampler seeds for it, 2026-11-26:
   docs/methods.md).
1c. (``bracket``, on) a walk of rule 1 from a winner alone at its length gives its wave's last slot to the lr
   halfway to the declared box's far end at that length (``bisect_inward``; why: docs/methods.md#search-design).
2. otherwise the family surface (``lattice.surface``) is fitted to the family's told trials over the declared
   lattice and every lr the family tried past it; the best untried point's predicted gain over the winner's point
   is compared with the winner's noise (the fit's residual std of one draw, at least ``min_noise``): no gain
   beyond the noise -> the search of this cell stops ("converged"); else that point is the cell's next trial;
3. a cell that reaches the cap stops ("cap"). The length axis is never widened: its cap is the declared healing
   budget, and a winner there is "within N optimizer steps", not under-tuned.

Re-evaluations: ``search.reevaluate`` fresh seeds first; once they are told, the cell gets
ceil((sd / se_target)^2) seeds in all (sd: their sample std), between ``reevaluate`` and ``reevaluate_max``:
more where the spread is large, none extra where it is small. The extra seeds are asked together (no serial
chain). Every decision is written to the cell's study (user attrs ``stop_reason``, ``reevaluate_target``,
``lr_range``) for the report (analysis/search_stops.py).
"""
from __future__ import annotations

import math

import numpy as np
from optuna.distributions import FloatDistribution
from optuna.trial import TrialState

from orchestrator.search import lattice
from orchestrator.search.base import CEILING, N_SELECTION, REEVALUATE, SEARCH, _Slot
from orchestrator.spec.schema import Converge

CONVERGED, RECOVERED, CAP, NO_RESULT = "converged", "recovered", "cap", "no finished trial"


def walk_offsets(past_by: int, batch: int, limit: int, growth: int) -> list[int]:
    """Lattice steps from a winner ``past_by`` steps past the declared box (0: on its edge) to the points of its
    next wave: distances past the box (D + 1) * growth**j, j < batch, clipped at ``limit`` (growth 1: D + 1, …,
    D + batch, dropped past the limit). E.g. D 0 -> steps 1, 2; D 2 -> 1, 4 (reach 3, 6); the limit in 2 waves."""
    d, n = past_by, max(1, batch)
    if growth <= 1:
        return [k for k in range(1, n + 1) if d + k <= limit]
    reach = sorted({min((d + 1) * growth**j, limit) for j in range(n)})
    return [r - d for r in reach if r > d]


def bisect_inward(w: int, d: int, same: list[int], a: int) -> int | None:
    """Rule 1c: the lr index halfway from a winner ``w`` walking in direction ``d``, alone at its length (``same``:
    lr indices tried there), to the box's far end; None if anything else was tried there or the gap is one step."""
    gap = abs(w - (a - 1 if d < 0 else 0))
    return w - d * ((gap + 1) // 2) if gap >= 2 and all(i == w for i in same) else None


class Converging:
    """Mixed into ``SharedDesign``: cells whose budget has ``converge`` stop by the rules above."""

    def conv(self, cell_id: str) -> Converge | None:
        return None if cell_id in self.fixed else self.budgets[cell_id].converge

    def reevaluations_of(self, cell_id: str) -> int:
        c = self.conv(cell_id)
        base = super().reevaluations_of(cell_id)
        return base if c is None else c.reevaluations(base)

    # ------------------------------------------------------------------ waves
    def wave_of(self, cell_id: str, number: int) -> int:
        c = self.conv(cell_id) if cell_id in self.budgets else None
        if c is None:
            return super().wave_of(cell_id, number)
        e = self.explore(cell_id)
        return 0 if number < e else (number - e) // max(1, c.batch) + 1

    def priority(self, slot: _Slot) -> int:
        """Chains first: a converging cell's next wave, then first waves (new chains), then re-evaluations, then
        cells that do not converge (closed form: one trial) fill what is left."""
        if self.conv(slot.cell_id) is None:
            return 0
        return (3 if slot.wave >= 1 else 2) if slot.stage == SEARCH else 1

    def wave_start(self, cell_id: str, wave: int) -> int:
        """The trial number a wave's first trial gets."""
        return 0 if wave == 0 else self.explore(cell_id) + (wave - 1) * max(1, self.conv(cell_id).batch)

    def can_decide(self, cell_id: str, wave: int) -> bool:
        """The family's first ``family_waves`` waves (before ``wave``) and every earlier trial of the cell are told:
        a cell past the pooled waves no longer waits for its family (no family-wide barrier per wave)."""
        fam, c = self.family(cell_id), self.conv(cell_id)
        if not all(self.done((fam, w)) for w in range(min(wave, c.family_waves))):
            return False
        return self.n_trials(cell_id) >= self.wave_start(cell_id, wave) and self.counts.settled((cell_id, SEARCH))

    def evidence(self, cell_id: str, before_wave: int):
        """The family's told trials of its pooled waves, and the cell's own of every wave before ``before_wave``."""
        c = self.conv(cell_id)
        return super().evidence(cell_id, before_wave, None if c is None else c.family_waves)

    # ------------------------------------------------------------------ lattice past the declared box
    def lr_at(self, cell_id: str, i: int) -> float:
        lo, hi = self.budgets[cell_id].lr
        a = self.budgets[cell_id].lattice[0]
        if 0 <= i < a or a < 2 or lo == hi:
            return self.axes(cell_id)[0][min(max(i, 0), a - 1)]
        return float(f"{lo * (hi / lo) ** (i / (a - 1)):.6g}")

    def space(self, cell_id: str) -> dict:
        """The declared space with lr reaching ``widen_steps`` lattice steps past both ends (a widened point must
        lie inside its study's distribution, or Optuna would draw instead of taking it)."""
        out = super().space(cell_id)
        c, a = self.conv(cell_id), self.budgets[cell_id].lattice[0]
        if c is not None and c.widen_steps and a > 1 and "lr" in out:
            out["lr"] = FloatDistribution(self.lr_at(cell_id, -c.widen_steps) * (1 - 1e-9),
                                          self.lr_at(cell_id, a - 1 + c.widen_steps) * (1 + 1e-9), log=True)
        return out

    def point(self, cell_id: str, p: tuple[int, int]) -> dict:
        out = super().point(cell_id, (min(max(p[0], 0), self.sizes(cell_id)[0] - 1), p[1]))
        return {**out, "lr": self.lr_at(cell_id, p[0])}

    def index(self, cell_id: str, params) -> tuple[int, int]:
        i, j = super().index(cell_id, params)
        lo, hi = self.budgets[cell_id].lr
        a = self.budgets[cell_id].lattice[0]
        if a > 1 and hi > lo and self.conv(cell_id) is not None:
            i = int(round(math.log(float(params["lr"]) / lo) / math.log(hi / lo) * (a - 1)))  # may lie past the box
        return i, j

    # ------------------------------------------------------------------ decisions
    def decide(self, cell_id: str, wave: int) -> tuple[str | None, list[tuple[int, int]] | None]:
        """(stop reason or None, the wave's lattice points or None) for the cell's trials of ``wave`` (>= 1)."""
        key = (cell_id, wave)
        if key not in self._decisions:
            self._decisions[key] = self._decide(cell_id, wave)
        return self._decisions[key]

    def _decide(self, cell_id: str, wave: int) -> tuple[str | None, list[tuple[int, int]] | None]:
        c = self.conv(cell_id)
        tried = set(self.tried(cell_id))
        best = self.winner(cell_id)
        if best is None:
            return None, None  # every trial failed so far: the design's own ranking picks (propose)
        w = self.index(cell_id, best.params)
        surf, lo, sd = self.fit(cell_id, *self.evidence(cell_id, wave))
        noise = c.min_noise if math.isnan(sd) else max(sd, c.min_noise)
        free = [(p[0] + lo, p[1]) for p in lattice.ranked(surf) if (p[0] + lo, p[1]) not in tried]
        top = self._ceiling(cell_id)
        if top is not None and best.value >= top - 2 * c.min_noise:  # rule 0 (the floor: not the fit's noise)
            return (f"{RECOVERED}: the winner ({100 * best.value:.2f} %) is within 2 x min_noise "
                    f"({200 * c.min_noise:.2f} pp) of the dense model ({100 * top:.2f} %)"), None
        out, widening = self._longer(cell_id, w, tried, noise), False  # rule 1b first: the budget, then the lr walk
        if not out:
            out, widening = self._outward(cell_id, w, tried, noise)
        if out:  # widening the box: the surface fills the wave; a step inside it: the design's pick fills it (propose)
            return None, out + ([p for p in free if p not in out][:max(1, c.batch) - len(out)] if widening else [])
        if not free:
            return CONVERGED + ": every lattice point tried", None
        gain = float(surf[free[0][0] - lo, free[0][1]] - surf[w[0] - lo, w[1]])
        if gain <= noise and not math.isnan(sd) and self._may_stop(cell_id, c):
            return (f"{CONVERGED}: no untried point predicted better than the winner by more than its noise "
                    f"(+{100 * max(gain, 0):.2f} <= {100 * noise:.2f} pp)"), None
        return None, free[:max(1, c.batch)]

    def fit(self, cell_id: str, pts, vals, groups) -> tuple[np.ndarray, int, float]:
        """The family surface over the declared lattice and every lr the evidence tried past it -> (surface, the lr
        index of its first row (<= 0), the std of one draw around it: ``residual_sd``)."""
        a = self.sizes(cell_id)[0]
        lo, hi = min([0] + [p[0] for p in pts]), max([a - 1] + [p[0] for p in pts])
        sizes = (hi - lo + 1, self.sizes(cell_id)[1])
        shifted = [(p[0] - lo, p[1]) for p in pts]
        return lattice.surface(shifted, vals, groups, sizes), lo, lattice.residual_sd(shifted, vals, groups, sizes)

    def _may_stop(self, cell_id: str, c: Converge) -> bool:
        """A cell stops on the surface only after a wave the surface chose, or when its own first-wave results are
        flat (within 2 ``min_noise``) and as good as the family's best first-wave result (every point recovers).
        Measured 2026-11-26 on the default spec: the family
        surface, pooled over sparsities whose optima differ, let hard cells stop after 2 bad first-wave points
        (ResNet uniform 0.95: 17 % and 8 %, where a third point gave 85 %)."""
        own = self._values(cell_id)
        if len(own) > self.explore(cell_id):
            return True
        _, vals, _ = self.evidence(cell_id, 1)  # the family's first wave (told: deterministic)
        top = max(vals, default=-math.inf)
        return bool(own) and max(own) - min(own) <= 2 * c.min_noise and max(own) >= top - 2 * c.min_noise

    def _outward(self, cell_id: str, w: tuple[int, int], tried: set, noise: float
                 ) -> tuple[list[tuple[int, int]], bool]:
        """Points lr steps past the winner ``w`` (same length, within ``widen_steps`` of the box) -> (points, whether
        past the box). Two cases (module docstring, rule 1):

        - ``w`` sits on the lr edge of what the cell tried at its length (with another trial at that length, or at
          the declared box's cap or floor) and beats every other trial of the cell (a tie does not walk; on the
          box's cap or floor with nothing tried past it, a tie walks too unless the cell is flat): past the box
          1, 2, …, ``batch`` steps out, inside it one step;
        - a plateau: every point the cell tried past ``w`` on one side at its length is within 2 ``noise`` of it
          (none resolved worse) while some trial of the cell is resolved worse (the cell is not flat): one step
          past the farthest of them."""
        c, a = self.conv(cell_id), self.sizes(cell_id)[0]
        sign = 1.0 if self.direction == "maximize" else -1.0
        done = [t for t in self.study(cell_id).get_trials(deepcopy=False) if t.value is not None and t.params]
        at: dict[tuple[int, int], list[float]] = {}
        for t in done:
            at.setdefault(self.index(cell_id, t.params), []).append(sign * t.value)
        others = [v for p, vs in at.items() if p != w for v in vs]
        best = max(at[w])
        if a < 2:
            return [], False
        worse = self._worse(cell_id, noise)
        same = sorted({p[0] for p in tried if p[1] == w[1]})  # lr indices the cell tried at the winner's length
        lo, hi = -c.widen_steps, a - 1 + c.widen_steps
        beats = not others or best > max(others)  # a tie (a flat cell): being on the edge is not what makes the winner
        shaped = any(worse(best, v) for v in others)  # not flat: some trial resolved worse than the winner
        for d, edge, past in ((1, same[-1], w[0] >= a - 1), (-1, same[0], w[0] <= 0)):
            if not (beats or (past and shaped and not any((p[0] - w[0]) * d > 0 for p in tried))):
                continue  # a tie inside the box; on the box's edge a tie walks too, unless the cell is flat
            if w[0] != edge or (len(same) < 2 and not past):
                continue  # not on that edge; or alone at its length inside the box: no trend to follow (the surface)
            # past the box: a wave of ``batch`` points reaching further out (the surface fills it); inside, one step
            ks = walk_offsets(d * (w[0] - (a - 1 if d > 0 else 0)), c.batch, c.widen_steps, c.widen_growth) if past else [1]
            out = [p for p in ((w[0] + k * d, w[1]) for k in ks) if lo <= p[0] <= hi and p not in tried]
            back = bisect_inward(w[0], d, same, a) if c.bracket and out and c.batch > 1 else None  # rule 1c
            return (out if back is None else out[:c.batch - 1] + [(back, w[1])]), past
        if not shaped:
            return [], False  # nothing resolved worse anywhere: a flat cell, the surface decides
        for d in (1, -1):
            side = [i for i in same if (i - w[0]) * d > 0 and (i, w[1]) in at]
            if side and not any(worse(best, float(np.mean(at[(i, w[1])]))) for i in side):
                step = (max(side, key=lambda i: i * d) + d, w[1])  # past the plateau's far end
                if lo <= step[0] <= hi and step not in tried:
                    return [step], not 0 <= step[0] <= a - 1
        return [], False

    def _ceiling(self, cell_id: str) -> float | None:
        """The dense model's value of the objective, as the cell's told trials reported it (rule 0); None when
        they did not (another objective, a sweep from before the record) or the objective is minimized."""
        tops = [t.user_attrs[CEILING] for t in self.study(cell_id).get_trials(deepcopy=False) if CEILING in t.user_attrs]
        return max(tops) if tops and self.direction == "maximize" else None

    def _values(self, cell_id: str) -> list[float]:
        """The cell's told search results, larger = better whatever the direction."""
        sign = 1.0 if self.direction == "maximize" else -1.0
        return [sign * t.value for t in self.study(cell_id).get_trials(deepcopy=False) if t.value is not None]

    def _longer(self, cell_id: str, w: tuple[int, int], tried: set, noise: float) -> list[tuple[int, int]]:
        """Rule 1b: the winner ``w`` short of the declared healing budget (the length axis's cap), nothing tried
        longer within one lr lattice step of it, in a cell that is not flat (some trial resolved worse than ``w``
        by > 2 ``noise``) -> [the winner's lr at the budget]; else []."""
        b = self.sizes(cell_id)[1]
        if w[1] >= b - 1 or any(abs(p[0] - w[0]) <= 1 and p[1] > w[1] for p in tried):
            return []
        vals, worse = self._values(cell_id), self._worse(cell_id, noise)
        return [(w[0], b - 1)] if vals and any(worse(max(vals), v) for v in vals) else []

    def _worse(self, cell_id: str, noise: float, z: float = 2.0):
        """-> worse(a, b): result ``b`` of the cell resolved worse than its result ``a`` (a - b > ``z`` noise units
        of the difference; larger = better). A draw's noise: the binomial std sqrt(p (1 - p) / n) of a selection
        accuracy over its ``N_SELECTION`` images, at least ``min_noise``; without that record (another objective,
        an older sweep) the fit's ``noise``, which pools the family's misfit (module docstring, rule 1)."""
        c = self.conv(cell_id)
        ns = [t.user_attrs[N_SELECTION] for t in self.study(cell_id).get_trials(deepcopy=False)
              if N_SELECTION in t.user_attrs]
        if not ns or self.direction != "maximize":
            return lambda a, b: a - b > z * noise
        n = float(max(ns))
        return lambda a, b: lattice.resolved_worse(a, b, n, c.min_noise, z)

    def propose(self, cell_id: str, number: int, wave: int) -> dict:
        if wave == 0 or self.conv(cell_id) is None:
            return super().propose(cell_id, number, wave)
        _, pts = self.decide(cell_id, wave)
        k = number - self.wave_start(cell_id, wave)
        if pts and k < len(pts):
            return self.point(cell_id, pts[k])
        return super().propose(cell_id, number, wave)

    # ------------------------------------------------------------------ the queue: dropping what is not needed
    def settle(self) -> None:
        """Decide what the waits that are over allow: stop cells whose search converged, size re-evaluations."""
        if not self.converging:
            return
        seen: set = set()
        for slot in list(self.queue):
            cid = slot.cell_id
            if slot.number is not None or (cid, slot.stage) in seen or self.conv(cid) is None:
                continue
            if slot.stage == SEARCH and slot.wave >= 1 and self.can_decide(cid, slot.wave):
                seen.add((cid, SEARCH))  # the cell's first new search slot: the next wave
                reason, _ = self.decide(cid, slot.wave)
                if reason is not None:
                    self._stop(cid, reason)
            elif slot.stage == REEVALUATE and self._search_done(cid):
                seen.add((cid, REEVALUATE))
                self._stop(cid, None)
                self._size_reevaluations(cid)

    @property
    def converging(self) -> bool:
        if not hasattr(self, "_any_conv"):
            self._any_conv = any(self.conv(c) is not None for c in self.cells)
        return self._any_conv

    def _drop(self, cell_id: str, stage: str, keep: int = 0) -> int:
        """Remove the cell's new slots of ``stage`` from the queue but the first ``keep`` -> slots removed."""
        mine = [s for s in self.queue if s.cell_id == cell_id and s.stage == stage and s.number is None][keep:]
        gone = {id(s) for s in mine}
        self.queue[:] = [s for s in self.queue if id(s) not in gone]
        for s in mine:
            self._unasked_add(s, -1)
        self.dropped += len(mine)
        return len(mine)

    def _in_wave(self, slot: _Slot) -> bool:
        """A later slot of a wave whose first slot was asked already (the wave's points were decided together)."""
        n = self.n_trials(slot.cell_id)
        return self.wave_start(slot.cell_id, slot.wave) < n < self.wave_start(slot.cell_id, slot.wave + 1)

    def _stop(self, cell_id: str, reason: str | None) -> None:
        """Record why the cell's search stopped (once); None: it ran out of slots (the cap)."""
        if cell_id in self.stops:
            return
        self._drop(cell_id, SEARCH)
        study = self.study(cell_id)
        n = len(study.get_trials(deepcopy=False))
        self.stops[cell_id] = reason or (f"{CAP} ({n} trials)" if any(
            t.state == TrialState.COMPLETE for t in study.get_trials(deepcopy=False)) else NO_RESULT)
        lrs = [self.index(cell_id, t.params)[0] for t in study.get_trials(deepcopy=False) if t.params]
        study.set_user_attr("stop_reason", self.stops[cell_id])
        study.set_user_attr("search_trials", n)
        if lrs:
            study.set_user_attr("lr_range", [self.lr_at(cell_id, min(lrs)), self.lr_at(cell_id, max(lrs))])

    def _size_reevaluations(self, cell_id: str) -> None:
        """Once the first ``reevaluate`` re-evaluations are told: keep as many extra slots as the SE target needs."""
        if cell_id in self.reeval_target:
            return
        base = super().reevaluations_of(cell_id)
        study = self.study(cell_id, REEVALUATE)
        trials = study.get_trials(deepcopy=False)
        if len(trials) < base or any(t.state not in (TrialState.COMPLETE, TrialState.FAIL, TrialState.PRUNED)
                                     for t in trials) or not self.counts.settled((cell_id, REEVALUATE)):
            return  # the first seeds are not all told yet
        vals = [t.value for t in trials if t.state == TrialState.COMPLETE]
        c = self.conv(cell_id)
        sd = float(np.std(vals, ddof=1)) if len(vals) > 1 else math.inf
        want = c.reevaluate_max if not math.isfinite(sd) else math.ceil((sd / c.se_target) ** 2)
        target = min(max(want, base), c.reevaluate_max)
        self.reeval_target[cell_id] = target
        self._drop(cell_id, REEVALUATE, keep=max(0, target - len(trials)))
        study.set_user_attr("reevaluate_target", target)

    def ready(self, slot: _Slot) -> bool:
        if slot.stage == SEARCH and slot.number is None and slot.wave >= 1 and self.conv(slot.cell_id) is not None:
            return self.can_decide(slot.cell_id, slot.wave) or self._in_wave(slot)
        if (slot.stage == REEVALUATE and slot.number is None and self.conv(slot.cell_id) is not None
                and slot.cell_id not in self.reeval_target
                and self.n_trials(slot.cell_id, REEVALUATE) >= super().reevaluations_of(slot.cell_id)):
            return False  # an extra seed waits for the first ones (how many it takes depends on their spread)
        return super().ready(slot)
