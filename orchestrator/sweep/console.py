"""What a sweep prints: one line per stage (what it is doing), stage timings, and nothing from Ray, Tune or
MLflow unless ``--verbose``. Stage times are kept for the parent run (metrics ``stage_<name>_seconds``)."""
from __future__ import annotations

import concurrent.futures.thread as cft
import logging
import os
import sys
import threading
import time
import warnings
from contextlib import contextmanager
from typing import Callable

# Stage names, in the order a sweep runs them (docs/usage.md, "What a sweep does").
STAGES = ("imports", "spec", "models", "ray", "dense", "diagnostics", "masks", "draws", "parent", "tune_start",
          "trials", "mlflow_flush", "ray_shutdown", "report")  # draws: only with search.calib_draws


def process_age() -> float:
    """Seconds since this process started (Linux /proc; elsewhere 0): the CLI's start-up and imports."""
    try:
        ticks = os.sysconf("SC_CLK_TCK")
        start = int(open("/proc/self/stat").read().rsplit(")", 1)[1].split()[19]) / ticks
        btime = next(int(ln.split()[1]) for ln in open("/proc/stat") if ln.startswith("btime"))
        return max(0.0, time.time() - (btime + start))
    except (OSError, ValueError, StopIteration):
        return 0.0


def quiet_libraries(verbose: bool) -> None:
    """Silence third-party chatter before Ray, Tune and MLflow are imported (environment is inherited by Ray
    workers). Each line of the issue's list: Ray's token-authentication notice, Tune's experiment box and
    TensorBoard hint (old output engine at verbose=0 prints neither), Tune's slow-callback warnings, MLflow's
    table-creation INFO, "View run ... at http://" and "Downloading artifacts" bars."""
    env = os.environ
    env.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    # MLflow's usage telemetry (on by default outside CI: a thread posting usage events to mlflow-telemetry.io): a
    # sweep sends nothing anywhere, as with Ray's usage stats above. MLFLOW_DISABLE_TELEMETRY=false opts in.
    env.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
    # No TensorBoard/CSV/JSON result files per trial: nothing reads them (MLflow holds every metric).
    env.setdefault("TUNE_DISABLE_AUTO_CALLBACK_LOGGERS", "1")
    # Intermediate results may omit selection_acc when no scheduler needs it (tasks/trial.py, epoch_selection).
    env.setdefault("TUNE_DISABLE_STRICT_METRIC_CHECKING", "1")
    # num_to_keep=1 forces an experiment-state snapshot after each trial checkpoint; Tune warns on every one.
    env.setdefault("TUNE_WARN_EXCESSIVE_EXPERIMENT_CHECKPOINT_SYNC_THRESHOLD_S", "0")
    loggers = ("mlflow", "alembic", "ray._private.authentication.authentication_token_setup", "ray.tune",
               "ray.train", "ray.air")
    if verbose:
        for name in loggers:
            logging.getLogger(name).setLevel(logging.NOTSET)
        return
    env.setdefault("RAY_AIR_NEW_OUTPUT", "0")
    # A failed trial is one line (orchestrator/tracking/logger.py), not Tune's traceback of the worker's error
    env.setdefault("TUNE_PRINT_ALL_TRIAL_ERRORS", "0")
    env.setdefault("TUNE_WARN_THRESHOLD_S", "1000000")
    env.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
    # MLflow sets its own loggers to INFO when it is imported, which a sweep does late (in the thread that opens
    # the tracking store while Tune starts): without this the ERROR level below would be undone.
    env.setdefault("MLFLOW_CONFIGURE_LOGGING", "false")
    env.setdefault("MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT", "true")
    env.setdefault("PYTHONWARNINGS", "ignore")
    for name in loggers:
        logging.getLogger(name).setLevel(logging.ERROR)
    # Tune's "Saving experiment state failed" traceback (e.g. a full disk, which the sweep reports in one line):
    # a sweep resumes from its own files, never from Tune's experiment state (orchestrator/rundir/files.py).
    logging.getLogger("ray.tune.execution.experiment_state").setLevel(logging.CRITICAL)
    # MLflow's SQLAlchemy store logs every OperationalError with its traceback (logger.exception) before raising
    # it again as an MlflowException; a full or damaged tracking database then ends in the sweep's one line
    # (orchestrator/rundir/faults.py), any other failing write in the writer's one warning line.
    logging.getLogger("mlflow.store.db.utils").setLevel(logging.CRITICAL)

    warnings.filterwarnings("ignore")
    if not getattr(sys.unraisablehook, "healsweep", False):  # once per process (quiet_libraries may run again)
        sys.unraisablehook = fork_race_to_log(sys.unraisablehook)


