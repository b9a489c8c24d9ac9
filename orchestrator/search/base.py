"""The search contract: what a search design does for a sweep, and what every design shares.

A design decides, for every grid cell, which (lr, training length) configurations to heal, in what order, and
which of them is the cell's answer. It speaks to the sweep through four calls (the contract; tests/orchestrator/
test_search_contract.py runs one suite over every registered design):

- ``ask()`` -> the next ``Ask`` (a cell, a trial number, its parameters, its stage), ``None`` (everything left
  waits for results: ask again later) or ``FINISHED``;
- ``tell(ask, value, state)``: the trial's objective (``state`` COMPLETE, PRUNED or FAIL);
- re-evaluation: once every search trial of a cell is told, the design asks ``reevaluate`` more trials of the
  cell's winner, each on a fresh healing seed (``Ask.stage == "reevaluate"``); the report quotes their mean and
  spread, never the luckiest draw of the search (docs/methods.md#search-design);
- ``noise()``: per cell, the winner's search value, the re-evaluations' mean, spread and count.

Everything durable lives in the Optuna journal: one study per cell for its search trials, named so a person finds
the cell in optuna-dashboard, and one ``… · reevaluate`` study per cell for the re-evaluations (their healing
seeds are trial user attributes). A design built over an existing journal never runs a told trial again and
re-runs asked-but-untold ones with the same parameters (resume). Asks are deterministic: the same spec, seed and
results give the same trials whatever order trials finish in (each design's ``ready`` enforces that).
"""
from __future__ import annotations

import math
import threading
from pathlib import Path
from typing import Any, Mapping

import optuna
from optuna.distributions import FloatDistribution, IntDistribution
from optuna.trial import TrialState

from orchestrator.spec.checks import MAX_REEVALUATE  # noqa: F401 - the bound lives with the spec's checks
from orchestrator.search.records import (
    CEILING,
    DONE,
    FINISHED,
    N_SELECTION,
    REEVALUATE,
    SEARCH,
    Ask,
    Budget,
    _Counts,
    _Slot,
    cell_sampler_seed,
    fixed_cell,
    journal_cells,
    open_journal,
    reevaluation_seeds,
    resolve_epochs,
    study_label,
)

