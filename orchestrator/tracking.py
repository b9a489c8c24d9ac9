"""MLflow logging from the driver (single writer): one parent run per sweep, one child run per trial."""
from __future__ import annotations

import time
from typing import Any, Mapping

from mlflow import MlflowClient
from mlflow.entities import Metric, Param, RunTag
from ray.tune import Callback

TRIAL_PARAMS = ("model", "pruner", "scope", "sparsity", "calib_size", "healer", "granularity", "seed", "lr",
                "epochs", "batch_size")
EPOCH_METRICS = ("align_loss", "selection_acc")
FINAL_METRICS = ("dense_acc", "pruned_acc", "healed_acc", "retention", "heal_seconds", "dense_forward_images",
                 "mask_violations", "achieved_sparsity")
# Bookkeeping keys Ray Tune adds to every result; not metrics of the trial.
TUNE_KEYS = {"epoch", "final", "training_iteration", "timestamp", "time_this_iter_s", "time_total_s", "pid",
             "time_since_restore", "iterations_since_restore", "done", "date", "hostname", "node_ip",
             "trial_id", "experiment_id", "config", "should_checkpoint", "checkpoint_dir_name"}


def experiment_id(client: MlflowClient, name: str) -> str:
    exp = client.get_experiment_by_name(name)
    return exp.experiment_id if exp else client.create_experiment(name)


def start_parent(client: MlflowClient, experiment: str, sweep_id: str, name: str, params: Mapping[str, Any]) -> str:
    run = client.create_run(experiment_id(client, experiment), run_name=name,
                            tags={"sweep_id": sweep_id, "healsweep.role": "sweep"})
    client.log_batch(run.info.run_id, params=[Param(k, str(v)[:6000]) for k, v in params.items()])
    return run.info.run_id


class MlflowTrialLogger(Callback):
    """Tune callback in the driver: maps Tune trials to MLflow child runs."""

    def __init__(self, tracking_uri: str, experiment: str, sweep_id: str, parent_run_id: str,
                 dense_images: Mapping[str, int]) -> None:
        self.client = MlflowClient(tracking_uri)
        self.exp_id = experiment_id(self.client, experiment)
        self.sweep_id, self.parent = sweep_id, parent_run_id
        self.dense_images = dict(dense_images)  # model -> dense forward images computed by this sweep
        self.runs: dict[str, str] = {}  # tune trial id -> mlflow run id
        self.finished = self.failed = 0

    def on_trial_start(self, iteration, trials, trial, **info):
        c = trial.config
        tags = {"mlflow.parentRunId": self.parent, "sweep_id": self.sweep_id, "cell_id": c["cell_id"],
                "trial_id": c["trial_key"], "store_key": c["targets_key"], "mask_key": c["mask_key"],
                "pattern": c["pattern"], "healsweep.role": "trial", "tune_trial_id": trial.trial_id}
        run = self.client.create_run(self.exp_id, run_name=c["trial_key"], tags=tags)
        self.runs[trial.trial_id] = run.info.run_id
        granularity = c["healer_settings"].get("granularity", "auto")
        if granularity == "auto":
            granularity = c["default_granularity"]
        values = {**c, "granularity": granularity}
        params = [Param(k, str(values[k])) for k in TRIAL_PARAMS]
        params += [Param("pruner_settings", str(dict(c["pruner_settings"]))), Param("optuna_trial", str(c["optuna_trial"]))]
        self.client.log_batch(run.info.run_id, params=params)

    def on_trial_result(self, iteration, trials, trial, result, **info):
        run_id = self.runs.get(trial.trial_id)
        if run_id is None:
            return
        ts, step = int(time.time() * 1000), int(result.get("epoch", 0))
        metrics = [Metric(k, float(result[k]), ts, step) for k in EPOCH_METRICS if k in result]
        if result.get("final"):  # every numeric value the trial returned is a final metric
            extra = dict(result, dense_forward_images=self.dense_images.get(trial.config["model"], 0))
            skip = set(EPOCH_METRICS) | TUNE_KEYS
            metrics += [Metric(k, float(v), ts, step) for k, v in extra.items()
                        if k not in skip and isinstance(v, (int, float)) and not isinstance(v, bool)]
            # data and weights identity (calib_digest, eval_digest, ...): string params of the trial
            params = [Param(k, str(v)) for k, v in result.items() if k.endswith("_digest") and isinstance(v, str)]
            self.client.log_batch(run_id, params=params)
        self.client.log_batch(run_id, metrics=metrics)

    def on_trial_complete(self, iteration, trials, trial, **info):
        if trial.trial_id in self.runs:
            self.client.set_terminated(self.runs[trial.trial_id], "FINISHED")
            self.finished += 1

    def on_trial_error(self, iteration, trials, trial, **info):
        run_id = self.runs.get(trial.trial_id)
        self.failed += 1
        if run_id is None:
            return
        reason = "unknown error"
        try:
            err = trial.get_error()
            if err is not None:
                reason = str(err).strip().splitlines()[-1][:5000]
        except Exception:  # noqa: BLE001 - best effort: the reason must not break logging
            pass
        self.client.log_batch(run_id, tags=[RunTag("failure_reason", reason)])
        self.client.set_terminated(run_id, "FAILED")
