"""Per-cell Optuna search behind one Ray Tune scheduler.

Every grid cell owns an Optuna study (its own TPE state: cells never share history), stored in a
JournalStorage file under the run directory. One Ray Tune ``Searcher`` routes: ``suggest`` asks the next
cell's study for (lr, epochs) and returns the full trial config; ``on_trial_complete`` tells that study the
selection objective (or FAIL). Cells are visited round-major (trial 0 of every cell, then trial 1, ...), so
free workers always have work and every study sees completed trials before its later asks.

Cells whose healer does not train (``Healer.trains`` False: ``none``, closed-form healers) have nothing to search:
they run exactly one trial with lr = 0 and epochs = 0 and no Optuna study (``fixed_cell``).
"""
from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any, Mapping

import optuna
from optuna.distributions import FloatDistribution, IntDistribution
from optuna.trial import TrialState
from ray.tune.search import Searcher

optuna.logging.set_verbosity(optuna.logging.WARNING)


def fixed_cell(cell: Mapping[str, Any]) -> bool:
    """True when the cell's healer (or every step of its chain) uses no lr/epochs."""
    from tasks.heal import resolve_healer

    return not resolve_healer(cell["healer"], cell.get("healer_settings")).trains


def cell_sampler_seed(sampler_seed: int, cell_id: str) -> int:
    return int(hashlib.sha256(f"{sampler_seed}:{cell_id}".encode()).hexdigest()[:8], 16)


class PerCellOptunaSearch(Searcher):
    def __init__(self, cells: list[Mapping[str, Any]], trials_per_cell: int, lr: tuple[float, float],
                 epochs: tuple[int, int], sampler_seed: int, journal: Path,
                 metric: str = "selection_acc", mode: str = "max") -> None:
        super().__init__(metric=metric, mode=mode)
        self._cells = {c["cell_id"]: dict(c) for c in cells}
        self._fixed = {cid for cid, c in self._cells.items() if fixed_cell(c)}
        self._queue = [cid for r in range(trials_per_cell) for cid in self._cells
                       if r == 0 or cid not in self._fixed]  # round-major
        self.total = len(self._queue)
        self._space = {"lr": FloatDistribution(lr[0], lr[1], log=True), "epochs": IntDistribution(epochs[0], epochs[1])}
        self._trials_per_cell = trials_per_cell
        self._sampler_seed = sampler_seed
        self._storage = optuna.storages.JournalStorage(optuna.storages.journal.JournalFileBackend(str(journal)))
        self._studies: dict[str, optuna.Study] = {}
        self._live: dict[str, tuple[str, int]] = {}  # tune trial id -> (cell id, optuna trial number)

    def study(self, cell_id: str) -> optuna.Study:
        if cell_id not in self._studies:
            startup = max(1, min(10, self._trials_per_cell // 2))
            sampler = optuna.samplers.TPESampler(seed=cell_sampler_seed(self._sampler_seed, cell_id),
                                                 n_startup_trials=startup)
            self._studies[cell_id] = optuna.create_study(
                study_name=cell_id, storage=self._storage, sampler=sampler,
                direction="maximize" if self.mode == "max" else "minimize", load_if_exists=True)
        return self._studies[cell_id]

    def set_search_properties(self, metric, mode, config, **spec) -> bool:
        return True  # the space is ours; metric/mode were fixed at construction

    def suggest(self, trial_id: str) -> dict | None:
        if not self._queue:
            return Searcher.FINISHED
        cell_id = self._queue.pop(0)
        if cell_id in self._fixed:
            return {**self._cells[cell_id], "lr": 0.0, "epochs": 0, "optuna_trial": 0, "trial_key": f"{cell_id}-0"}
        ot = self.study(cell_id).ask(self._space)
        self._live[trial_id] = (cell_id, ot.number)
        return {**self._cells[cell_id], "lr": ot.params["lr"], "epochs": ot.params["epochs"],
                "optuna_trial": ot.number, "trial_key": f"{cell_id}-{ot.number}"}

    def on_trial_complete(self, trial_id: str, result: dict | None = None, error: bool = False) -> None:
        if trial_id not in self._live:
            return
        cell_id, number = self._live.pop(trial_id)
        study = self.study(cell_id)
        if error or not result or self.metric not in result or not result.get("final"):
            study.tell(number, state=TrialState.FAIL)
        else:
            study.tell(number, float(result[self.metric]))

    # Tune checkpoints searchers; study state already lives in the journal file.
    def save(self, checkpoint_path: str) -> None:
        Path(checkpoint_path).write_text("per-cell optuna state lives in the journal storage\n")

    def restore(self, checkpoint_path: str) -> None:
        pass