class SearchDesign:
    """The shared machinery; a design overrides ``propose`` (and ``ready`` / ``sampler`` where it needs)."""

    name = ""
    ordered = True  # asks wait for the results they depend on (reproducible); False only under ASHA
    converging = False  # True: some cell's count is a cap (search.converge), and ``dropped`` grows as cells stop
    dropped = 0  # planned slots a converging design removed from the queue (a stopped search, fewer seeds)

    def __init__(self, cells: list[Mapping[str, Any]], budgets: Mapping[str, Budget], sampler_seed: int,
                 journal: Path, *, direction: str = "maximize", asha: bool = False,
                 redraws: Mapping[str, int] | None = None) -> None:
        self.cells = {c["cell_id"]: dict(c) for c in cells}
        self.budgets = dict(budgets)
        self.sampler_seed, self.direction, self.asha = sampler_seed, direction, asha
        self.fixed = {cid for cid, c in self.cells.items() if fixed_cell(c)}
        # search.calib_draws: closed-form cell -> the other draws it heals on once each (those another draw can
        # change: records.redrawn_cell); their re-evaluations (tune.py moves each onto its draw)
        self.redraws = {cid: int(n) for cid, n in (redraws or {}).items() if cid in self.fixed}
        self.storage = open_journal(journal)
        self._studies: dict[tuple[str, str], optuna.Study] = {}
        self.counts = _Counts()  # per (cell, stage) and per (family, wave): a key is settled when all told
        self.rerun: list[str] = []
        self.already_done = 0
        self._known = journal_cells(self.storage)  # studies of a resumed sweep
        self._families: dict[str, tuple] = {}
        self._told, self._idle_at = 0, -1  # tells written; the value when a scan last found nothing ready (ask)
        self._lock = threading.RLock()  # an ask sees one state: tells (the writer's thread) wait for it (ask)
        self._counted: dict[tuple[str, str], int] = {}  # trials per study, read once per scan (n_trials)
        self.unasked: dict = {}  # (cell, stage) / (family, wave) -> slots not asked yet
        self.queue = self._plan()
        self.planned = len(self.queue)  # Tune's num_samples: every trial this session runs

    def __getstate__(self) -> dict:  # Tune pickles the searcher with the Tuner
        return {k: v for k, v in self.__dict__.items() if k != "_lock"}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._lock = threading.RLock()

    # ------------------------------------------------------------------ studies
    def study(self, cell_id: str, stage: str = SEARCH) -> optuna.Study:
        key = (cell_id, stage)
        if key not in self._studies:
            name = study_label(self.cells[cell_id]) + (" · reevaluate" if stage == REEVALUATE else "")
            known = self._known.get(cell_id, {}).get(stage)
            if known is not None:  # an existing study (an older sweep's is named by the cell id)
                name = self.storage.get_study_name_from_id(known)
            study = optuna.create_study(study_name=name, storage=self.storage, sampler=self.sampler(cell_id, 0),
                                        direction=self.direction, load_if_exists=True)
            if known is None:
                study.set_user_attr("cell_id", cell_id)
                study.set_user_attr("stage", stage)
                study.set_user_attr("design", self.name)
                study.set_user_attr("sampler_seed", self.sampler_seed)
            self._studies[key] = study
        return self._studies[key]

    def n_trials(self, cell_id: str, stage: str = SEARCH) -> int:
        """Trials the cell's study of ``stage`` holds. Only ``ask`` creates trials (on the driver's thread), so within
        one scan of the queue the count holds: read once per scan (each read re-syncs the Optuna journal file)."""
        key = (cell_id, stage)
        if key not in self._counted:
            self._counted[key] = len(self.study(cell_id, stage).get_trials(deepcopy=False))
        return self._counted[key]

    def sampler(self, cell_id: str, number: int) -> optuna.samplers.BaseSampler:
        """The sampler a new search trial of the cell is asked with (designs that propose use no draw)."""
        return optuna.samplers.RandomSampler(seed=cell_sampler_seed(self.sampler_seed, cell_id, number))

    def space(self, cell_id: str) -> dict:
        """The cell's Optuna search space: lr (log scale), and epochs or steps unless ASHA decides the length."""
        b = self.budgets[cell_id]
        length, (lo, hi) = b.length
        out = {"lr": FloatDistribution(b.lr[0], b.lr[1], log=True)}
        if not self.asha:
            out[length] = IntDistribution(lo, hi, log=length == "steps")  # a budget: log scale, like lr
        return out

    def told_in_sweep(self) -> int:
        """Trials told in every study the journal held when this run opened it (every grid and round of the sweep,
        not only this run's cells; read from the storage already replayed, not the file again)."""
        return sum(t.state in DONE for studies in self._known.values() for sid in studies.values()
                   for t in self.storage.get_all_trials(sid, deepcopy=False))

    def trials_of(self, cell_id: str) -> int:
        return 1 if cell_id in self.fixed else self.budgets[cell_id].trials

    def reevaluations_of(self, cell_id: str) -> int:
        """The winner's re-evaluations: the budget's; a closed-form cell none (nothing searched, one configuration),
        but one on each other calibration draw that can change its number (``redraws``)."""
        return self.redraws.get(cell_id, 0) if cell_id in self.fixed else self.budgets[cell_id].reevaluate

    # ------------------------------------------------------------------ the plan (round-major work list)
    def _plan(self) -> list[_Slot]:
        rows = []
        for cid in self.cells:
            row = []
            for stage, budget in ((SEARCH, self.trials_of(cid)), (REEVALUATE, self.reevaluations_of(cid))):
                if stage == REEVALUATE and not budget and not self._known.get(cid, {}).get(stage):
                    continue
                trials = self.study(cid, stage).get_trials(deepcopy=False)
                self.already_done += sum(t.state in DONE for t in trials)
                pending = [t.number for t in trials if t.state not in DONE]
                self.rerun += [Ask(cid, n, {}, stage).trial_id for n in pending]
                row += [_Slot(cid, stage, n, self.wave_of(cid, n) if stage == SEARCH else 0) for n in pending]
                row += [_Slot(cid, stage, None, self.wave_of(cid, len(trials) + k) if stage == SEARCH else 0)
                        for k in range(max(0, budget - len(trials)))]
            rows.append(row)
        queue = [r[i] for i in range(max(map(len, rows), default=0)) for r in rows if i < len(r)]
        for slot in queue:
            self._unasked_add(slot, 1)
        return queue

    def _unasked_add(self, slot: _Slot, n: int) -> None:
        for key in self._keys(slot):
            self.unasked[key] = self.unasked.get(key, 0) + n

    def _keys(self, slot: _Slot) -> tuple:
        if slot.stage == SEARCH:
            return (slot.cell_id, SEARCH), (self.family(slot.cell_id), slot.wave)
        return ((slot.cell_id, slot.stage),)

    def done(self, key) -> bool:
        """Every slot of ``key`` ((cell, stage) or (family, wave)) asked and told."""
        return not self.unasked.get(key, 0) and self.counts.settled(key)

    def wave_of(self, cell_id: str, number: int) -> int:
        """The wave a search trial belongs to (designs that pool evidence across cells wait wave by wave)."""
        return 0

    @property
    def total(self) -> int:
        return self.planned

    # ------------------------------------------------------------------ the contract
    def ready(self, slot: _Slot) -> bool:
        """May this slot be asked now? Re-evaluations wait for every search trial of their cell (one asked before a
        restart too, when it is to be derived from the winner that a retried trial may change: tracking/retry.py)."""
        if slot.number is not None:  # asked before a restart: its parameters are fixed, or derived from the winner
            return slot.stage != REEVALUATE or self._seeded(slot) or self._search_done(slot.cell_id)
        if slot.stage == REEVALUATE:
            return self._search_done(slot.cell_id)
        return True

    def _search_done(self, cell_id: str) -> bool:
        return self.done((cell_id, SEARCH))

    def _seeded(self, slot: _Slot) -> bool:
        """A re-evaluation asked before a restart that still has its healing seed (and so its configuration)."""
        return "heal_seed" in self.study(slot.cell_id, REEVALUATE).get_trials(deepcopy=False)[slot.number].user_attrs

    def priority(self, slot: _Slot) -> int:
        """Among ready slots the highest is asked first (ties: queue order); it changes when a trial runs, never
        its parameters. The fixed designs: all equal (queue order)."""
        return 0

    def settle(self) -> None:
        """Drop queued trials that results made unnecessary (converge.py); the fixed designs drop none."""

    def ask(self):
        """The next trial (module docstring). Which slot is ready depends only on what was asked and told, so
        when a scan found none, the same scan is not run again until a tell: Tune asks on every step of its loop
        while trials run, and each scan reads every queued cell's study (measured 2026-11-28 on the default spec
        with ``converge``: the scans took a quarter of one of the machine's two cores). Tells run on the MLflow
        writer's thread and wait while an ask runs: a result told between ``settle`` (which stops a cell whose
        search is over) and the scan made the scan ask a trial of a stopped cell (2026-11-28: a ResNet cell the
        "recovered" rule had stopped ran 2 more trials in one run of the default spec with ``converge``, not in the
        next), and asks must depend on the results, never on when they arrive."""
        with self._lock:  # settle and the scan must see the same results (below)
            told = self._told  # before the scan (other threads' tells wait on the lock; one on this thread wakes the next ask)
            if told == self._idle_at:
                return None
            self._counted = {}
            try:
                out = self._ask()
            finally:
                self._counted = {}  # this ask may have created a trial
            if out is None:
                self._idle_at = told
            return out

    def _ask(self):
        self.settle()
        if not self.queue:
            return FINISHED
        at, top = None, None
        for i, s in enumerate(self.queue):  # the first ready slot of the highest priority
            p = self.priority(s)
            if (top is None or p > top) and self.ready(s):
                at, top = i, p
        if at is None:
            return None
        slot = self.queue.pop(at)
        self._unasked_add(slot, -1)
        if slot.stage == REEVALUATE:
            out = self._ask_reevaluation(slot)
            return out if out is not None else self.ask()  # no winner (every search trial failed): nothing to repeat
        self.counts.ask((slot.cell_id, SEARCH))
        self.counts.ask((self.family(slot.cell_id), slot.wave))
        study = self.study(slot.cell_id)
        number = slot.number
        if number is None:
            n = len(study.get_trials(deepcopy=False))
            params = {} if slot.cell_id in self.fixed else self.propose(slot.cell_id, n, slot.wave)
            if params:
                study.enqueue_trial(params, skip_if_exists=False)
            study.sampler = self.sampler(slot.cell_id, n)
            number = study.ask(self.space(slot.cell_id)).number
        elif slot.cell_id not in self.fixed and not set(self.space(slot.cell_id)) <= set(study.trials[number].params):
            self._derive_params(slot, study)
        return Ask(slot.cell_id, number, self._params(slot.cell_id, study.trials[number].params))

    def _derive_params(self, slot: _Slot, study: optuna.Study) -> None:
        """An asked trial whose parameters a rebuilt journal lost (orchestrator/tracking/rebuild.py): derived again the way
        its first ask derived them (the design's proposal for that number, else the sampler seeded by the trial
        number), so it runs again as it would have; TPE past its random start-up draws from a history that now
        holds later trials too: a fresh draw in the same space."""
        t = study.trials[slot.number]
        proposed = self.propose(slot.cell_id, slot.number, slot.wave) or {}
        sampler = self.sampler(slot.cell_id, slot.number)
        for name, dist in self.space(slot.cell_id).items():
            if name not in t.params:
                value = proposed[name] if name in proposed else sampler.sample_independent(study, t, name, dist)
                study._storage.set_trial_param(t._trial_id, name, dist.to_internal_repr(value), dist)

    def _params(self, cell_id: str, params: Mapping[str, Any]) -> dict:
        cell = self.cells[cell_id]
        params = dict(params)
        if cell_id in self.fixed:
            return {"lr": 0.0, "epochs": 0}
        if "steps" in params:  # whole epochs to cover them; the trial stops after exactly `steps` steps
            params["epochs"] = resolve_epochs(params["steps"], cell["calib_size"], cell.get("batch_size", 32))
        return params

    def propose(self, cell_id: str, number: int, wave: int) -> dict | None:
        """Parameters for the cell's search trial ``number`` (None: the study's sampler draws them)."""
        return None

    def family(self, cell_id: str) -> tuple:
        """Cells that share evidence: same grid, model and healer (with its settings)."""
        if cell_id not in self._families:
            c = self.cells[cell_id]
            settings = repr(sorted(dict(c.get("healer_settings") or {}).items()))
            self._families[cell_id] = (c.get("grid", "main"), c.get("model"), c.get("healer"), settings)
        return self._families[cell_id]

    def winner(self, cell_id: str):
        """The cell's best told search trial by its objective; ties to the cheaper length, then the first found."""
        done = [t for t in self.study(cell_id).get_trials(deepcopy=False) if t.state == TrialState.COMPLETE]
        if not done:
            return None
        sign = -1.0 if self.direction == "maximize" else 1.0
        return min(done, key=lambda t: (sign * t.value, t.params.get("steps", t.params.get("epochs", 0)), t.number))

    def pick(self, cell_id: str):
        """The search trial whose configuration the cell's re-evaluations heal again (and the report quotes): its
        ``winner`` here; ``search.converge`` may pick among tied draws (orchestrator/search/pick.py)."""
        return self.winner(cell_id)

    def _ask_reevaluation(self, slot: _Slot) -> Ask | None:
        study = self.study(slot.cell_id, REEVALUATE)
        if slot.number is not None:
            t = study.trials[slot.number]
            if "heal_seed" not in t.user_attrs:  # lost with a rebuilt journal: derived again (winner, its seed k)
                best = self.pick(slot.cell_id)
                if best is None:
                    return None
                seed = self._fresh_seed(slot.cell_id, study, best.params, slot.number)
                study._storage.set_trial_user_attr(t._trial_id, "heal_seed", seed)
                study._storage.set_trial_user_attr(t._trial_id, "winner", best.number)
                for name, dist in best.distributions.items():
                    study._storage.set_trial_param(t._trial_id, name, dist.to_internal_repr(best.params[name]), dist)
                t = study.trials[slot.number]
            return Ask(slot.cell_id, slot.number, self._params(slot.cell_id, t.params), REEVALUATE,
                       int(t.user_attrs["heal_seed"]))
        best = self.pick(slot.cell_id)
        if best is None:
            return None
        self.counts.ask((slot.cell_id, REEVALUATE))
        seed = self._fresh_seed(slot.cell_id, study, best.params)
        study.enqueue_trial(dict(best.params), user_attrs={"heal_seed": seed, "winner": best.number},
                            skip_if_exists=False)
        number = study.ask(self.space(slot.cell_id)).number
        return Ask(slot.cell_id, number, self._params(slot.cell_id, best.params), REEVALUATE, seed)

    def _fresh_seed(self, cell_id: str, study, params: dict, before: int | None = None) -> int:
        """The healing seed of the next re-evaluation of ``params`` in the cell (of trial ``before``, asked again):
        ``reevaluation_seeds``' k-th, k = how many re-evaluations of the same configuration came first. A winner a
        widening or refine round found heals on the seeds (and calibration draws) every other winner did, not on
        the study's next ones; the same configuration never twice on one seed."""
        same = [t for t in study.get_trials(deepcopy=False)
                if (before is None or t.number < before) and t.params == dict(params)]
        used = {t.user_attrs.get("heal_seed") for t in same}  # (a study begun before this rule numbered by trial:
        seeds = reevaluation_seeds(int(self.cells[cell_id].get("seed", 0)), len(same) + len(used) + 1)
        return next(x for x in seeds[len(same):] + seeds[:len(same)] if x not in used)  # skip what it used)

    def remember_ceiling(self, ask: Ask, ceiling: float, n_selection: float = math.nan) -> None:
        """Keep the dense model's value of the objective a trial reported as its user attr ``CEILING`` (and the
        number of images the objective counts, ``N_SELECTION``), before the trial's record is written (the record
        carries its attrs: a journal rebuilt from trials.jsonl keeps them, and a resumed search decides as the
        first one did)."""
        with self._lock:
            study = self.study(ask.cell_id, ask.stage)
            trial_id = study.get_trials(deepcopy=False)[ask.number]._trial_id
            for name, v in ((CEILING, float(ceiling)), (N_SELECTION, float(n_selection))):
                if math.isfinite(v):
                    study._storage.set_trial_user_attr(trial_id, name, v)

    def tell(self, ask: Ask, value: float | None, state: TrialState = TrialState.COMPLETE) -> None:
        """Record a trial's objective (``value`` None or ``state`` FAIL: a failed trial, ignored by the search).
        Waits while an ask runs (``ask``)."""
        with self._lock:
            study = self.study(ask.cell_id, ask.stage)
            try:
                if state == TrialState.COMPLETE and value is not None and math.isfinite(value):
                    study.tell(ask.number, float(value))
                else:
                    study.tell(ask.number, state=TrialState.FAIL if state == TrialState.COMPLETE else state)
            finally:
                self.counts.tell((ask.cell_id, ask.stage))
                if ask.stage == SEARCH:
                    self.counts.tell((self.family(ask.cell_id), self.wave_of(ask.cell_id, ask.number)))
                self._told += 1  # last: a scan that reads the new count sees the whole tell

    def intermediate(self, ask: Ask, step: int, value: float) -> None:
        """A per-epoch objective (ASHA): Optuna's record of how the trial went before a stop."""
        with self._lock:
            study = self.study(ask.cell_id, ask.stage)
            study._storage.set_trial_intermediate_value(study.trials[ask.number]._trial_id, step, value)
            self._told += 1

    def noise(self) -> dict[str, dict]:
        """Per cell: the winner's search value and trial number, and its re-evaluations' mean, std and count (a
        closed-form cell healed on other calibration draws: its own trial counted among them)."""
        out = {}
        for cid in self.cells:
            best = self.pick(cid)
            again = self._studies.get((cid, REEVALUATE))
            vals = [] if again is None else [t.value for t in again.get_trials(deepcopy=False)
                                             if t.state == TrialState.COMPLETE]
            if cid in self.fixed and vals and best is not None:  # closed form on other draws: its own is one more
                vals.insert(0, best.value)                        # draw, as the report quotes it (analysis/reported.py)
            mean = sum(vals) / len(vals) if vals else None
            std = (math.sqrt(sum((v - mean) ** 2 for v in vals) / (len(vals) - 1)) if len(vals) > 1 else None)
            out[cid] = {"winner": None if best is None else best.number,
                        "search_value": None if best is None else best.value,
                        "reevaluate_mean": mean, "reevaluate_std": std, "reevaluate_n": len(vals)}
        return out
