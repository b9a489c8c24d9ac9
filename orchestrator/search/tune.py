"""The one Ray Tune ``Searcher`` of a sweep, over any registered search design.

``suggest`` asks the design and returns the full trial config (the cell, the parameters, the trial id, the stage
and, for re-evaluations, the healing seed, and with search.calib_draws the other calibration draw's store key, mask
key and load arguments: orchestrator/sweep/draws.py); ``on_trial_complete`` tells the design the objective. Tells are
deferred (``defer``: the driver runs them after that trial's MLflow writes, on the writer's thread), so a told
trial always has its complete MLflow run, and a design's waits (``ready``) release only once the tell is written.

A design that waits for results (a wave of the shared design) makes Tune ask again; with no trial running
Tune (2.60, ``TuneController._update_trial_queue``) asks in a loop that sleeps 1 s after every ask, so the
MLflow writes and the tell still queued when the last trial of a wave finished cost 2 s of idle workers per
wave (measured: two 2.0 s gaps in a 16-trial sweep of 20 s). So when nothing of this searcher runs and tells are
still queued, ``suggest`` waits for them (milliseconds) and asks the design again.

Early stopping (ASHA, ``tpe`` design only): every trial runs ``epochs_max`` epochs unless the scheduler stops
it; per-epoch objective values are Optuna intermediate values, and a trial that ends without its final result is
told PRUNED. Errors and diverged trials are told FAIL (ignored by the search).
"""
from __future__ import annotations

import math
import threading
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from optuna.trial import TrialState
from ray.tune.search import Searcher

from orchestrator.search.base import CEILING, FINISHED, N_SELECTION, REEVALUATE, SEARCH, Ask, Budget, SearchDesign
from orchestrator.search.records import draw_of_reevaluation, reevaluation_index
from orchestrator.search.registry import DESIGNS
from orchestrator.spec.schema import converge_of
from tasks.atomic import DiskFullError


def _raise(e: BaseException) -> None:
    raise e


