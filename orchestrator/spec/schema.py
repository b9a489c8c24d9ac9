"""The parsed sweep spec: frozen dataclasses, one per section (what ``parse_spec`` returns; a leaf module)."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Mapping

from orchestrator.spec.axes import axis_sizes


@dataclass(frozen=True)
class MethodRef:
    name: str
    settings: Mapping[str, Any] = field(default_factory=dict)
    # Optional restrictions of one pruner/healer entry (the grid is otherwise a full cross product):
    models: tuple[str, ...] | None = None  # only these models of the sweep
    sparsities: tuple[float, ...] | None = None  # pruners: this sparsity list instead of the sweep's
    scope: str | None = None  # pruners: this scope instead of the model's (e.g. CORP's mlp_qk on a ViT)

    def applies_to(self, model: str) -> bool:
        return self.models is None or model in self.models


@dataclass(frozen=True)
class Converge:
    """``search.converge``: the per-cell stopping rule and the adaptive re-evaluations."""
    se_target: float = 0.005  # standard error of the quoted mean the re-evaluations aim at (accuracy units)
    reevaluate_max: int = 6  # cap on re-evaluations per cell
    min_noise: float = 0.005  # floor of a single draw's noise in the stopping rule
    widen_steps: int = 6  # lattice steps the lr axis may grow past the declared box, each side
    batch: int = 2  # points a continuing cell tries per wave after the first (fewer waves: fewer waits)
    widen_growth: int = 2  # a walk past the box reaches (D + 1) * growth**j steps out (1: D + 1, …, D + batch)
    family_waves: int = 2  # waves whose family-wide results the surface pools; later ones: the cell's own only
    bracket: int = 1  # 1: a walk from a winner alone at its length also tries the box's middle (rule 1c); 0: not
    pick: int = 1  # 1: quote the centre of the best plateau of tied draws (orchestrator/search/pick.py); 0: the best draw

    def reevaluations(self, base: int) -> int:
        """Re-evaluation slots a cell plans (its cap): ``reevaluate_max``, unless re-evaluation is off (0)."""
        return max(base, self.reevaluate_max) if base else base


def converge_of(raw) -> Converge | None:
    """The spec's ``search.converge`` mapping (None, or {} for the defaults) as a ``Converge``."""
    if raw is None or raw is False:
        return None
    return Converge(**({} if raw is True else dict(raw)))


