"""How the sweep drives Ray Tune: each trial's config, the Tuner (searcher, scheduler, names, storage) and the
clean-up of Tune's per-epoch checkpoints after a fit."""
from __future__ import annotations

import logging
import shutil
from dataclasses import asdict
from pathlib import Path

from orchestrator.raytune.cluster import is_remote, store_subdir
from orchestrator.raytune.trial_entry import tune_trainable
from orchestrator.spec import SweepSpec
from orchestrator.spec.plan import Cell
from tasks.errors import first_line

log = logging.getLogger(__name__)


def trial_name(trial) -> str:
    """Tune's trial (and directory) name: the healsweep trial id, then Tune's own id."""
    return f"{trial.config.get('trial_id', 'trial')}-{trial.trial_id}"


def trial_config(c: Cell, spec: SweepSpec, paths: dict, store_key: str, mask_key: str, default_gran: str,
                  threads: int, device: str, target_mode: str = "store", sweep_id: str = "") -> dict:
    """Everything a trial process needs (orchestrator/raytune/trainable.py): the cell, where its targets, mask and model
    live, where its healed weights go (the run directory; a remote store's ``healed/`` from a node without it),
    and the heal settings."""
    return {**asdict(c), "plugins": list(spec.plugins), "store_key": store_key, "mask_key": mask_key,
            "default_granularity": default_gran, "target_mode": target_mode, "target_dtype": spec.store.dtype,
            "store_uri": paths["targets"], "mask_root": paths["masks"], "cache_dir": paths["cache"],
            "data_seed": spec.data_seed, "batch_size": spec.heal.batch_size, "weight_decay": spec.heal.weight_decay,
            "lr_min": spec.heal.lr_min, "threads": threads, "device": device,
            "precision": spec.heal.precision, "channels_last": spec.heal.channels_last,
            "compile": spec.heal.compile, "graph": spec.heal.graph, "latency_rounds": spec.heal.latency_rounds,
            "load_kw": spec.load_kwargs(c.model), "out_dir": paths.get("out", ""), "sweep_id": sweep_id,
            "healed_root": paths.get("healed", ""),
            # per-epoch selection accuracy only where a scheduler stops trials on it (ASHA); the final one always
            "epoch_selection": spec.search.scheduler == "asha"}


def tune_experiment(storage: str, name: str) -> str:
    """The experiment directory of ``make_tuner(..., storage=storage)``'s run ``name`` (a path or a URI)."""
    return store_subdir(storage, name) if is_remote(storage) else str(Path(storage) / name)


def tune_storage(storage: str) -> tuple[str, object | None]:
    """``RunConfig``'s (storage_path, storage_filesystem): a local path as it is; a URI's pyarrow filesystem
    (its query, e.g. ``endpoint_override``, kept) and path in it."""
    if not is_remote(storage):
        return storage, None
    import pyarrow.fs as pafs

    fs, path = pafs.FileSystem.from_uri(storage)
    return path, fs


def drop_epoch_checkpoints(experiment_dir: str | Path) -> int:
    """Delete Tune's per-epoch checkpoints of a finished ``fit`` (they only serve retries inside that fit; a
    resumed sweep reruns unfinished trials from scratch, and healed weights live in ``trials/``). -> bytes freed.
    ``experiment_dir``: a path, or a URI (a remote store's ``tune/``)."""
    if is_remote(str(experiment_dir)):
        return _drop_remote_checkpoints(str(experiment_dir))
    freed = 0
    for ckpt in Path(experiment_dir).glob("*/checkpoint_*"):
        if ckpt.is_dir() and not ckpt.is_symlink():
            freed += sum(f.stat().st_size for f in ckpt.rglob("*") if f.is_file())
            shutil.rmtree(ckpt, ignore_errors=True)
    return freed


def _drop_remote_checkpoints(uri: str) -> int:
    """The remote branch of ``drop_epoch_checkpoints``: an endpoint failing midway leaves the rest (a warning),
    never the sweep's end (its summary and record)."""
    import pyarrow.fs as pafs

    freed = 0
    try:
        fs, root = pafs.FileSystem.from_uri(uri)
        for trial in fs.get_file_info(pafs.FileSelector(root, allow_not_found=True)):
            if trial.type != pafs.FileType.Directory:
                continue
            for ckpt in fs.get_file_info(pafs.FileSelector(trial.path, allow_not_found=True)):
                if ckpt.type == pafs.FileType.Directory and ckpt.base_name.startswith("checkpoint_"):
                    files = fs.get_file_info(pafs.FileSelector(ckpt.path, recursive=True, allow_not_found=True))
                    fs.delete_dir(ckpt.path)
                    freed += sum(f.size or 0 for f in files if f.type == pafs.FileType.File)
    except OSError as e:
        why = first_line(e)
        log.warning("Tune's epoch checkpoints under %s not all removed (%s)", uri, why)
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
               stop=None, trainable=None, storage: str | None = None):
    """The sweep's one ``tune.Tuner``: the per-cell searcher, ASHA when asked, trials named by their trial id,
    results and checkpoints under ``storage/name`` (default ``out_dir/tune``; a remote store's ``tune/`` URI when
    the nodes share only the store: orchestrator/sweep/stages.py store_paths), one checkpoint kept per trial,
    for retries; ``stop``:
    a ``tune.Stopper`` (the interrupted sweep's, orchestrator/raytune/tune_stop.py). ``trainable``: None for the
    sweep's own (``tune_trainable``); a benchmark passes its own (benchmarks/bench_slots_ray.py), run with the
    same resources and Tuner settings."""
    from ray import tune

    from orchestrator.raytune import trial_faults
    from orchestrator.raytune.actor_reuse import spare_starting_actors

    if trainable is None:
        trainable = tune_trainable  # torch-free: the trial's actor imports torch (orchestrator/raytune/trial_entry.py)
    path, fs = tune_storage(storage or str(Path(out_dir) / "tune"))
    spare_starting_actors()  # a freed actor never takes a trial whose own actor is starting (a node that just joined)
    trial_faults.install()  # a trial whose node dies is retried elsewhere (orchestrator/raytune/trial_faults.py)

    return tune.Tuner(
        tune.with_resources(trainable, {"cpu": spec.resources.cpus_per_trial,
                                        "gpu": spec.resources.gpus_per_trial}),
        tune_config=tune.TuneConfig(search_alg=searcher, scheduler=scheduler(spec), num_samples=searcher.total,
                                    max_concurrent_trials=max_concurrent,
                                    reuse_actors=spec.resources.reuse_actors,
                                    trial_name_creator=trial_name, trial_dirname_creator=trial_name),
        run_config=tune.RunConfig(name=name, storage_path=path, storage_filesystem=fs,
                                  callbacks=callbacks, verbose=0, stop=stop,
                                  failure_config=tune.FailureConfig(max_failures=spec.resources.max_failures),
                                  checkpoint_config=tune.CheckpointConfig(num_to_keep=1)),
    )
