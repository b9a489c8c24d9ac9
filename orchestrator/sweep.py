"""Run a sweep: models -> dense targets (Ray tasks) -> masks -> trials (Ray Tune + per-cell Optuna) -> MLflow -> report."""
from __future__ import annotations

import json
import os
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path

from tqdm.auto import tqdm

from orchestrator.plan import Cell, expand_cells, grid_searches
from orchestrator.spec import SweepSpec
from orchestrator.trainable import tune_trainable  # noqa: F401 - re-exported


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
                  threads: int, device: str, target_mode: str = "store") -> dict:
    return {**asdict(c), "plugins": list(spec.plugins), "targets_key": targets_key, "mask_key": mask_key,
            "default_granularity": default_gran, "target_mode": target_mode, "target_dtype": spec.store.dtype,
            "store_root": paths["targets"], "mask_root": paths["masks"], "cache_dir": paths["cache"],
            "data_seed": spec.data_seed, "batch_size": spec.heal.batch_size, "weight_decay": spec.heal.weight_decay,
            "lr_min": spec.heal.lr_min, "threads": threads, "device": device,
            "load_kw": spec.load_kwargs(c.model), "out_dir": paths.get("out", "")}


def _concurrency(spec: SweepSpec, cluster: dict) -> int:
    if spec.resources.max_concurrent:
        return spec.resources.max_concurrent
    n = int(cluster.get("CPU", 1) // spec.resources.cpus_per_trial)
    if spec.resources.gpus_per_trial > 0:
        n = min(n, int(cluster.get("GPU", 0) // spec.resources.gpus_per_trial))
    return max(1, n)


def _scheduler(spec: SweepSpec):
    if spec.search.scheduler != "asha":
        return None
    from ray.tune.schedulers import ASHAScheduler

    return ASHAScheduler(time_attr="epoch", metric=spec.search.objective, mode="max", max_t=spec.search.epochs[1],
                         grace_period=spec.search.asha_grace_period,
                         reduction_factor=spec.search.asha_reduction_factor)


def drop_epoch_checkpoints(experiment_dir: Path) -> int:
    """Delete Tune's per-epoch checkpoints of a finished ``fit`` (they only serve retries inside that fit; a
    resumed sweep reruns unfinished trials from scratch, and healed weights live in ``trials/``). -> bytes freed."""
    import shutil

    freed = 0
    for ckpt in Path(experiment_dir).glob("*/checkpoint_*"):
        if ckpt.is_dir() and not ckpt.is_symlink():
            freed += sum(f.stat().st_size for f in ckpt.rglob("*") if f.is_file())
            shutil.rmtree(ckpt, ignore_errors=True)
    return freed


def run_sweep(spec: SweepSpec, out_dir: Path, store_root: Path, cache_dir: Path, *, address: str | None = None,
              progress: bool = True, report: bool = True, num_cpus: int | None = None,
              resume: bool = False, refine_round: int | None = None) -> SweepResult:
    """Run a sweep into ``out_dir``; with ``resume``, continue the sweep recorded there (see orchestrator/resume.py):
    its sweep id, MLflow parent run and Optuna journal are reused, told trials are not run again. With
    ``refine_round`` (healsweep refine), ``spec`` is a refinement grid run as a continuation of that sweep: same
    sweep id, parent run, journal and stores; the refined spec is logged as ``refine_<round>/spec.json``."""
    import ray
    from mlflow import MlflowClient
    from ray import tune

    from orchestrator import cluster as _cluster  # [cluster] address checks, workers' env, scale-out policy
    from orchestrator.dense import DenseReport, budget_modes
    from orchestrator.diagnostics import diagnostics_stage, log_diagnostics, log_lamp_allocations
    from orchestrator.mlflow_async import AsyncMlflowWriter
    from orchestrator.resume import (JOURNAL_FILE, ResumeError, lock_run_dir, read_sweep, reconcile, record_dense,
                                     release_run_dir, told_states, write_sweep)
    from orchestrator.search import PerCellOptunaSearch
    from orchestrator.spec_sources import untrained
    from orchestrator.stages import dense_stage, mask_stage, prepare_models
    from orchestrator.tracking import MlflowTrialLogger, experiment_id, start_parent
    from tasks.models import get_adapter, load_model

    t0 = time.time()
    _cluster.check_address(address)  # [cluster] one line, before any work: ray://, unreachable address
    _cluster.check_store_uri(spec.store.uri)  # [cluster] one line for an unreachable endpoint / missing bucket
    out_dir, store_root, cache_dir = (Path(p).resolve() for p in (out_dir, store_root, cache_dir))
    lock_run_dir(out_dir)  # one driver per run directory (RunLockedError while another live driver holds it)
    journal = out_dir / JOURNAL_FILE
    resume = resume or refine_round is not None
    if resume:
        _cluster.relocate(out_dir)  # [cluster] a copied/moved run directory: its own SQLite store and artifacts
        info = read_sweep(out_dir)
        sweep_id, tracking_uri = info["sweep_id"], info["tracking_uri"]
        info["resumes"] = info.get("resumes", 0) + 1
    else:
        if journal.exists():
            raise ResumeError(f"{out_dir} already holds a sweep: continue it with --resume {out_dir} or choose "
                              "another --out")
        tracking_uri = (spec.mlflow.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI")
                        or f"sqlite:///{out_dir / 'mlflow.db'}")
        sweep_id = uuid.uuid4().hex[:12]
        info = {"sweep_id": sweep_id, "name": spec.name, "tracking_uri": tracking_uri,
                "experiment": spec.mlflow.experiment, "store": str(store_root), "cache": str(cache_dir),
                "spec": spec.to_dict()}
    write_sweep(out_dir, info)
    _cluster.keep_artifacts_inside(tracking_uri, out_dir, spec.mlflow.experiment)  # [cluster] not $PWD/mlruns
    paths = {"targets": spec.store.uri or str(store_root / "targets"),
             "masks": _cluster.mask_root(spec.store.uri, str(store_root / "masks")),  # [cluster] remote store
             "cache": str(cache_dir), "out": str(out_dir)}

    models = prepare_models(spec, cache_dir, progress=progress)
    cells = expand_cells(spec, {m: i.scope for m, i in models.items()})
    rows = {m: max(c.calib_size for c in cells if c.model == m) for m in models}
    modes = budget_modes(spec, models, rows, paths["targets"], cache_dir)  # refuses before any dense compute
    (out_dir / "targets.json").write_text(json.dumps(  # for `healsweep store gc --keep-referenced`
        {"store": paths["targets"], "keys": {m: i.targets_key for m, i in models.items()}, "modes": modes}, indent=1))

    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    # num_to_keep=1 forces an experiment-state snapshot after each trial checkpoint; Tune then warns on every
    # one (1649 three-line warnings in the default sweep). The snapshots are cheap here (overhead ratio 1.06).
    os.environ.setdefault("TUNE_WARN_EXCESSIVE_EXPERIMENT_CHECKPOINT_SYNC_THRESHOLD_S", "0")
    started_ray = _cluster.connect(address, None if address else num_cpus)
    writer = None
    try:
        dense_rep = DenseReport()
        dense = dense_stage(spec, models, rows, paths["targets"], cache_dir, progress=progress,
                            skip=tuple(m for m, v in modes.items() if v == "recompute"), report=dense_rep)
        dense_all = record_dense(out_dir, info, info.get("resumes", 0), sum(dense.values()))  # every session
        diag_root = store_root / "diagnostics"
        diag = diagnostics_stage(cells, models, diag_root, cache_dir, spec.data_seed,
                                 int(spec.resources.cpus_per_dense_task))
        mask_keys = mask_stage(cells, models, paths["masks"], cache_dir,  # [cluster] str: may be a URI
                               spec.data_seed,
                               diagnostics=diag.tables(diag_root),
                               load_kw={m: spec.load_kwargs(m) for m in models})

        client = MlflowClient(tracking_uri)
        parent = info.get("parent_run_id")
        if parent is None:
            parent = start_parent(client, spec.mlflow.experiment, sweep_id, spec.name, {
                "spec_name": spec.name, "cells": len(cells), "trials_per_cell": spec.search.trials_per_cell,
                "models": ",".join(spec.models), "objective": spec.search.objective, "store": str(store_root),
                "scheduler": spec.search.scheduler, "grids": ",".join(["main", *(g.name for g in spec.grids)])})
            client.log_text(parent, json.dumps(spec.to_dict(), indent=1, default=list), "spec.json")
            info["parent_run_id"] = parent
            write_sweep(out_dir, info)
        else:
            client.update_run(parent, status="RUNNING")
            client.set_tag(parent, "resumes", str(info["resumes"]))
            if refine_round is not None:
                client.log_text(parent, json.dumps(spec.to_dict(), indent=1, default=list),
                                f"refine_{refine_round}/spec.json")
            reconcile(client, experiment_id(client, spec.mlflow.experiment), sweep_id, journal)
        session = info.get("resumes", 0)
        log_diagnostics(client, parent, diag_root, diag)
        if diag.models:  # LAMP allocations need weights: computed here, read back by the report's CTS section
            from analysis.cts import CTSSettings

            def weights_of(m):
                lm = load_model(m, cache_dir, data_seed=spec.data_seed, progress=False, **spec.load_kwargs(m))
                return {k: v.detach() for k, v in lm.model.named_parameters()}

            log_lamp_allocations(client, parent, diag_root, diag, weights_of, CTSSettings().targets)
        if dense_rep.events:  # damaged shards found and recomputed
            client.log_text(parent, "\n".join(dense_rep.events) + "\n", f"store_events_{session}.txt")
        gran = {}
        for m in models:
            gran[m] = get_adapter(untrained(spec, m)).default_granularity
        threads = max(1, int(spec.resources.cpus_per_trial))
        device = "cuda" if spec.resources.gpus_per_trial > 0 else "cpu"
        configs = [_trial_config(c, spec, paths, models[c.model].targets_key, mask_keys[c.cell_id], gran[c.model],
                                 threads, device, modes[c.model]) for c in cells]
        concurrency = _concurrency(spec, ray.cluster_resources())  # at start; logged
        os.environ["TUNE_MAX_PENDING_TRIALS_PG"] = str(  # [cluster] queue trials for nodes that join later
            _cluster.pending_trials(spec.resources, ray.cluster_resources()))
        writer = AsyncMlflowWriter(client)
        searcher = PerCellOptunaSearch(configs, spec.search.trials_per_cell, spec.search.lr, spec.search.epochs,
                                       spec.search.sampler_seed, journal, asha=spec.search.scheduler == "asha",
                                       startup_trials=spec.search.startup_trials, defer=writer.submit,
                                       grids=grid_searches(spec))
        logger_cb = MlflowTrialLogger(writer, spec.mlflow.experiment, sweep_id, parent, dense, replace=resume)
        prog = _Progress(searcher.total, progress)
        resources = {"cpu": spec.resources.cpus_per_trial, "gpu": spec.resources.gpus_per_trial}
        session = info.get("resumes", 0)
        tuner = tune.Tuner(
            tune.with_resources(tune_trainable, resources),
            tune_config=tune.TuneConfig(search_alg=searcher, scheduler=_scheduler(spec), num_samples=searcher.total,
                                        max_concurrent_trials=_cluster.tune_concurrency(spec.resources, {}),  # [cluster]
                                        reuse_actors=spec.resources.reuse_actors,
                                        trial_name_creator=_trial_name, trial_dirname_creator=_trial_name),
            run_config=tune.RunConfig(name=f"{spec.name}-{sweep_id}-s{session}", storage_path=str(out_dir / "tune"),
                                      callbacks=[logger_cb, prog.callback], verbose=0,
                                      failure_config=tune.FailureConfig(max_failures=spec.resources.max_failures),
                                      checkpoint_config=tune.CheckpointConfig(num_to_keep=1)),
        )
        t_tune, freed = time.time(), 0
        if searcher.total:
            tuner.fit()
            freed = drop_epoch_checkpoints(out_dir / "tune" / f"{spec.name}-{sweep_id}-s{session}")
        tune_seconds = time.time() - t_tune
        prog.bar.close()
        t_flush = time.perf_counter()
        writer.close()  # every queued MLflow write and Optuna tell is done after this
        flush_seconds = time.perf_counter() - t_flush
        states = told_states(journal).values()
        finished = sum(s.name in ("COMPLETE", "PRUNED") for s in states)
        failed = sum(s.name == "FAIL" for s in states)
        dense_total = sum(dense.values())
        seconds = time.time() - t0
        from mlflow.entities import Metric

        ts = int(time.time() * 1000)
        client.log_batch(parent, metrics=[Metric(k, float(v), ts, session) for k, v in {
            "dense_forward_images": dense_all, "dense_forward_images_session": dense_total,
            "trials_finished": finished, "trials_failed": failed,
            "trials_run": logger_cb.finished + logger_cb.failed, "trials_rerun": len(searcher.rerun),
            "sweep_seconds": seconds, "tune_seconds": tune_seconds, "concurrency": concurrency,
            "diagnostics_layers_computed": diag.computed_layers, "diagnostics_seconds": diag.seconds,
            "dense_shards_computed": sum(dense_rep.shards.values()), "store_integrity_events": len(dense_rep.events),
            "mlflow_callback_seconds": logger_cb.callback_seconds, "mlflow_writer_seconds": writer.write_seconds,
            "mlflow_flush_seconds": flush_seconds, "mlflow_write_errors": writer.errors,
            "tune_checkpoint_bytes_freed": freed}.items()])
        client.set_terminated(parent, "FINISHED")
    finally:
        if writer is not None:
            writer.close()
        if started_ray:
            ray.shutdown()
    paths_out = None
    if report:
        from analysis.report import write_report

        paths_out = write_report(out_dir)
    release_run_dir(out_dir)
    return SweepResult(sweep_id, out_dir, tracking_uri, parent, finished, failed, dense_total, seconds, paths_out)