@dataclass(frozen=True)
class SearchSpec:
    # The defaults are the default sweep's measured design (configs/default.yaml, docs/methods.md#search-design). A
    # spec without a search section ran 4 trials on lr 1e-4..3e-3 x epochs 1..8 before 2026-12-01: one sampler-seed
    # change moved an N:M spec's cells by up to 13.75 pp (noise covered 22 of 32, 4 orderings reversed); with these
    # 3.61 pp, 27 of 32, 2 reversed (benchmarks/results/retest_nm_2026-12-01_*).
    trials_per_cell: int = 3
    lr: tuple[float, float] = (1e-4, 1e-2)  # log-uniform bounds
    epochs: tuple[int, int] | None = None  # integer bounds, inclusive; None when ``steps`` is searched instead
    objective: str = "selection_acc"  # selection_acc (max, labeled) | heldout_align (min, label-free)
    sampler_seed: int = 0
    startup_trials: int | None = None  # random trials before TPE per cell; None: trials_per_cell // 2 (1..10)
    scheduler: str = "fifo"  # fifo | asha (ASHA: Optuna searches lr only, every trial gets epochs[1] epochs)
    asha_grace_period: int = 1  # epochs before ASHA may stop a trial
    asha_reduction_factor: int = 2
    # optimizer steps per trial, integer bounds (docs/methods.md#search): the budget does not depend on calib_size;
    # None when ``epochs`` is searched instead (a spec that gives epochs, or scheduler asha: epochs (1, 8))
    steps: tuple[int, int] | None = (4, 64)
    widen: Mapping[str, Any] | None = None  # {rounds, factor}: extra rounds past the boundary (orchestrator/lifecycle/widen.py)
    # The search design (orchestrator/search, docs/methods.md#search-design): shared | tpe | grid
    design: str | None = None  # None: shared (tpe under scheduler asha)
    reevaluate: int = 2  # fresh healing seeds the winner of every searched cell is healed again on (0: none)
    explore: int | None = None  # shared: first-wave (space-filling) points per cell (None: min(2, trials)); the rest family-ranked
    lattice: tuple[int, int] = (9, 5)  # shared/grid: log-spaced points on the lr and length axes
    # shared: {se_target, reevaluate_max, min_noise, widen_steps} (or {}): trials_per_cell becomes a per-cell cap, the
    # search stops when it converges, re-evaluations follow their spread (orchestrator/search/converge.py); None: fixed
    converge: Mapping[str, Any] | None = None
    # re-evaluation k heals on calibration draw k mod calib_draws of its own (calib_seed + 1000 (j + 1), j < calib_draws:
    # orchestrator/sweep/draws.py), so the quoted mean and its noise span draws; 0: every trial on the sweep's draw
    calib_draws: int = 0

    @property
    def per_cell(self) -> int:
        """Trials a searched cell runs: its search trials (every lattice point under design grid), then the
        re-evaluations of its winner."""
        search = self.points if self.design == "grid" else self.trials_per_cell
        return search + self.reevaluate

    @property
    def points(self) -> int:
        """The distinct lattice points of the box: ``lattice`` a x b, fewer where bounds are equal or integer
        lengths round together (orchestrator/spec/axes.py)."""
        a, b = axis_sizes(self.lr, self.length[1], self.lattice)
        return a * b

    @property
    def max_per_cell(self) -> int:
        """``per_cell``, or under ``converge`` its cap: every search trial and the most re-evaluations."""
        if self.converge is None:
            return self.per_cell
        return self.trials_per_cell + self.max_reevaluations

    @property
    def max_reevaluations(self) -> int:
        """The most re-evaluations a searched cell runs: ``reevaluate``, under ``converge`` up to its cap."""
        return self.reevaluate if self.converge is None else converge_of(self.converge).reevaluations(self.reevaluate)

    @property
    def length(self) -> tuple[str, tuple[int, int]]:
        """("steps", bounds) or ("epochs", bounds): the searched training length."""
        return ("steps", self.steps) if self.steps is not None else ("epochs", self.epochs)


@dataclass(frozen=True)
class HealSpec:
    batch_size: int = 32
    weight_decay: float = 0.0
    lr_min: float = 1e-6
    precision: str = "fp32"  # fp32 (the authors') | tf32 | bf16 (autocast): tasks/healing/precision.py
    channels_last: Any = "auto"  # auto (CNNs on a GPU) | true | false: the memory format of healed CNNs
    compile: str = "off"  # off (the authors': eager) | blocks (regional torch.compile): tasks/healing/compiled.py
    latency_rounds: int = 20  # timed rounds of a structured pruner's dense-vs-shrunk latency (CORP); dry run: 1
    graph: str = "off"  # off (the authors': eager) | step (the whole step as one CUDA graph): tasks/healing/graphed.py


@dataclass(frozen=True)
class ResourceSpec:
    cpus_per_trial: float = 1.0
    gpus_per_trial: float = 0.0
    max_concurrent: int | None = None  # None: as many as the cluster's CPUs allow
    cpus_per_dense_task: float = 1.0
    gpus_per_dense_task: float = 0.0
    max_failures: int = 2  # retries of a failed trial, each from its last per-epoch checkpoint
    reuse_actors: bool = True
    # where trials, dense and mask tasks compute: auto = on the GPU Ray gave them (gpus_per_* > 0), else the CPU;
    # cpu = always the CPU (e.g. to pack trials by Ray's logical GPU resources on a CPU machine); cuda = the GPU
    device: str = "auto"

    def peak_request(self) -> dict[str, float]:
        """The largest single placement the sweep asks for, as Ray resource names ({"CPU": .., "GPU": ..}): a
        cluster whose largest node offers less can never place a trial or dense task (check before Tune starts)."""
        return {"CPU": max(self.cpus_per_trial, self.cpus_per_dense_task),
                "GPU": max(self.gpus_per_trial, self.gpus_per_dense_task)}


