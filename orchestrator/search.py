"""Per-cell Optuna search behind one Ray Tune scheduler.

Every grid cell owns an Optuna study (its own TPE state: cells never share history), stored in a
JournalStorage file under the run directory. One Ray Tune ``Searcher`` routes: ``suggest`` asks the next
cell's study and returns the full trial config; ``on_trial_complete`` tells that study the selection
objective. Cells are visited round-major (trial 0 of every cell, then trial 1, ...), so free workers have
work from other cells while a cell's earlier trials run.

Determinism and resume: the sampler is re-seeded before every ask from (sampler seed, cell, trial number),
and a cell's trial past TPE's random start-up is asked only once every earlier trial of that cell has been told
(``_ready``; until then the next ready cell's trial goes, or ``suggest`` returns None and Tune asks again). So a
trial's suggestion depends only on its number and the study history, never on which trial finished first, the
order of asks across cells or a restart: the same spec and seed give the same trials (not under ASHA, whose
stops depend on timing by design: there a cell's trials are asked without waiting).
On construction over an existing journal, trials already told (COMPLETE, PRUNED, FAIL) are never run again;
trials asked but never told (the driver died while they ran) are run again with the same parameters and the
same trial number; only the remaining count is asked anew.

Early stopping (ASHA): the search space is lr only and every trial runs ``epochs_max`` epochs unless the
scheduler stops it. Per-epoch objective values are recorded as Optuna intermediate values, and a trial that
ends without its final result (stopped early) is told PRUNED: Optuna's TPE then ranks it below completed
trials by the step it reached and its last intermediate value, so the evidence is used without treating a
2-epoch score as a full-length one. Errors and diverged trials are told FAIL (ignored by TPE).

Training length: the space searches ``epochs`` (passes over the calibration set, uniform) or, with
``search.steps``, optimizer ``steps`` (log-uniform integers, docs/methods.md#search): a trial then gets ``steps`` and the epochs they need,
ceil(steps / ceil(calib_size / batch_size)), and stops after exactly ``steps`` steps.

Objective: ``selection_acc`` (maximised) or ``heldout_align`` (minimised; measured once, after healing, so it
is never an intermediate value and the spec refuses it with ASHA).

Cells whose healer does not train (``Healer.trains`` False: ``none``, closed-form healers) have nothing to search:
they run exactly one trial with lr = 0 and epochs = 0 (``fixed_cell``; the journal still numbers that trial).
"""
from __future__ import annotations

import hashlib
import math
from pathlib import Path
from typing import Any, Callable, Mapping

import optuna
from optuna.distributions import FloatDistribution, IntDistribution
from optuna.trial import TrialState
from ray.tune.search import Searcher

optuna.logging.set_verbosity(optuna.logging.WARNING)
DONE = (TrialState.COMPLETE, TrialState.PRUNED, TrialState.FAIL)


def fixed_cell(cell: Mapping[str, Any]) -> bool:
    """True when the cell's healer (or every step of its chain) uses no lr/epochs."""
    from tasks.healing import resolve_healer

    return "healer" in cell and not resolve_healer(cell["healer"], cell.get("healer_settings")).trains


def cell_sampler_seed(sampler_seed: int, cell_id: str, number: int = 0) -> int:
    return int(hashlib.sha256(f"{sampler_seed}:{cell_id}:{number}".encode()).hexdigest()[:8], 16)


def search_kwargs(search) -> dict:
    """Keyword arguments of ``PerCellOptunaSearch`` that follow the spec's ``search`` section (objective,
    its direction, a steps-based space)."""
    from orchestrator.spec.checks import OBJECTIVES

    return {"metric": search.objective, "mode": OBJECTIVES[search.objective], "steps": search.steps}


def resolve_epochs(steps: int, calib_size: int, batch_size: int) -> int:
    """Epochs a trial of ``steps`` optimizer steps needs: ceil(steps / ceil(calib_size / batch_size))."""
    return math.ceil(steps / math.ceil(calib_size / batch_size))


def open_journal(journal: Path) -> optuna.storages.JournalStorage:
    return optuna.storages.JournalStorage(optuna.storages.journal.JournalFileBackend(str(journal)))