def fork_race_to_log(previous: Callable) -> Callable:
    """An unraisable hook that logs (DEBUG, logger ``healsweep``) CPython's "release unlocked lock" from
    ``concurrent.futures.thread``'s after-fork hook in the parent, and passes everything else to ``previous``.

    A fork from one thread (Ray starting its processes with a ``preexec_fn``) while another thread imports (the
    driver imports MLflow and the search modules aside while Ray starts) can run that module's after-fork
    ``_global_shutdown_lock.release`` on a lock its before-fork hook did not take: Python prints "Exception
    ignored in ... RuntimeError: release unlocked lock" with a traceback on stderr. The lock ends unlocked,
    as it should; nothing is lost. Seen once in 82 e2e tests (2026-11-27, tests/e2e/test_model_sources.py);
    not reproducible at will (1 of ~20 tries of a script); the hook is tested in tests/orchestrator/test_console.py."""
    def hook(u) -> None:
        if isinstance(u.exc_value, RuntimeError) and str(u.exc_value) == "release unlocked lock" \
                and u.object == cft._global_shutdown_lock.release:
            logging.getLogger("healsweep").debug("ignored at fork: %s in %r", u.exc_value, u.object)
            return
        previous(u)
    hook.healsweep = True
    return hook


class StageClock:
    """Times named stages; ``say`` prints one status line per stage to stderr (``enabled=False``: silent)."""

    def __init__(self, enabled: bool = True, stream=None) -> None:
        self.enabled, self.stream = enabled, stream or sys.stderr
        self.seconds: dict[str, float] = {}
        self.trial_compute: float | None = None  # Σ trial compute, shown next to the trials' wall time

    _lock = threading.Lock()  # the models stage says its line from a thread while Ray's start says its own

    def say(self, text: str) -> None:
        """One status line, written whole: print() writes the text and its newline apart, so two threads' lines
        ran together ('[models] models: r18ckhealsweep: [ray] ...')."""
        if self.enabled:
            with self._lock:
                self.stream.write(f"healsweep: {text}\n")
                self.stream.flush()

    @contextmanager
    def stage(self, name: str, doing: str | None = None):
        if doing:
            self.say(f"[{name}] {doing}")
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.add(name, time.perf_counter() - t0)

    def add(self, name: str, seconds: float) -> None:
        self.seconds[name] = self.seconds.get(name, 0.0) + seconds

    def metrics(self) -> dict[str, float]:
        return {f"stage_{k}_seconds": v for k, v in self.seconds.items()}

    def summary(self) -> str:
        order = [s for s in STAGES if s in self.seconds] + [s for s in self.seconds if s not in STAGES]
        parts = [f"{s} {self.seconds[s]:.1f}" for s in order]
        if self.trial_compute is not None:
            parts = [p + f" (sum of trial compute {self.trial_compute:.1f})" if p.startswith("trials ") else p
                     for p in parts]
        return "stage times (s): " + ", ".join(parts)


class TrialProgress:
    """Tune callback: one bar over every trial; its postfix is the last finished trial's cell, with that cell's
    finished/total trials and best selection accuracy (per cell, never a max over the sweep). ``dropped``
    (``search.converge``: the counts are caps): planned trials the search has dropped so far; the bar's total
    shrinks by them, and a cell's count reads "3/≤8"."""

    def __init__(self, per_cell: dict[str, int], enabled: bool, dropped: Callable[[], int] | None = None) -> None:
        from ray.tune import Callback
        from tqdm.auto import tqdm

        planned = sum(per_cell.values())
        bar = tqdm(total=planned, desc="trials", unit="trial", disable=not enabled)
        cap = "≤" if dropped is not None else ""
        done: dict[str, int] = {}
        best: dict[str, float] = {}

        def finish(trial, ok: bool) -> None:
            cell = trial.config.get("cell_id", "?")
            done[cell] = done.get(cell, 0) + 1
            sel = (trial.last_result or {}).get("selection_acc") if ok else None
            if sel is not None:
                best[cell] = max(best.get(cell, float("-inf")), float(sel))
            if dropped is not None and planned - dropped() != bar.total:
                bar.total = planned - dropped()
            bar.update(1)
            shown = f"{best[cell]:.3f}" if cell in best else "-"
            c = trial.config
            where = f"{c.get('model', '')} {c.get('pruner', '')} sparsity {c.get('sparsity', '?')} " \
                    f"calib {c.get('calib_size', '?')} {c.get('healer', '')}"
            bar.set_postfix_str(f"{where}: {done[cell]}/{cap}{per_cell.get(cell, '?')} trials, best selection_acc {shown}")

        class Cb(Callback):
            def on_trial_complete(self, iteration, trials, trial, **info):
                finish(trial, True)

            def on_trial_error(self, iteration, trials, trial, **info):
                finish(trial, False)

        self.callback, self.bar = Cb(), bar