class DesignSearcher(Searcher):
    def __init__(self, design: SearchDesign, *, metric: str = "selection_acc", mode: str = "max",
                 defer: Callable[[Callable[[], None]], None] | None = None, epochs_max: int | None = None,
                 draws: Sequence[Mapping[str, Mapping[str, Any]]] = ()) -> None:
        super().__init__(metric=metric, mode=mode)
        self.design = design
        # search.calib_draws: per other draw, {cell id: the config keys that move a trial onto it} (store_key,
        # mask_key, load_kw, calib_draw: orchestrator/sweep/draws.py); re-evaluations cycle through them
        self.draws = [dict(d) for d in draws]
        self._defer = defer or (lambda fn: fn())
        self._asha_epochs = {"epochs": epochs_max} if design.asha and epochs_max else {}
        self._live: dict[str, Ask] = {}  # tune trial id -> the design's ask
        self.record: Callable[[Ask, float | None, TrialState], None] | None = None  # orchestrator/tracking/recorder.py
        # A fault that is not the trial's own (a full disk): the sweep's handler stops the sweep (orchestrator/
        # rundir/faults.py ``stop``, set by the trials stage); without one the error is raised here.
        self.on_fault: Callable[[BaseException], None] = _raise
        self._untold = _Pending()  # tells handed to ``defer`` and not yet run
        self._errors: list[Callable[[], None]] = []  # failed trials' tells, held for Tune's callbacks (below)

    # Tune pickles the searcher with the Tuner (tuner.pkl): the count of queued tells and the recorder are this
    # process's only.
    def __getstate__(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k not in ("_untold", "_errors", "record", "on_fault")}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._untold, self._errors, self.record, self.on_fault = _Pending(), [], None, _raise

    @property
    def total(self) -> int:
        return self.design.total

    @property
    def converging(self) -> bool:
        """Some cell's trial count is a cap (``search.converge``): ``total`` and ``per_cell`` are upper bounds."""
        return self.design.converging

    @property
    def dropped(self) -> int:
        """Planned trials the design will not run after all (cells whose search converged, fewer seeds)."""
        return self.design.dropped

    @property
    def rerun(self) -> list[str]:
        return self.design.rerun

    @property
    def already_done(self) -> int:
        return self.design.already_done

    def study(self, cell_id: str, stage: str = SEARCH):
        return self.design.study(cell_id, stage)

    def per_cell(self) -> dict[str, int]:
        """Trials still to run per cell (search and re-evaluation)."""
        out: dict[str, int] = {}
        for s in self.design.queue:
            out[s.cell_id] = out.get(s.cell_id, 0) + 1
        return out

    def set_search_properties(self, metric, mode, config, **spec) -> bool:
        return True  # the space is the design's; metric/mode were fixed at construction

    def suggest(self, trial_id: str) -> dict | None:
        self.flush_errors()
        a = self.design.ask()
        if a is None and not self._live and self._untold.wait():  # the results it waits for are being told
            a = self.design.ask()
        if a == FINISHED:
            return Searcher.FINISHED
        if a is None:
            return None  # every remaining trial waits for results: Tune asks again
        self._live[trial_id] = a
        cfg = {**self.design.cells[a.cell_id], **self._asha_epochs, **a.params, "optuna_trial": a.number,
               "trial_id": a.trial_id, "stage": a.stage}
        if a.heal_seed is not None:
            cfg["heal_seed"] = a.heal_seed
        j = (draw_of_reevaluation(reevaluation_index(int(self.design.cells[a.cell_id].get("seed", 0)), a.heal_seed),
                                  len(self.draws)) if a.stage == REEVALUATE and a.heal_seed is not None else None)
        if j is not None:  # this re-evaluation heals on another calibration draw: its targets, mask, images
            cfg.update(self.draws[j][a.cell_id])
        return cfg

    def _report(self, trial_id: str, result: Mapping[str, Any] | None) -> None:
        a = self._live.get(trial_id)
        if a is not None and a.stage == SEARCH and result and self.metric in result and "epoch" in result \
                and not result.get("diverged"):
            step, value = int(result["epoch"]), float(result[self.metric])
            self._defer(lambda: self.design.intermediate(a, step, value))

    def on_trial_result(self, trial_id: str, result: dict) -> None:
        self._report(trial_id, result)

    def on_trial_complete(self, trial_id: str, result: dict | None = None, error: bool = False) -> None:
        if trial_id not in self._live:
            return
        self._report(trial_id, result)  # the last result of an early-stopped trial never reached on_trial_result
        a = self._live.pop(trial_id)
        if result and result.get("disk_full"):  # not the trial's fault: the sweep stops, the trial stays untold
            self.on_fault(DiskFullError(result.get("disk_full_path") or "?", int(result.get("disk_full_needed") or 0),
                                        result.get("disk_full_what") or None))
            return
        if error:  # told after Tune's own callbacks ran: the logger's on_trial_error writes the run's failure_reason
            self._untold.add()  # then, which the trial's record reads back (Tune calls them after this method)
            self._errors.append(lambda: self._told(a, None, TrialState.FAIL))
        elif not result or self.metric not in result or result.get("diverged"):
            self._tell(lambda: self._told(a, None, TrialState.FAIL))
        elif not result.get("final"):
            self._tell(lambda: self._told(a, None, TrialState.PRUNED))
        else:
            value = float(result[self.metric])
            sel = self.metric == "selection_acc"
            ceiling = (result.get(CEILING), result.get(N_SELECTION)) if sel else None
            self._tell(lambda: self._told(a, value, TrialState.COMPLETE, ceiling))

    def flush_errors(self) -> None:
        """The failed trials' tells, handed to ``defer`` on Tune's thread once its step is over (the next ask, or the
        end of the trials): after the MLflow writes its callbacks queued for them."""
        held, self._errors = self._errors, []
        for fn in held:
            self._defer(lambda fn=fn: self._untold.run(fn))

    def _told(self, a: Ask, value: float | None, state: TrialState, ceiling: tuple | None = None) -> None:
        """The trial's record (DIR/trials.jsonl, the commit point: a record that cannot be written raises, and
        the tell is not written either), then the design's tell. ``ceiling``: (the dense model's value of the
        objective, the images it counts), when the objective has them (selection accuracy), kept with the trial
        before its record."""
        if ceiling is not None:
            top, n = (float(x) if x is not None else math.nan for x in ceiling)
            self.design.remember_ceiling(a, top, n)
        if self.record is not None:
            self.record(a, value, state)
        self.design.tell(a, value, state)

    def _tell(self, fn: Callable[[], None]) -> None:
        """``fn`` (a tell) through ``defer``, counted until it has run."""
        self._untold.add()
        self._defer(lambda: self._untold.run(fn))

    # Tune checkpoints searchers; the design's state already lives in the journal file.
    def save(self, checkpoint_path: str) -> None:
        Path(checkpoint_path).write_text("search state lives in the Optuna journal\n")

    def restore(self, checkpoint_path: str) -> None:
        pass


