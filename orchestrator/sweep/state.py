"""The sweep's state: what its stages (orchestrator/sweep/run.py) hand each other, typed, in one leaf module.

Threads. The stages run in the driver's main thread and are the only writers of :class:`SweepState`. Two stages
run in a thread of their own and write nothing into it: the models stage on a local instance (``run.py``: while Ray
starts; it reads the spec and the paths and returns a :class:`ModelsPart`) and the MLflow parent stage
(``parent.py``: beside Tune's start; it reads the state, written by no stage after the masks, and returns a
:class:`ParentRun`). Their results cross threads through one mechanism, a :class:`Handoff`: the first ``get()``
(from any thread) joins the stage's thread under a lock and re-raises its error; every later caller reads the same
result. The main thread copies the models' part into the state (``run.py`` ``take_models``); the parent run is
read through ``SweepState.tracking()`` (by the trial logger in the main thread and the MLflow writer's thread).
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Generic, TypeVar

from orchestrator.rundir.files import JOURNAL_FILE

if TYPE_CHECKING:  # types only: this module stays a leaf
    from mlflow import MlflowClient

    from orchestrator.raytune.node_guard import NodeGuard
    from orchestrator.search import PerCellOptunaSearch
    from orchestrator.spec import SweepSpec
    from orchestrator.spec.plan import Cell
    from orchestrator.sweep.console import StageClock
    from orchestrator.sweep.dense import DenseReport
    from orchestrator.sweep.diagnostics import DiagnosticsResult
    from orchestrator.sweep.model_facts import ModelInfo
    from orchestrator.sweep.stages import MaskResult
    from orchestrator.tracking.logger import MlflowTrialLogger
    from orchestrator.tracking.writer import AsyncMlflowWriter


@dataclass
class SweepResult:
    """What ``run_sweep`` returns."""
    sweep_id: str
    out_dir: Path
    tracking_uri: str
    parent_run_id: str
    trials_finished: int
    trials_failed: int
    dense_forward_images: int
    seconds: float
    report: dict | None
    stage_seconds: dict[str, float] = field(default_factory=dict)
    trials_planned: int = 0  # the sweep's trials, every session (told before this one + this session's)
    interrupted: int | None = None  # the signal (SIGINT/SIGTERM) that stopped it: a partial sweep, resumable


T = TypeVar("T")


@dataclass(frozen=True)
class ModelsPart:
    """The models stage's result: each model's facts, the cells, calibration rows per model, the store budget's
    mode per model."""
    models: dict[str, ModelInfo]
    cells: list[Cell]
    rows: dict[str, int]
    modes: dict[str, str]


@dataclass(frozen=True)
class ParentRun:
    """The parent stage's result: the MLflow client and the sweep's parent run id ("" before it exists)."""
    client: MlflowClient | None
    run_id: str


class Handoff(Generic[T]):
    """The one hand-off between threads: a stage's thread returns its result; the first ``get()`` (from any
    thread) joins it under a lock and re-raises its error; later calls return the same result."""

    def __init__(self, join: Callable[[], T]) -> None:
        self._join, self._lock, self._run = join, threading.Lock(), None

    def get(self) -> T:
        with self._lock:
            if self._run is None:
                self._run = self._join()
            return self._run

    @property
    def done(self) -> bool:
        return self._run is not None


@dataclass
class TuneParts:
    """The trials stage's parts and figures (run.py ``tune_stage``), read by the sweep's end (end.py)."""
    writer: AsyncMlflowWriter | None = None
    searcher: PerCellOptunaSearch | None = None
    logger: MlflowTrialLogger | None = None
    concurrency: int = 0  # trials at once when the trials started (logged)
    max_concurrent: int | None = None  # Tune's cap (None: as many as the cluster fits, growing with it)
    planned: int = 0  # told before this session + this session's
    seconds: float = 0.0  # the trials' wall time
    freed: int = 0  # bytes of Tune epoch checkpoints removed after the fit


@dataclass
class SweepState:
    """What the stages hand each other (see the module's docstring for who writes what, and when)."""
    spec: SweepSpec
    out_dir: Path
    store_dir: Path
    cache_dir: Path
    info: dict  # sweep.json (orchestrator/rundir/files.py)
    paths: dict[str, str]  # store, targets, masks, diagnostics, rankings, cache, out (stages.store_paths)
    resume: bool
    refine_round: int | None
    clock: StageClock
    models: dict[str, ModelInfo] = field(default_factory=dict)
    cells: list[Cell] = field(default_factory=list)
    rows: dict[str, int] = field(default_factory=dict)  # model -> calibration rows its cells need
    modes: dict[str, str] = field(default_factory=dict)  # model -> "store" | "recompute" (the store budget)
    plan: dict[str, dict] = field(default_factory=dict)  # model -> the planner's decision (sweep/planner.py)
    dense: dict[str, int] = field(default_factory=dict)  # model -> dense images computed this session
    dense_rep: DenseReport | None = None
    diag: DiagnosticsResult | None = None
    preloaded: dict[str, ModelInfo] | None = None  # prepared by the caller (run_sweep(models=...))
    mask_keys: MaskResult | None = None  # {cell_id: key} + provenance
    draws: list = field(default_factory=list)  # search.calib_draws: orchestrator/sweep/draws.py Draw per other draw
    on_cluster: bool = False  # --address given: model, mask and dense work goes to Ray tasks on the workers
    guard: NodeGuard | None = None  # on a cluster: nodes that cannot import the project
    store_holds: list = field(default_factory=list)  # open lock files: store gc keeps out (rundir/store_users.py)
    parent_stage: Handoff[ParentRun] | None = None
    tune: TuneParts = field(default_factory=TuneParts)
    dense_total: int = 0  # dense forward images over every session of the sweep (resume/refine included)
    retry_failed: bool = False  # run --resume --retry-failed: failed trials asked again (tracking/retry.py)

    def tracking(self) -> ParentRun:
        """The parent run once the parent stage is done (joined at the first call; its error re-raised here);
        ``ParentRun(None, "")`` before the parent stage started."""
        return self.parent_stage.get() if self.parent_stage is not None else ParentRun(None, "")

    @property
    def journal(self) -> Path:
        return self.out_dir / JOURNAL_FILE

    @property
    def session(self) -> int:
        return self.info.get("resumes", 0)
