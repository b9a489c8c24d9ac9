"""How the sweep drives Ray Tune: each trial's config, the Tuner (searcher, scheduler, names, storage) and the
clean-up of Tune's per-epoch checkpoints after a fit."""
from __future__ import annotations

import shutil
from dataclasses import asdict
from pathlib import Path

from orchestrator.raytune.trial_entry import tune_trainable
from orchestrator.spec import SweepSpec
from orchestrator.spec.plan import Cell


def trial_name(trial) -> str:
    """Tune's trial (and directory) name: the healsweep trial id, then Tune's own id."""
    return f"{trial.config.get('trial_id', 'trial')}-{trial.trial_id}"


def trial_config(c: Cell, spec: SweepSpec, paths: dict, store_key: str, mask_key: str, default_gran: str,
                  threads: int, device: str, target_mode: str = "store") -> dict:
    """Everything a trial process needs (orchestrator/raytune/trainable.py): the cell, where its targets, mask and model
    live, and the heal settings."""
    return {**asdict(c), "plugins": list(spec.plugins), "store_key": store_key, "mask_key": mask_key,
            "default_granularity": default_gran, "target_mode": target_mode, "target_dtype": spec.store.dtype,
            "store_uri": paths["targets"], "mask_root": paths["masks"], "cache_dir": paths["cache"],
            "data_seed": spec.data_seed, "batch_size": spec.heal.batch_size, "weight_decay": spec.heal.weight_decay,
            "lr_min": spec.heal.lr_min, "threads": threads, "device": device,
            "precision": spec.heal.precision, "channels_last": spec.heal.channels_last,
            "compile": spec.heal.compile, "graph": spec.heal.graph, "latency_rounds": spec.heal.latency_rounds,
            "load_kw": spec.load_kwargs(c.model), "out_dir": paths.get("out", ""),
            # per-epoch selection accuracy only where a scheduler stops trials on it (ASHA); the final one always
            "epoch_selection": spec.search.scheduler == "asha"}


def drop_epoch_checkpoints(experiment_dir: Path) -> int:
    """Delete Tune's per-epoch checkpoints of a finished ``fit`` (they only serve retries inside that fit; a
    resumed sweep reruns unfinished trials from scratch, and healed weights live in ``trials/``). -> bytes freed."""

    freed = 0
    for ckpt in Path(experiment_dir).glob("*/checkpoint_*"):
        if ckpt.is_dir() and not ckpt.is_symlink():
            freed += sum(f.stat().st_size for f in ckpt.rglob("*") if f.is_file())
            shutil.rmtree(ckpt, ignore_errors=True)
    return freed


# ------------------------------------------------------------------------------------------------ stages


def scheduler(spec: SweepSpec):
    """ASHA on the per-epoch objective when the spec asks for it (only selection_acc is measured per epoch);
    None: Tune's FIFO."""
    if spec.search.scheduler != "asha":
        return None
    from ray.tune.schedulers import ASHAScheduler

    from orchestrator.spec.checks import OBJECTIVES

    return ASHAScheduler(time_attr="epoch", metric=spec.search.objective, mode=OBJECTIVES[spec.search.objective],
                         max_t=spec.search.epochs[1],
                         grace_period=spec.search.asha_grace_period,
                         reduction_factor=spec.search.asha_reduction_factor)


def make_tuner(spec: SweepSpec, out_dir: Path, name: str, searcher, max_concurrent: int | None, callbacks: list,
               stop=None, trainable=None):
    """The sweep's one ``tune.Tuner``: the per-cell searcher, ASHA when asked, trials named by their trial id,
    results and checkpoints under ``out_dir/tune/name`` (one checkpoint kept per trial, for retries); ``stop``:
    a ``tune.Stopper`` (the interrupted sweep's, orchestrator/raytune/tune_stop.py). ``trainable``: None for the
    sweep's own (``tune_trainable``); a benchmark passes its own (benchmarks/bench_slots_ray.py), run with the
    same resources and Tuner settings."""
    from ray import tune

    from orchestrator.raytune import trial_faults
    from orchestrator.raytune.actor_reuse import spare_starting_actors

    if trainable is None:
        trainable = tune_trainable  # torch-free: the trial's actor imports torch (orchestrator/raytune/trial_entry.py)
    spare_starting_actors()  # a freed actor never takes a trial whose own actor is starting (a node that just joined)
    trial_faults.install()  # a trial whose node dies is retried elsewhere (orchestrator/raytune/trial_faults.py)

    return tune.Tuner(
        tune.with_resources(trainable, {"cpu": spec.resources.cpus_per_trial,
                                        "gpu": spec.resources.gpus_per_trial}),
        tune_config=tune.TuneConfig(search_alg=searcher, scheduler=scheduler(spec), num_samples=searcher.total,
                                    max_concurrent_trials=max_concurrent,
                                    reuse_actors=spec.resources.reuse_actors,
                                    trial_name_creator=trial_name, trial_dirname_creator=trial_name),
        run_config=tune.RunConfig(name=name, storage_path=str(out_dir / "tune"),
                                  callbacks=callbacks, verbose=0, stop=stop,
                                  failure_config=tune.FailureConfig(max_failures=spec.resources.max_failures),
                                  checkpoint_config=tune.CheckpointConfig(num_to_keep=1)),
    )
