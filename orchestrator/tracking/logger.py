"""MLflow logging from the driver (single writer): one parent run per sweep, one child run per trial."""
from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Mapping

from ray.tune import Callback

from orchestrator.tracking.store import experiment_id
from orchestrator.tracking.writer import AsyncMlflowWriter

if TYPE_CHECKING:
    from mlflow import MlflowClient

# MLflow (~1-2 s of imports) is imported where it is used, so that Tune can start before it is: a sweep opens its
# tracking store and parent run in a thread while Tune starts the trial actors (orchestrator/sweep/parent.py).

TRIAL_PARAMS = ("model", "pruner", "scope", "sparsity", "calib_size", "healer", "granularity", "seed", "lr",
                "epochs", "batch_size", "target_mode", "grid")
EPOCH_METRICS = ("train_loss", "selection_acc", "rows_streamed")
FINAL_METRICS = ("dense_acc", "pruned_acc", "healed_acc", "retention", "heal_seconds", "dense_forward_images",
                 "mask_violations", "achieved_sparsity")
# Bookkeeping keys Ray Tune adds to every result; not metrics of the trial.
TUNE_KEYS = {"epoch", "final", "training_iteration", "timestamp", "time_this_iter_s", "time_total_s", "pid",
             "time_since_restore", "iterations_since_restore", "done", "date", "hostname", "node_ip",
             "trial_id", "experiment_id", "config", "should_checkpoint", "checkpoint_dir_name", "diverged",
             "disk_full", "disk_full_path", "disk_full_needed", "disk_full_what"}


def start_parent(client: MlflowClient, experiment: str, sweep_id: str, name: str, params: Mapping[str, Any]) -> str:
    from mlflow.entities import Param

    run = client.create_run(experiment_id(client, experiment), run_name=name,
                            tags={"sweep_id": sweep_id, "healsweep.role": "sweep"})
    client.log_batch(run.info.run_id, params=[Param(k, str(v)[:6000]) for k, v in params.items()])
    return run.info.run_id