@dataclass(frozen=True)
class StoreSpec:
    shard_size: int = 64
    dtype: str = "float16"
    uri: str | None = None  # where dense targets live: an absolute path or a URI (file, s3, gs, hdfs); None: <--store>/targets
    budget_gb: float | None = None  # disk budget of the target store; None: unlimited
    on_budget: str = "refuse"  # over budget: "refuse" (error before any compute) | "recompute" (in each trial)
    targets: str = "auto"  # store | recompute | auto (the faster, measured on a GPU trial's device): orchestrator/sweep/planner.py


@dataclass(frozen=True)
class MlflowSpec:
    tracking_uri: str | None = None  # None: sqlite database in the run directory
    experiment: str = "healsweep"


@dataclass(frozen=True)
class SweepSpec:
    name: str
    models: tuple[str, ...]
    sparsities: tuple[float, ...]
    calib_sizes: tuple[int, ...]
    pruners: tuple[MethodRef, ...]
    healers: tuple[MethodRef, ...]
    dataset: str = "digits"
    data_seed: int = 0
    seeds: tuple[int, ...] = (0,)
    scope: Mapping[str, str] = field(default_factory=dict)  # model -> scope; missing: the adapter's default
    search: SearchSpec = SearchSpec()
    heal: HealSpec = HealSpec()
    resources: ResourceSpec = ResourceSpec()
    store: StoreSpec = StoreSpec()
    mlflow: MlflowSpec = MlflowSpec()
    plugins: tuple[str, ...] = ()  # modules imported before validation and in every trial (custom methods)
    model_refs: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)  # name -> tasks.models.ModelRef dict
    dataset_settings: Mapping[str, Any] = field(default_factory=dict)  # `dataset: {name: ..., <settings>}`
    offline: bool = False  # no downloads: weights must be in the local cache
    # which calibration images: 0 = the first n of the data seed's calibration order; k > 0 = the first n of a
    # seeded reordering of the calibration split (another n-image draw; tasks.data.redraw_calibration)
    calib_seed: int = 0
    grids: tuple = ()  # extra grids run in the same sweep (GridSpec below, orchestrator/spec/grids.py)
    cells: tuple[str, ...] = ()  # only these cell ids (a widening round, orchestrator/lifecycle/widen.py); (): every cell

    def to_dict(self) -> dict:
        return asdict(self)

    def load_kwargs(self, model: str) -> dict:
        """Extra ``tasks.models.load_model`` arguments for a model; {} for a reference model's shipped weights on the
        data seed's calibration order."""
        ref = self.model_refs.get(model)
        draw = {"calib_seed": self.calib_seed} if self.calib_seed else {}
        if not ref or (ref.get("source", "reference") == "reference" and not ref.get("path")):
            return draw
        return {"source": dict(ref), "dataset": {"name": self.dataset, **self.dataset_settings}, **draw}


@dataclass(frozen=True)
class GridSpec:
    """One extra grid; ``None`` fields are inherited from the top-level spec."""

    name: str
    models: tuple[str, ...] | None = None
    sparsities: tuple[float, ...] | None = None
    calib_sizes: tuple[int, ...] | None = None
    pruners: tuple | None = None  # tuple[MethodRef, ...]
    healers: tuple | None = None
    seeds: tuple[int, ...] | None = None
    search: Mapping[str, Any] = field(default_factory=dict)  # only SEARCH_KEYS, already validated
