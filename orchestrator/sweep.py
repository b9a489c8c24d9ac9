"""Run a sweep: models -> dense targets (Ray tasks) -> masks -> trials (Ray Tune + per-cell Optuna) -> MLflow -> report."""
from __future__ import annotations

import json
import logging
import os
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path

from tqdm.auto import tqdm

from orchestrator.plan import Cell, expand_cells
from orchestrator.spec import SweepSpec
from tasks.trial import TrialParams, run_trial


@dataclass
class SweepResult:
    sweep_id: str
    out_dir: Path
    tracking_uri: str
    parent_run_id: str
    trials_finished: int
    trials_failed: int
    dense_forward_images: int
    seconds: float
    report: dict | None


def tune_trainable(config: dict) -> None:
    """Ray Tune function trainable: one trial, reporting each epoch to Tune."""
    from ray import tune

    fields = TrialParams.__dataclass_fields__
    run_trial(TrialParams(**{k: v for k, v in config.items() if k in fields}), report=tune.report)


def _trial_name(trial) -> str:
    return f"{trial.config.get('trial_key', 'trial')}-{trial.trial_id}"


class _Progress:
    def __init__(self, total: int, enabled: bool) -> None:
        from ray.tune import Callback

        bar = tqdm(total=total, desc="trials", unit="trial", disable=not enabled)
        best = {"n": 0, "sel": float("-inf")}

        class Cb(Callback):
            def on_trial_complete(self, iteration, trials, trial, **info):
                bar.update(1)
                best["sel"] = max(best["sel"], trial.last_result.get("selection_acc", float("-inf")))
                bar.set_postfix(best_selection_acc=f"{best['sel']:.3f}")

            def on_trial_error(self, iteration, trials, trial, **info):
                bar.update(1)

        self.callback, self.bar = Cb(), bar


def _trial_config(c: Cell, spec: SweepSpec, paths: dict, targets_key: str, mask_key: str, default_gran: str,
                  threads: int, device: str) -> dict:
    return {**asdict(c), "targets_key": targets_key, "mask_key": mask_key, "default_granularity": default_gran,
            "store_root": paths["targets"], "mask_root": paths["masks"], "cache_dir": paths["cache"],
            "data_seed": spec.data_seed, "batch_size": spec.heal.batch_size, "weight_decay": spec.heal.weight_decay,
            "lr_min": spec.heal.lr_min, "threads": threads, "device": device,
            "load_kw": spec.load_kwargs(c.model), "out_dir": paths.get("out", "")}


