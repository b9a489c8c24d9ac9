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

import hashlib
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

import optuna
from optuna.distributions import FloatDistribution, IntDistribution
from optuna.trial import TrialState

from orchestrator.spec.checks import MAX_REEVALUATE  # noqa: F401 - the bound lives with the spec's checks
from orchestrator.spec.registries import resolve_healer

optuna.logging.set_verbosity(optuna.logging.WARNING)
DONE = (TrialState.COMPLETE, TrialState.PRUNED, TrialState.FAIL)
FINISHED = "FINISHED"  # == ray.tune.search.Searcher.FINISHED
SEARCH, REEVALUATE = "search", "reevaluate"
CEILING = "dense_selection_acc"  # the trial metric (tasks/trial.py) and user attr: the dense model's objective
N_SELECTION = "n_selection"  # the trial metric and user attr: images the objective (selection accuracy) counts


@dataclass(frozen=True)
class Budget:
    """One cell's search settings (the spec's ``search`` section, or its grid's)."""
    trials: int  # search trials per cell (a fixed cell runs one)
    lr: tuple[float, float]
    length: tuple[str, tuple[int, int]]  # ("steps" | "epochs", (lo, hi))
    startup_trials: int | None = None  # tpe: random trials before TPE
    reevaluate: int = 0  # fresh healing seeds for the winner
    explore: int = 2  # shared: first-wave points per cell
    lattice: tuple[int, int] = (9, 5)  # shared/grid: points on the lr and length axes
    converge: Any = None  # shared: a ``converge.Converge`` (``trials`` is then a per-cell cap), None: fixed count


@dataclass(frozen=True)
class Ask:
    cell_id: str
    number: int  # the trial's number in its study (search, or the cell's reevaluate study)
    params: Mapping[str, Any]  # lr and epochs/steps
    stage: str = SEARCH
    heal_seed: int | None = None  # re-evaluations: the fresh healing seed (None: the cell's seed)

    @property
    def trial_id(self) -> str:
        return f"{self.cell_id}-{self.number}" if self.stage == SEARCH else f"{self.cell_id}-r{self.number}"


@dataclass
class _Slot:
    cell_id: str
    stage: str
    number: int | None  # None: a new trial; else a trial asked before a restart, run again
    wave: int = 0


def fixed_cell(cell: Mapping[str, Any]) -> bool:
    """True when the cell's healer (or every step of its chain) uses no lr/epochs (the registries' table: no
    torch)."""
    return "healer" in cell and not resolve_healer(cell["healer"], cell.get("healer_settings")).trains


def cell_sampler_seed(sampler_seed: int, key: str, number: int = 0) -> int:
    return int(hashlib.sha256(f"{sampler_seed}:{key}:{number}".encode()).hexdigest()[:8], 16)


def reevaluation_seeds(seed: int, n: int) -> list[int]:
    """The fresh healing seeds of a cell's re-evaluations: never the cell's own seed (its search trials used it),
    and the same for every sampler seed, so two searches that find the same winner report the same number."""
    return [1000 * (k + 1) + seed for k in range(n)]


def study_label(cell: Mapping[str, Any]) -> str:
    """A person's name for a cell's study (optuna-dashboard lists studies by name): model / pruner / sparsity /
    calibration size / healer / seed, then the cell id (the key everything else uses)."""
    pattern = cell.get("pattern", cell.get("sparsity", "?"))
    return (f"{cell.get('model', '?')} / {cell.get('pruner', '?')} {pattern} / calib {cell.get('calib_size', '?')} / "
            f"{cell.get('healer', '?')} / seed {cell.get('seed', '?')} · {cell['cell_id']}")


def open_journal(journal: Path) -> optuna.storages.JournalStorage:
    return optuna.storages.JournalStorage(optuna.storages.journal.JournalFileBackend(str(journal)))


def journal_cells(storage) -> dict[str, dict[str, int]]:
    """{cell id: {stage: study id}} of every study in a journal (studies of older sweeps are named by the cell id)."""
    out: dict[str, dict[str, int]] = {}
    for s in storage.get_all_studies():
        cid = s.user_attrs.get("cell_id", s.study_name)
        out.setdefault(cid, {})[s.user_attrs.get("stage", SEARCH)] = s._study_id
    return out


def resolve_epochs(steps: int, calib_size: int, batch_size: int) -> int:
    """Epochs a trial of ``steps`` optimizer steps needs: ceil(steps / ceil(calib_size / batch_size))."""
    return math.ceil(steps / math.ceil(calib_size / batch_size))


@dataclass
class _Counts:
    asked: dict = field(default_factory=dict)  # key -> asks handed out (the driver's thread)
    told: dict = field(default_factory=dict)  # key -> tells written (the thread that runs deferred tells)

    def ask(self, key) -> None:
        self.asked[key] = self.asked.get(key, 0) + 1

    def tell(self, key) -> None:
        self.told[key] = self.told.get(key, 0) + 1

    def settled(self, key) -> bool:
        return self.asked.get(key, 0) == self.told.get(key, 0)