class MlflowTrialLogger(Callback):
    """Tune callback in the driver: maps Tune trials to MLflow child runs (one per trial key
    ``<cell_id>-<optuna trial number>``, tagged ``trial_id``). Every write goes through the asynchronous
    single writer, so the Tune loop never waits on the tracking server. With ``replace`` (a resumed sweep),
    any earlier run of a trial key that is run again is deleted first: no duplicate child runs."""

    def __init__(self, writer: AsyncMlflowWriter, experiment: str, sweep_id: str,
                 parent_run_id: str | Callable[[], str], dense_images: Mapping[str, int],
                 replace: bool = False) -> None:
        self.writer, self.experiment, self._parent = writer, experiment, parent_run_id
        self.client: MlflowClient | None = None  # opened at the first callback (see _open)
        self.exp_id = self.parent = None
        self.sweep_id, self.replace = sweep_id, replace
        self.dense_images = dict(dense_images)  # model -> dense forward images computed by this sweep
        self.runs: dict[str, str] = {}  # trial key -> mlflow run id (filled by the writer thread)
        self.keys: dict[str, str] = {}  # tune trial id -> trial key
        self.nodes: dict[str, set[str]] = {}  # trial key -> node ids its results came from
        self.retries: dict[str, int] = {}  # trial key -> times Tune retried it
        self.node_faults: dict[str, int] = {}  # trial key -> node faults already said (trial_faults' own line)
        self.finished = self.failed = 0
        self.callback_seconds = 0.0  # driver time spent in these callbacks (enqueueing)
        self.trial_seconds = 0.0  # Σ trial_seconds of the final results (compute inside the trials)
        if not callable(parent_run_id):  # everything given: opened now
            self._open()

    def _open(self) -> None:
        """Client, experiment and parent run at the first callback: ``parent_run_id`` may be a callable that joins
        the thread creating the parent run (re-raising its error), which is done by the time a trial starts."""
        if self.parent is None:
            self.parent = self._parent() if callable(self._parent) else self._parent
            self.client = self.writer.client
            self.exp_id = experiment_id(self.client, self.experiment)

    def __getstate__(self) -> dict:  # Tune pickles its callbacks: without the thread-joining callable
        return {**self.__dict__, "_parent": self.parent if callable(self._parent) else self._parent}

    def _timed(fn):  # noqa: N805 - decorator inside the class body
        def wrapper(self, *a, **kw):
            t0 = time.perf_counter()
            try:
                self._open()
                return fn(self, *a, **kw)
            finally:
                self.callback_seconds += time.perf_counter() - t0
        return wrapper

    def _run_id(self, key: str):
        return lambda: self.runs.get(key)

    @_timed
    def on_trial_start(self, iteration, trials, trial, **info):
        from mlflow.entities import Param

        c = trial.config
        key = c["trial_id"]
        if trial.trial_id in self.keys:  # restarted after a failure: same child run
            return
        self.keys[trial.trial_id] = key
        tags = {"mlflow.parentRunId": self.parent, "sweep_id": self.sweep_id, "cell_id": c["cell_id"],
                "trial_id": key, "store_key": c["store_key"], "mask_key": c["mask_key"],
                "target_mode": c.get("target_mode", "store"),
                "pattern": c["pattern"], "healsweep.role": "trial", "tune_trial_id": trial.trial_id,
                "stage": c.get("stage", "search")}  # search | reevaluate (the winner on a fresh healing seed)
        granularity = c["healer_settings"].get("granularity", "auto")
        if granularity == "auto":
            granularity = c["default_granularity"]
        values = {"grid": "main", **c, "granularity": granularity}
        params = [Param(k, str(values[k])) for k in TRIAL_PARAMS]
        params += [Param("pruner_settings", str(dict(c["pruner_settings"]))),  # resolved (plan.grid)
                   Param("healer_settings", str(dict(c["healer_settings"]))),
                   Param("optuna_trial", str(c["optuna_trial"])), Param("device", str(c.get("device", "cpu"))),
                   Param("precision", str(c.get("precision", "fp32"))),  # heal.precision: a named numeric setting
                   Param("channels_last", str(c.get("channels_last", "auto"))),
                   Param("compile", str(c.get("compile", "off"))),  # heal.compile: eager (the authors') or compiled
                   Param("graph", str(c.get("graph", "off"))),  # heal.graph: eager (the authors') or one CUDA graph
                   Param("latency_rounds", str(c.get("latency_rounds", 20)))]  # heal.latency_rounds (CORP's timing)
        if c.get("heal_seed") is not None:  # a re-evaluation: the healing seed (``seed`` stays the cell's: its mask)
            params.append(Param("heal_seed", str(c["heal_seed"])))
        if c.get("calib_draw") is not None:  # a re-evaluation on another calibration draw (search.calib_draws)
            params.append(Param("calib_seed", str(c["load_kw"].get("calib_seed", 0))))
        if "steps" in c:  # a steps-based search (docs/methods.md#search): the budget; `epochs` is what it needed
            params.append(Param("steps", str(c["steps"])))

        def create():
            if self.replace:
                for old in self.client.search_runs([self.exp_id], f"tags.sweep_id = '{self.sweep_id}' and "
                                                                  f"tags.trial_id = '{key}'"):
                    if old.info.status == "RUNNING":  # the stopped session's run: ended as what happened to it
                        self.client.set_terminated(old.info.run_id, "KILLED")
                    self.client.delete_run(old.info.run_id)  # kept by MLflow as deleted (hidden; `mlflow gc`)
            run = self.client.create_run(self.exp_id, run_name=key, tags=tags)
            self.runs[key] = run.info.run_id
            self.client.log_batch(run.info.run_id, params=params)
        self.writer.submit(create)

    @_timed
    def on_trial_result(self, iteration, trials, trial, result, **info):
        from mlflow.entities import Metric, Param, RunTag

        key = self.keys.get(trial.trial_id)
        if key is None:
            return
        if "node_id" in result:  # every node any attempt of this trial ran on (tag ``nodes`` at the end)
            self.nodes.setdefault(key, set()).add(str(result["node_id"]))
        if result.get("final") and self.nodes.get(key):
            nodes = ",".join(sorted(self.nodes[key]))
            self.writer.submit(lambda: self.client.set_tag(self.runs[key], "nodes", nodes))
        history = [Metric(k, float(h[k]), int(time.time() * 1000), int(h.get("epoch", 0)))
                   for h in result.get("epoch_history") or () for k in EPOCH_METRICS if k in h]
        if history:  # epochs the trial sent with this result (orchestrator/raytune/trainable.py): logged at their steps
            self.writer.log_metrics(self._run_id(key), history)
        if result.get("diverged") or result.get("disk_full"):
            reason = str(result.get("failure_reason", "diverged"))[:5000]
            self.writer.submit(lambda: self.client.set_tag(self.runs[key], "failure_reason", reason))
            if "node_id" in result:  # where it ran, as for a finished trial
                node = str(result["node_id"])
                self.writer.submit(lambda: self.client.set_tag(self.runs[key], "node_id", node))
            return
        ts, step = int(time.time() * 1000), int(result.get("epoch", 0))
        metrics = [Metric(k, float(result[k]), ts, step) for k in EPOCH_METRICS if k in result]
        if result.get("final"):  # every numeric value the trial returned is a final metric
            self.trial_seconds += float(result.get("trial_seconds", 0.0))
            extra = dict(result, dense_forward_images=self.dense_images.get(trial.config["model"], 0))
            skip = set(EPOCH_METRICS) | TUNE_KEYS
            metrics += [Metric(k, float(v), ts, step) for k, v in extra.items()
                        if k not in skip and isinstance(v, (int, float)) and not isinstance(v, bool)]
            # data and weights identity (calib_digest, eval_digest, ...): string params of the trial
            params = [Param(k, str(v)) for k, v in result.items() if k.endswith("_digest") and isinstance(v, str)]
            if params:
                self.writer.submit(lambda get=self._run_id(key), ps=params: self.client.log_batch(get(), params=ps))
        self.writer.log_metrics(self._run_id(key), metrics)
        if result.get("final") and "node_id" in result:  # where it ran: node, and the process (Ray's worker
            # logs on that node are worker-*-<pid>.out/.err)
            tags = [RunTag("node_id", str(result["node_id"]))] + ([RunTag("pid", str(result["pid"]))]
                                                                  if "pid" in result else [])
            self.writer.submit(lambda: self.client.log_batch(self.runs[key], tags=tags))

    @_timed
    def on_trial_recover(self, iteration, trials, trial, **info):
        """Tags ``retries`` (attempts after the first) and ``node_faults`` (retries because the trial's node died or
        could not run it: not counted against max_failures, orchestrator/raytune/trial_faults.py)."""
        from mlflow.entities import RunTag

        from orchestrator.raytune.trial_faults import node_faults

        key = self.keys.get(trial.trial_id)
        if key is None:  # its actor failed before the trial ever started: nothing ran, no child run yet
            return
        self.retries[key] = n = self.retries.get(key, 0) + 1
        faults = node_faults(trial)
        if faults <= self.node_faults.get(key, 0):  # its own failure; a node fault has had trial_faults' line
            _say(f"trial {key} failed ({_error_line(trial)[:200]}); retrying it (attempt {n + 1})")
        self.node_faults[key] = faults
        tags = [RunTag("retries", str(n))] + ([RunTag("node_faults", str(faults))] if faults else [])
        self.writer.submit(lambda: self.client.log_batch(self.runs[key], tags=tags))

    @_timed
    def on_trial_complete(self, iteration, trials, trial, **info):
        key = self.keys.get(trial.trial_id)
        if key is None:
            return
        last = trial.last_result or {}
        if last.get("diverged") or last.get("disk_full"):
            self.failed += 1
            status = "FAILED"
        elif last.get("final"):
            self.finished += 1
            status = "FINISHED"
        else:  # stopped early by the scheduler (ASHA)
            self.finished += 1
            status = "KILLED"
            self.writer.submit(lambda: self.client.set_tag(self.runs[key], "early_stopped", "true"))
        self.writer.submit(lambda: self.client.set_terminated(self.runs[key], status))

    @_timed
    def on_trial_error(self, iteration, trials, trial, **info):
        from mlflow.entities import RunTag

        self.failed += 1
        key = self.keys.get(trial.trial_id)
        if key is None:
            return
        reason = _error_line(trial)
        _say(f"trial {key} failed: {reason[:200]}")
        self.writer.submit(lambda: self.client.log_batch(self.runs[key], tags=[RunTag("failure_reason", reason)]))
        self.writer.submit(lambda: self.client.set_terminated(self.runs[key], "FAILED"))


def _say(line: str) -> None:
    """One line per trial failure on stderr: Tune's own traceback per failure is off unless --verbose
    (orchestrator/sweep/console.py, TUNE_PRINT_ALL_TRIAL_ERRORS). Written above the trials' progress bar."""
    from tqdm.auto import tqdm

    tqdm.write(f"healsweep: {line}", file=sys.stderr)


def _error_line(trial) -> str:
    """The last line of the trial's latest error (e.g. ``tasks.errors.DatasetError: ...``): from Tune's error file in
    the experiment's storage, else from the driver's staging copy, which Tune writes just before it calls
    ``on_trial_recover`` (the storage copy of a first failure appears only later: it said 'unknown error')."""
    for read in (trial.get_error, lambda: Path(trial.error_file).read_text() if trial.error_file else None):
        try:
            err = read()
            if err and str(err).strip():
                return str(err).strip().splitlines()[-1][:5000]
        except Exception:  # noqa: BLE001 - best effort: the reason must not break logging
            pass
    return "unknown error"