class _Pending:
    """A count of queued calls: ``run`` one (the count drops after it, even when it raises); ``wait`` until none
    is queued. -> whether there was something to wait for."""

    def __init__(self) -> None:
        self._n, self._cond = 0, threading.Condition()

    def add(self) -> None:
        with self._cond:
            self._n += 1

    def run(self, fn: Callable[[], None]) -> None:
        try:
            fn()
        finally:
            with self._cond:
                self._n -= 1
                self._cond.notify_all()

    def wait(self, timeout: float = 60.0) -> bool:
        with self._cond:
            queued = self._n > 0
            self._cond.wait_for(lambda: self._n == 0, timeout)
        return queued


def make_searcher(cells: list[Mapping[str, Any]], budgets: Mapping[str, Budget], design: str, sampler_seed: int,
                  journal: Path, *, metric: str = "selection_acc", mode: str = "max", asha: bool = False,
                  defer=None, epochs_max: int | None = None, draws=()) -> DesignSearcher:
    cls = DESIGNS.get(design)
    redraws = {c["cell_id"]: sum(c["cell_id"] in d for d in draws) for c in cells}  # closed-form cells: once a draw
    d = cls(cells, budgets, sampler_seed, journal, direction="maximize" if mode == "max" else "minimize", asha=asha,
            redraws=redraws)
    return DesignSearcher(d, metric=metric, mode=mode, defer=defer, epochs_max=epochs_max, draws=draws)


def PerCellOptunaSearch(cells, trials_per_cell: int, lr, epochs, sampler_seed: int, journal: Path, *,  # noqa: N802
                        asha: bool = False, startup_trials: int | None = None, metric: str = "selection_acc",
                        mode: str = "max", defer=None, grids=None, steps=None, design: str = "tpe",
                        reevaluate: int = 0, converge=None, draws=()) -> DesignSearcher:
    """The searcher from plain arguments (one budget for every cell; ``grids``: grid name -> search settings for
    cells of that grid; ``draws``: DesignSearcher's): what tests and the sweep's tune stage build."""
    default = Budget(trials_per_cell, tuple(lr), ("steps", tuple(steps)) if steps else ("epochs", tuple(epochs)),
                     startup_trials, reevaluate, converge=converge_of(converge))
    per = {name: budget_of(g) for name, g in (grids or {}).items()}
    budgets = {c["cell_id"]: per.get(c.get("grid"), default) for c in cells}
    return make_searcher(cells, budgets, design, sampler_seed, journal, metric=metric, mode=mode, asha=asha,
                         defer=defer, epochs_max=epochs[1] if epochs else None, draws=draws)


PerCellOptunaSearch.FINISHED = Searcher.FINISHED


def budget_of(search) -> Budget:
    """A spec ``SearchSpec`` as a cell budget."""
    return Budget(search.trials_per_cell, tuple(search.lr), (search.length[0], tuple(search.length[1])),
                  search.startup_trials, getattr(search, "reevaluate", 0), getattr(search, "explore", None) or 2,
                  tuple(getattr(search, "lattice", (9, 5))), converge_of(getattr(search, "converge", None)))