class SearchDesign:
    """The shared machinery; a design overrides ``propose`` (and ``ready`` / ``sampler`` where it needs)."""

    name = ""
    ordered = True  # asks wait for the results they depend on (reproducible); False only under ASHA
    converging = False  # True: some cell's count is a cap (search.converge), and ``dropped`` grows as cells stop
    dropped = 0  # planned slots a converging design removed from the queue (a stopped search, fewer seeds)

    def __init__(self, cells: list[Mapping[str, Any]], budgets: Mapping[str, Budget], sampler_seed: int,
                 journal: Path, *, direction: str = "maximize", asha: bool = False) -> None:
        self.cells = {c["cell_id"]: dict(c) for c in cells}
        self.budgets = dict(budgets)
        self.sampler_seed, self.direction, self.asha = sampler_seed, direction, asha
        self.fixed = {cid for cid, c in self.cells.items() if fixed_cell(c)}
        self.storage = open_journal(journal)
        self._studies: dict[tuple[str, str], optuna.Study] = {}
        self.counts = _Counts()  # per (cell, stage) and per (family, wave): a key is settled when all told
        self.rerun: list[str] = []
        self.already_done = 0
        self._known = journal_cells(self.storage)  # studies of a resumed sweep
        self._families: dict[str, tuple] = {}
        self._told, self._idle_at = 0, -1  # tells written; the value when a scan last found nothing ready (ask)
        self._counted: dict[tuple[str, str], int] = {}  # trials per study, read once per scan (n_trials)
        self.unasked: dict = {}  # (cell, stage) / (family, wave) -> slots not asked yet
        self.queue = self._plan()
        self.planned = len(self.queue)  # Tune's num_samples: every trial this session runs

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

    def trials_of(self, cell_id: str) -> int:
        return 1 if cell_id in self.fixed else self.budgets[cell_id].trials

    def reevaluations_of(self, cell_id: str) -> int:
        return 0 if cell_id in self.fixed else self.budgets[cell_id].reevaluate

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
        """May this slot be asked now? Re-evaluations wait for every search trial of their cell."""
        if slot.number is not None:
            return True  # asked before a restart: its parameters are fixed
        if slot.stage == REEVALUATE:
            return self._search_done(slot.cell_id)
        return True

    def _search_done(self, cell_id: str) -> bool:
        return self.done((cell_id, SEARCH))

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
        with ``converge``: the scans took a quarter of one of the machine's two cores)."""
        told = self._told  # read before the scan: a tell during it makes the next ask scan again
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

    def _ask_reevaluation(self, slot: _Slot) -> Ask | None:
        study = self.study(slot.cell_id, REEVALUATE)
        if slot.number is not None:
            t = study.trials[slot.number]
            if "heal_seed" not in t.user_attrs:  # lost with a rebuilt journal: derived again (winner, seed n)
                best = self.winner(slot.cell_id)
                if best is None:
                    return None
                seed = reevaluation_seeds(int(self.cells[slot.cell_id].get("seed", 0)), slot.number + 1)[slot.number]
                study._storage.set_trial_user_attr(t._trial_id, "heal_seed", seed)
                for name, dist in best.distributions.items():
                    study._storage.set_trial_param(t._trial_id, name, dist.to_internal_repr(best.params[name]), dist)
                t = study.trials[slot.number]
            return Ask(slot.cell_id, slot.number, self._params(slot.cell_id, t.params), REEVALUATE,
                       int(t.user_attrs["heal_seed"]))
        best = self.winner(slot.cell_id)
        if best is None:
            return None
        self.counts.ask((slot.cell_id, REEVALUATE))
        n = len(study.get_trials(deepcopy=False))
        seed = reevaluation_seeds(int(self.cells[slot.cell_id].get("seed", 0)), n + 1)[n]
        study.enqueue_trial(dict(best.params), user_attrs={"heal_seed": seed, "winner": best.number},
                            skip_if_exists=False)
        number = study.ask(self.space(slot.cell_id)).number
        return Ask(slot.cell_id, number, self._params(slot.cell_id, best.params), REEVALUATE, seed)

    def remember_ceiling(self, ask: Ask, ceiling: float, n_selection: float = math.nan) -> None:
        """Keep the dense model's value of the objective a trial reported as its user attr ``CEILING`` (and the
        number of images the objective counts, ``N_SELECTION``), before the trial's record is written (the record
        carries its attrs: a journal rebuilt from trials.jsonl keeps them, and a resumed search decides as the
        first one did)."""
        study = self.study(ask.cell_id, ask.stage)
        trial_id = study.get_trials(deepcopy=False)[ask.number]._trial_id
        for name, v in ((CEILING, float(ceiling)), (N_SELECTION, float(n_selection))):
            if math.isfinite(v):
                study._storage.set_trial_user_attr(trial_id, name, v)

    def tell(self, ask: Ask, value: float | None, state: TrialState = TrialState.COMPLETE) -> None:
        """Record a trial's objective (``value`` None or ``state`` FAIL: a failed trial, ignored by the search)."""
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
        study = self.study(ask.cell_id, ask.stage)
        study._storage.set_trial_intermediate_value(study.trials[ask.number]._trial_id, step, value)
        self._told += 1

    def noise(self) -> dict[str, dict]:
        """Per cell: the winner's search value and trial number, and its re-evaluations' mean, std and count."""
        out = {}
        for cid in self.cells:
            best = self.winner(cid)
            again = self._studies.get((cid, REEVALUATE))
            vals = [] if again is None else [t.value for t in again.get_trials(deepcopy=False)
                                             if t.state == TrialState.COMPLETE]
            mean = sum(vals) / len(vals) if vals else None
            std = (math.sqrt(sum((v - mean) ** 2 for v in vals) / (len(vals) - 1)) if len(vals) > 1 else None)
            out[cid] = {"winner": None if best is None else best.number,
                        "search_value": None if best is None else best.value,
                        "reevaluate_mean": mean, "reevaluate_std": std, "reevaluate_n": len(vals)}
        return out