def run_sweep(spec: SweepSpec, out_dir: Path, store_root: Path, cache_dir: Path, *, address: str | None = None,
              progress: bool = True, report: bool = True, num_cpus: int | None = None,
              resume: dict | None = None) -> SweepResult:
    """Run ``spec``; ``resume`` = {"sweep_id", "parent_run_id", "round"} continues an existing sweep (refinement):
    same sweep id and parent run, sweep.json left alone, the parent's metrics logged at step ``round``."""
    import ray
    from mlflow import MlflowClient
    from ray import tune

    from orchestrator.search import PerCellOptunaSearch
    from orchestrator.stages import dense_stage, mask_stage, prepare_models
    from orchestrator.tracking import MlflowTrialLogger, start_parent
    from tasks.adapters import get_adapter
    from orchestrator.spec_sources import untrained

    t0 = time.time()
    out_dir, store_root, cache_dir = (Path(p).resolve() for p in (out_dir, store_root, cache_dir))
    out_dir.mkdir(parents=True, exist_ok=True)
    tracking_uri = spec.mlflow.tracking_uri or f"sqlite:///{out_dir / 'mlflow.db'}"
    sweep_id = resume["sweep_id"] if resume else uuid.uuid4().hex[:12]
    paths = {"targets": str(store_root / "targets"), "masks": str(store_root / "masks"), "cache": str(cache_dir),
             "out": str(out_dir)}
    if not resume:
        (out_dir / "sweep.json").write_text(json.dumps(
            {"sweep_id": sweep_id, "name": spec.name, "tracking_uri": tracking_uri,
             "experiment": spec.mlflow.experiment, "store": str(store_root), "cache": str(cache_dir),
             "spec": spec.to_dict()}, indent=1, default=list))

    models = prepare_models(spec, cache_dir, progress=progress)
    cells = expand_cells(spec, {m: i.scope for m, i in models.items()})
    rows = {m: max(c.calib_size for c in cells if c.model == m) for m in models}

    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    started_ray = not ray.is_initialized()
    if started_ray:
        # No address: always a fresh local instance ("local"), never whatever Ray happens to run on the machine.
        ray.init(address=address or "local", include_dashboard=False, num_cpus=None if address else num_cpus,
                 logging_level=logging.WARNING, log_to_driver=False, configure_logging=True)
    try:
        dense = dense_stage(spec, models, rows, Path(paths["targets"]), cache_dir, progress=progress)
        mask_keys = mask_stage(cells, models, Path(paths["masks"]), cache_dir, spec.data_seed,
                               {m: spec.load_kwargs(m) for m in models})

        client = MlflowClient(tracking_uri)
        step = int(resume["round"]) if resume else 0
        if resume:
            parent = resume["parent_run_id"]
            client.log_text(parent, json.dumps(spec.to_dict(), indent=1, default=list), f"refine_{step}/spec.json")
        else:
            parent = start_parent(client, spec.mlflow.experiment, sweep_id, spec.name, {
                "spec_name": spec.name, "cells": len(cells), "trials_per_cell": spec.search.trials_per_cell,
                "models": ",".join(spec.models), "objective": spec.search.objective, "store": str(store_root)})
            client.log_text(parent, json.dumps(spec.to_dict(), indent=1, default=list), "spec.json")
        gran = {}
        for m in models:
            gran[m] = get_adapter(untrained(spec, m)).default_granularity
        total_cpus = int(ray.cluster_resources().get("CPU", 1))
        threads = max(1, int(spec.resources.cpus_per_trial))
        device = "cuda" if spec.resources.gpus_per_trial > 0 else "cpu"
        configs = [_trial_config(c, spec, paths, models[c.model].targets_key, mask_keys[c.cell_id], gran[c.model],
                                 threads, device) for c in cells]
        total = len(cells) * spec.search.trials_per_cell
        concurrency = spec.resources.max_concurrent or max(1, int(total_cpus // spec.resources.cpus_per_trial))
        searcher = PerCellOptunaSearch(configs, spec.search.trials_per_cell, spec.search.lr, spec.search.epochs,
                                       spec.search.sampler_seed, out_dir / "optuna.journal")
        logger_cb = MlflowTrialLogger(tracking_uri, spec.mlflow.experiment, sweep_id, parent, dense)
        prog = _Progress(total, progress)
        resources = {"cpu": spec.resources.cpus_per_trial, "gpu": spec.resources.gpus_per_trial}
        tuner = tune.Tuner(
            tune.with_resources(tune_trainable, resources),
            tune_config=tune.TuneConfig(search_alg=searcher, num_samples=total, max_concurrent_trials=concurrency,
                                        reuse_actors=True, trial_name_creator=_trial_name,
                                        trial_dirname_creator=_trial_name),
            run_config=tune.RunConfig(name=f"{spec.name}-{sweep_id}" + (f"-refine{step}" if step else ""),
                                      storage_path=str(out_dir / "tune"),
                                      callbacks=[logger_cb, prog.callback], verbose=0),
        )
        t_tune = time.time()
        tuner.fit()
        tune_seconds = time.time() - t_tune
        prog.bar.close()
        dense_total = sum(dense.values())
        seconds = time.time() - t0
        from mlflow.entities import Metric

        ts = int(time.time() * 1000)
        client.log_batch(parent, metrics=[Metric("dense_forward_images", dense_total, ts, step),
                                          Metric("trials_finished", logger_cb.finished, ts, step),
                                          Metric("trials_failed", logger_cb.failed, ts, step),
                                          Metric("sweep_seconds", seconds, ts, step),
                                          Metric("tune_seconds", tune_seconds, ts, step),
                                          Metric("concurrency", concurrency, ts, step)])
        client.set_terminated(parent, "FINISHED")
    finally:
        if started_ray:
            ray.shutdown()
    paths_out = None
    if report:
        from analysis.report import write_report

        paths_out = write_report(out_dir)
    return SweepResult(sweep_id, out_dir, tracking_uri, parent, logger_cb.finished, logger_cb.failed, dense_total,
                       seconds, paths_out)
