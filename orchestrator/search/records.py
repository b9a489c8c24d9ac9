"""The search's plain records: the stages, a cell's budget, an ask, a queue slot, the ask/tell counts, the seeds
and names every design derives the same way, and the Optuna journal that holds them (a leaf: ``base`` builds the
designs' shared machinery on it)."""
from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

import optuna
from optuna.trial import TrialState

from orchestrator.spec.registries import get, resolve_healer
from tasks.catalog import changes_with_draw

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


def redrawn_cell(cell: Mapping[str, Any]) -> bool:
    """True when search.calib_draws re-evaluates the cell on the other calibration draws: a searched cell (its winner
    heals again on them), or a closed-form one whose healer or pruner reads the calibration images (CR+BN, CORP; RR,
    SnapViT, CORP masks), so that another draw can change its number. A closed-form healer on a mask that reads none
    (``none`` on magnitude) gives the same number on every draw: it runs once."""
    if "healer" not in cell:
        return False
    return changes_with_draw(get("pruner", cell["pruner"]), resolve_healer(cell["healer"], cell.get("healer_settings")))


def cell_sampler_seed(sampler_seed: int, key: str, number: int = 0) -> int:
    return int(hashlib.sha256(f"{sampler_seed}:{key}:{number}".encode()).hexdigest()[:8], 16)


def reevaluation_seeds(seed: int, n: int) -> list[int]:
    """The fresh healing seeds of a cell's re-evaluations: never the cell's own seed (its search trials used it),
    and the same for every sampler seed, so two searches that find the same winner report the same number."""
    return [1000 * (k + 1) + seed for k in range(n)]


def reevaluation_draws(calib_seed: int, n: int) -> list[int]:
    """The ``calib_seed`` of each of the ``n`` other calibration draws re-evaluations heal on (search.calib_draws):
    never the sweep's own draw, and apart from the draws of a sweep whose calib_seed is one more (a retest on the
    next draw, benchmarks/bench_retest.py run D, shares none of them)."""
    return [1000 * (k + 1) + calib_seed for k in range(n)]


def reevaluation_index(seed: int, heal_seed: int) -> int:
    """k of ``reevaluation_seeds(seed, n)[k] == heal_seed``: the re-evaluation's rank among those of its
    configuration (``base._fresh_seed``)."""
    return (heal_seed - seed) // 1000 - 1


def draw_of_reevaluation(index: int, n_draws: int) -> int | None:
    """Which of the ``n_draws`` draws the ``index``-th re-evaluation of a configuration (``reevaluation_index``)
    heals on, cycling; None when there are none (every trial on the sweep's own draw)."""
    return index % n_draws if n_draws else None


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