class PerCellOptunaSearch(Searcher):
    def __init__(self, cells: list[Mapping[str, Any]], trials_per_cell: int, lr: tuple[float, float],
                 epochs: tuple[int, int], sampler_seed: int, journal: Path, *, asha: bool = False,
                 startup_trials: int | None = None, metric: str = "selection_acc", mode: str = "max",
                 defer: Callable[[Callable[[], None]], None] | None = None,
                 grids: Mapping[str, Any] | None = None, steps: tuple[int, int] | None = None) -> None:
        """``grids``: grid name -> search settings (``trials_per_cell``, ``lr``, ``epochs``/``steps``,
        ``startup_trials`` attributes) for cells whose ``grid`` is listed; every other cell uses the arguments
        above (``steps`` given: the space searches optimizer steps instead of ``epochs``)."""
        super().__init__(metric=metric, mode=mode)
        self._cells = {c["cell_id"]: dict(c) for c in cells}
        self._asha = asha
        self._asha_epochs = {"epochs": epochs[1]} if asha else {}
        self._no_search = {cid for cid, c in self._cells.items() if fixed_cell(c)}
        default = (trials_per_cell, tuple(lr), ("steps", tuple(steps)) if steps else ("epochs", tuple(epochs)),
                   startup_trials)
        grids = {k: (g.trials_per_cell, tuple(g.lr), (g.length[0], tuple(g.length[1])), g.startup_trials)
                 for k, g in (grids or {}).items()}
        self._budget = {cid: grids.get(c.get("grid"), default) for cid, c in self._cells.items()}
        self._sampler_seed = sampler_seed
        self._storage = open_journal(journal)
        self._studies: dict[str, optuna.Study] = {}
        self._live: dict[str, tuple[str, int]] = {}  # tune trial id -> (cell id, optuna trial number)
        self._defer = defer or (lambda fn: fn())  # the driver runs tells after that trial's MLflow writes
        # per cell: trials handed out (written by the driver's thread) and tells written (by the thread that runs
        # the deferred tells); a cell is busy while they differ. One writer per counter: no lock (Tune pickles us).
        self._asked: dict[str, int] = {}
        self._told: dict[str, int] = {}
        self.rerun: list[str] = []  # trial keys asked before a restart and run again now
        self.already_done = 0
        # Work list, round-major: (cell id, trial number or None for a new ask).
        todo: list[list[tuple[str, int | None]]] = []
        for cid in self._cells:
            trials = self.study(cid).get_trials(deepcopy=False)
            self.already_done += sum(t.state in DONE for t in trials)
            pending = [(cid, t.number) for t in trials if t.state not in DONE]
            self.rerun += [f"{cid}-{n}" for _, n in pending]
            budget = 1 if cid in self._no_search else self._budget[cid][0]
            todo.append(pending + [(cid, None)] * max(0, budget - len(trials)))
        self._queue = [row[i] for i in range(max(map(len, todo), default=0)) for row in todo if i < len(row)]

    def space(self, cell_id: str) -> dict:
        """The cell's Optuna search space: lr (log scale), and epochs or steps unless ASHA decides the length."""
        _, lr, (length, (lo, hi)), _ = self._budget[cell_id]
        out = {"lr": FloatDistribution(lr[0], lr[1], log=True)}
        if not self._asha:
            out[length] = IntDistribution(lo, hi, log=length == "steps")  # a budget: log scale, like lr
        return out

    @property
    def total(self) -> int:
        return len(self._queue)

    def study(self, cell_id: str) -> optuna.Study:
        if cell_id not in self._studies:
            self._studies[cell_id] = optuna.create_study(
                study_name=cell_id, storage=self._storage, sampler=self._sampler(cell_id, 0),
                direction="maximize" if self.mode == "max" else "minimize", load_if_exists=True)
        return self._studies[cell_id]

    def _startup(self, cell_id: str) -> int:
        trials, _, _, startup = self._budget[cell_id]
        return startup or max(1, min(10, trials // 2))

    def _sampler(self, cell_id: str, number: int) -> optuna.samplers.BaseSampler:
        return optuna.samplers.TPESampler(seed=cell_sampler_seed(self._sampler_seed, cell_id, number),
                                          n_startup_trials=self._startup(cell_id))

    def _ready(self, cell_id: str, number: int | None) -> bool:
        """Reproducible asks: a cell's trial past its random start-up waits until every earlier trial of the cell
        has been told, so TPE sees the same history whatever the order trials finish in (other cells' trials
        fill the workers meanwhile). Re-asks of trials from before a restart keep their parameters: ready."""
        if number is not None or cell_id in self._no_search or self._asha:
            return True  # ASHA's stops depend on timing anyway; it needs a cell's trials to run side by side
        if len(self.study(cell_id).get_trials(deepcopy=False)) < self._startup(cell_id):
            return True  # seeded random start-up: independent of the history
        return self._asked.get(cell_id, 0) == self._told.get(cell_id, 0)

    def _tell(self, cell_id: str, fn: Callable[[], None]) -> None:
        """Run a tell (deferred by the driver) and only then release the cell's next TPE ask."""
        def run() -> None:
            try:
                fn()
            finally:
                self._told[cell_id] = self._told.get(cell_id, 0) + 1
        self._defer(run)

    def set_search_properties(self, metric, mode, config, **spec) -> bool:
        return True  # the space is ours; metric/mode were fixed at construction

    def suggest(self, trial_id: str) -> dict | None:
        if not self._queue:
            return Searcher.FINISHED
        at = next((i for i, (c, n) in enumerate(self._queue) if self._ready(c, n)), None)
        if at is None:
            return None  # every remaining trial waits for its cell's earlier trials: Tune asks again
        cell_id, number = self._queue.pop(at)
        self._asked[cell_id] = self._asked.get(cell_id, 0) + 1
        study = self.study(cell_id)
        if number is None:
            study.sampler = self._sampler(cell_id, len(study.get_trials(deepcopy=False)))
            number = study.ask(self.space(cell_id)).number
        params = dict(study.trials[number].params)
        cell = self._cells[cell_id]
        if cell_id in self._no_search:
            params = {"lr": 0.0, "epochs": 0}
        elif "steps" in params:  # whole epochs to cover them; the trial stops after exactly `steps` steps
            params["epochs"] = resolve_epochs(params["steps"], cell["calib_size"], cell.get("batch_size", 32))
        self._live[trial_id] = (cell_id, number)
        return {**cell, **self._asha_epochs, **params, "optuna_trial": number,
                "trial_id": f"{cell_id}-{number}"}

    def _report(self, trial_id: str, result: Mapping[str, Any] | None) -> None:
        if trial_id in self._live and result and self.metric in result and "epoch" in result \
                and not result.get("diverged"):
            cell_id, number = self._live[trial_id]
            study, value, step = self.study(cell_id), float(result[self.metric]), int(result["epoch"])
            tid = study.trials[number]._trial_id
            self._defer(lambda: study._storage.set_trial_intermediate_value(tid, step, value))

    def on_trial_result(self, trial_id: str, result: dict) -> None:
        self._report(trial_id, result)

    def on_trial_complete(self, trial_id: str, result: dict | None = None, error: bool = False) -> None:
        if trial_id not in self._live:
            return
        self._report(trial_id, result)  # the last result of an early-stopped trial never reached on_trial_result
        cell_id, number = self._live.pop(trial_id)
        study = self.study(cell_id)
        if error or not result or self.metric not in result or result.get("diverged"):
            self._tell(cell_id, lambda: study.tell(number, state=TrialState.FAIL))
        elif not result.get("final"):
            self._tell(cell_id, lambda: study.tell(number, state=TrialState.PRUNED))
        else:
            value = float(result[self.metric])
            self._tell(cell_id, lambda: study.tell(number, value))

    # Tune checkpoints searchers; study state already lives in the journal file.
    def save(self, checkpoint_path: str) -> None:
        Path(checkpoint_path).write_text("per-cell optuna state lives in the journal storage\n")

    def restore(self, checkpoint_path: str) -> None:
        pass
