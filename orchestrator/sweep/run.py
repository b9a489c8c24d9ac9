"""Run a sweep: models -> dense targets -> diagnostics -> masks -> [other calibration draws: the same three stages
per draw, search.calib_draws] -> trials (Ray Tune + per-cell Optuna; the MLflow
parent run is created beside their start: orchestrator/sweep/parent.py) -> MLflow -> report. ``run_sweep`` is the
sequence of named stages below, each timed (``StageClock``): the times go to the parent run as
``stage_<name>_seconds`` and are printed at the end. What the stages hand each other is a ``SweepState``
(orchestrator/sweep/state.py).

Lifecycle commands call ``run_sweep`` (orchestrator/lifecycle/: resume, refine, widen); a resumed sweep's run
directory is checked and prepared by its caller (``lifecycle.resume.prepare_resume``) before ``run_sweep`` opens it.
Modules imported inside functions here are the heavy ones (Ray, Tune, MLflow through the stages), imported where the
work starts so that they overlap Ray's start (tests/test_imports.py holds every other import at the top). Torch is
imported only by a stage with work to do (a model or mask to compute): a sweep over a warm store and model cache
never imports it in the driver (tests/orchestrator/test_warm_driver.py).
"""
from __future__ import annotations

import contextlib
import json
import signal
import sys
import time
import uuid
from functools import partial
from pathlib import Path

from orchestrator.raytune import cluster, gcs_watch, node_guard
from orchestrator.raytune.node_guard import NodeGuard, install_hint, missing_project
from orchestrator.raytune.resources import task_gpus, trial_device
from orchestrator.raytune.tune_setup import drop_epoch_checkpoints, make_tuner, trial_config, tune_experiment
from orchestrator.rundir import faults, interrupt, store_users
from orchestrator.rundir.files import JOURNAL_FILE, existing_sweep, lock_run_dir, read_sweep, record_dense, release_run_dir, write_sweep
from orchestrator.spec import SweepSpec, configured_tracking_uri
from orchestrator.spec.plan import expand_cells, grid_searches
from orchestrator.sweep import end as sweep_end
from orchestrator.sweep import parent as parent_stage
from orchestrator.sweep.background import background
from orchestrator.sweep.console import StageClock, TrialProgress, quiet_libraries
from orchestrator.sweep.draws import (cells_of_draw, draw_specs, draw_store_keys, prepare_draw, store_keys, totals,
                                      trial_overrides)
from orchestrator.sweep.planner import decision_line, plan_target_modes
from orchestrator.sweep.state import Handoff, ModelsPart, SweepResult, SweepState
from orchestrator.tracking import store as tracking_store
from orchestrator.tracking.recorder import TrialRecorder, stored_weights
from orchestrator.tracking.retry import drop_failed, retry_lines
from orchestrator.tracking.writer import AsyncMlflowWriter


def open_sweep(spec: SweepSpec, out_dir: Path, store_dir: Path, cache_dir: Path, resume: bool,
               refine_round: int | None, clock: StageClock) -> SweepState:
    """A new sweep (fresh sweep id, tracking URI) or the one recorded in ``out_dir`` (resume / refine: the caller
    prepared the directory, ``lifecycle.resume.prepare_resume``)."""
    from orchestrator.sweep.stages import store_paths  # Ray (the stages' tasks)

    out_dir, store_dir, cache_dir = (Path(p).resolve() for p in (out_dir, store_dir, cache_dir))
    lock_run_dir(out_dir)  # one driver per run directory (RunLockedError while another live driver holds it)
    resume = resume or refine_round is not None
    if resume:
        tracking_store.relocate(out_dir)  # a copied/moved run directory: its own SQLite store and artifacts
        info = read_sweep(out_dir)
        info["resumes"] = info.get("resumes", 0) + 1
    else:
        if (out_dir / JOURNAL_FILE).exists():
            raise existing_sweep(out_dir)
        tracking_uri = configured_tracking_uri(spec)[0] or tracking_store.local_tracking_uri(out_dir)
        info = {"sweep_id": uuid.uuid4().hex[:12], "name": spec.name, "tracking_uri": tracking_uri,
                "experiment": spec.mlflow.experiment, "store": str(store_dir), "cache": str(cache_dir),
                "spec": spec.to_dict()}
    write_sweep(out_dir, info)
    interrupt.opened(out_dir, f"healsweep refine {out_dir}" if refine_round is not None else None)
    paths = store_paths(spec.store.uri, store_dir, cache_dir)
    paths["out"] = str(out_dir)
    return SweepState(spec, out_dir, store_dir, cache_dir, info, paths, resume, refine_round, clock)


def models_stage(s: SweepState, progress: bool) -> ModelsPart:
    """The models (verified weights; on a cluster loaded by one Ray task each), the cells, rows per model and the
    store budget's modes. Reads the state, writes nothing into it (it may run in a thread: see state.py)."""
    from orchestrator.sweep.dense import budget_modes  # Ray: imported in the models thread while Ray starts
    from orchestrator.sweep.stages import prepare_models

    models = s.preloaded or prepare_models(s.spec, s.paths["cache"], progress=progress, on_workers=s.on_cluster)
    cells = expand_cells(s.spec, {m: i.scope for m, i in models.items()})
    rows = {m: max(c.calib_size for c in cells if c.model == m) for m in models}
    drawn = draw_store_keys(s.spec, s.paths["cache"], s.on_cluster) if s.spec.store.budget_gb is not None else {}
    modes = budget_modes(s.spec, models, rows, s.paths["targets"], s.paths["cache"], drawn)  # refuses before compute
    return ModelsPart(models, cells, rows, modes)


def take_models(s: SweepState, part: ModelsPart) -> None:
    """The models stage's result into the state (the main thread) and ``targets.json``."""
    s.models, s.cells, s.rows, s.modes = part.models, part.cells, part.rows, part.modes
    write_targets(s)


def write_targets(s: SweepState) -> None:
    """``targets.json`` (for `healsweep store gc --keep-referenced`): the store, its keys, each model's mode."""
    (s.out_dir / "targets.json").write_text(json.dumps(
        {"store": s.paths["targets"], "keys": {**{m: i.store_key for m, i in s.models.items()}, **store_keys(s.draws)},
         "modes": s.modes},
        indent=1))


def models_line(spec: SweepSpec, on_cluster: bool) -> str:
    """The models stage's status line."""
    return f"models: {', '.join(spec.models)}" + (" (one Ray task each)" if on_cluster else "")


def _timed_models(s: SweepState, progress: bool) -> ModelsPart:
    """The models stage, timed. On a local instance it runs in a thread while Ray starts (both mostly wait on
    other processes or on imports; measured -1.5 to -2.3 s of wall on 2 cores), on a cluster after it (a Ray task
    per model). Models the caller already prepared (``run_sweep(models=...)``) are not timed again."""
    if s.preloaded:
        return models_stage(s, progress)
    with s.clock.stage("models", models_line(s.spec, s.on_cluster)):
        return models_stage(s, progress)


def start_ray(address: str | None, num_cpus: int | None, verbose: bool) -> bool:
    """Attach to ``address`` (the driver's environment passed to workers; which cluster is printed) or start a
    fresh local Ray (never whatever happens to run on the machine). True when this call started Ray."""
    return cluster.connect(address, None if address else num_cpus, verbose=verbose)


def dense_and_masks(s: SweepState, progress: bool) -> None:
    """Dense targets (only what the store lacks), RR diagnostics (cached), masks (content-addressed)."""
    from orchestrator.sweep.dense import DenseReport
    from orchestrator.sweep.diagnostics import diagnostics_stage
    from orchestrator.sweep.stages import dense_stage, mask_stage, masks_in_driver

    spec, clock = s.spec, s.clock
    with clock.stage("planner"):  # store.targets: stream from the store or recompute (measured on a GPU)
        s.plan = plan_target_modes(spec, s.models, s.modes, s.paths["cache"], s.store_dir)
    for m, d in s.plan.items():
        if "seconds_per_step" in d or d["pick"] == "recompute":
            clock.say(f"[planner] {decision_line(m, d)}")
    write_targets(s)
    need = ", ".join(f"{m} {n} images" for m, n in s.rows.items() if s.modes[m] == "store")
    with clock.stage("dense", f"dense targets: {need} (computing only what the store lacks)"):
        s.dense_rep = DenseReport()
        s.dense = dense_stage(spec, s.models, s.rows, s.paths["targets"], s.paths["cache"], progress=progress,
                              skip=tuple(m for m, v in s.modes.items() if v == "recompute"), report=s.dense_rep,
                              in_driver=False if s.on_cluster else None)  # on a cluster: tasks on the workers
    computed = sum(s.dense.values())
    s.dense_total = record_dense(s.out_dir, s.info, s.session, computed)  # every session's images, kept in sweep.json
    clock.say((f"[dense] {computed} images computed, {sum(s.rows.values()) - computed} read from the store"
               if computed <= sum(s.rows.values()) else f"[dense] {computed} images computed")
              + "".join(f"; {m} loaded by {k} Ray task(s)" for m, k in sorted(s.dense_rep.loads.items())))
    diag_root, res = s.paths["diagnostics"], spec.resources
    with clock.stage("diagnostics"):
        s.diag = diagnostics_stage(s.cells, s.models, diag_root, s.paths["cache"], spec.data_seed,
                                   int(res.cpus_per_dense_task),  # CPU: tasks.pruning.rr builds CPU tensors
                                   load_kw={m: spec.load_kwargs(m) for m in s.models})
    if s.diag.keys:
        clock.say(f"[diagnostics] RR tables for {len(s.diag.models)} model(s), {s.diag.computed_layers} layers "
                  "computed")
    in_driver, why = masks_in_driver(s.on_cluster, res)
    with clock.stage("masks", f"masks: {len(s.cells)} cells ({', '.join(sorted({c.pruner for c in s.cells}))})"):
        s.mask_keys = mask_stage(s.cells, s.models, s.paths["masks"], s.paths["cache"], spec.data_seed,
                                 diagnostics=s.diag.tables(diag_root),
                                 load_kw={m: spec.load_kwargs(m) for m in s.models}, ranking_dir=s.paths["rankings"],
                                 in_driver=in_driver, resources=(res.cpus_per_dense_task, task_gpus(res)),
                                 device=res.device)
    if s.mask_keys.computed:
        nodes = sorted({r["node_id"] for r in s.mask_keys.computed})
        clock.say(f"[masks] {len(s.mask_keys.computed)} computed {why}"
                  + (f" on node(s) {', '.join(n[:12] for n in nodes)}" if not in_driver else ""))
    other_draws(s, in_driver, progress)


def other_draws(s: SweepState, in_driver: bool, progress: bool) -> None:
    """search.calib_draws: each other calibration draw's targets, diagnostics and masks (orchestrator/sweep/draws.py)."""
    specs = draw_specs(s.spec)
    if not specs:
        return
    seeds = ", ".join(str(d.calib_seed) for d in specs)
    with s.clock.stage("draws", f"calibration draws for re-evaluations: calib_seed {seeds}"):
        s.draws = [prepare_draw(d, cells_of_draw(s.spec, s.cells, j), s.rows, s.modes, s.paths,
                                on_cluster=s.on_cluster, in_driver=in_driver, progress=progress)
                   for j, d in enumerate(specs)]
    done = totals(s.draws)
    s.dense_total = record_dense(s.out_dir, s.info, s.session, sum(s.dense.values()) + done["dense"])  # this session
    write_targets(s)  # the draws' keys too
    s.clock.say(f"[draws] {done['dense']} dense images, {done['layers']} RR layers and {done['masks']} masks "
                f"computed for {len(specs)} draw(s)")


def tune_stage(s: SweepState, progress: bool, report: bool = True) -> None:
    """Every trial on Ray Tune (per-cell Optuna search, MLflow through the asynchronous single writer)."""
    import ray

    from orchestrator.raytune.tune_stop import InterruptStopper
    from orchestrator.search import PerCellOptunaSearch, search_kwargs
    from orchestrator.tracking.logger import MlflowTrialLogger

    spec, clock, t = s.spec, s.clock, s.tune
    with clock.stage("tune_start"):
        gran = {m: s.models[m].default_granularity for m in s.models}
        threads, device = max(1, int(spec.resources.cpus_per_trial)), trial_device(spec.resources)
        configs = [trial_config(c, spec, s.paths, s.models[c.model].store_key, s.mask_keys[c.cell_id],
                                 gran[c.model], threads, device, s.modes[c.model], sweep_id=s.info["sweep_id"])
                   for c in s.cells]
        draws = [trial_overrides(d, s.cells, j) for j, d in enumerate(s.draws)]  # each for the cells it prepared
        t.concurrency = cluster.present_concurrency(spec.resources, ray.cluster_resources())  # at start; logged
        t.max_concurrent = cluster.tune_concurrency(spec.resources, {})
        if s.retry_failed:  # before the design reads the journal: those trials are asked again
            retry_lines(drop_failed(s.out_dir, {c.cell_id for c in s.cells}), clock.say)
        t.writer = writer = AsyncMlflowWriter(lambda: s.tracking().client)
        t.searcher = searcher = PerCellOptunaSearch(
            configs, spec.search.trials_per_cell, spec.search.lr, spec.search.epochs, spec.search.sampler_seed,
            s.journal, asha=spec.search.scheduler == "asha", startup_trials=spec.search.startup_trials,
            defer=writer.submit, grids=grid_searches(spec), draws=draws, **search_kwargs(spec.search))
        t.logger = logger_cb = MlflowTrialLogger(writer, spec.mlflow.experiment, s.info["sweep_id"],
                                                 lambda: s.tracking().run_id, s.dense, replace=s.resume)

        searcher.on_fault = faults.stop  # a full disk met by a trial stops the sweep (orchestrator/rundir/faults.py)
        # DIR/trials.jsonl, the source of truth (orchestrator/rundir/records.py)
        searcher.record = TrialRecorder(s.out_dir, searcher.design, lambda: s.tracking().client, logger_cb.runs.get,
                                        lambda: s.tracking().run_id, stored=stored_weights(s.paths, s.info["sweep_id"]))
        per_cell = searcher.per_cell()
        grids: dict[str, int] = {}
        for c in s.cells:
            grids[c.grid or "main"] = grids.get(c.grid or "main", 0) + per_cell.get(c.cell_id, 0)
        upto = "up to " if searcher.converging else ""  # search.converge: each cell's count is a cap
        clock.say("[trials] " + ", ".join(f"grid {g}: {upto}{n} trials" for g, n in grids.items())
                  + f" over {len(per_cell)} cells, {t.concurrency} at a time")
        # like finished (sweep/end.py), the sweep's: its told trials, every grid and round, and what this run plans
        t.planned = searcher.design.told_in_sweep() + searcher.total  # (a refine round read "22 of 4")
        prog = TrialProgress(per_cell, progress, dropped=(lambda: searcher.dropped) if searcher.converging else None)
        name = f"{spec.name}-{s.info['sweep_id']}-s{s.session}"
        tuner = make_tuner(s.spec, s.out_dir, name, searcher, t.max_concurrent, [logger_cb, prog.callback],
                           stop=InterruptStopper(), storage=tune_home(s))
    t0, t.freed = time.perf_counter(), 0
    if searcher.total:
        lost = partial(sweep_end.cluster_lost, s, report=report)  # the whole cluster gone: our line, exit 1
        with cluster.pending_limit(spec.resources, searcher.total), node_guard.guarding(s.guard), \
                gcs_watch.watching(lost):
            tuner.fit()  # trials queue for nodes that join later; one that cannot import the project is fenced
        searcher.flush_errors()  # trials that failed after the last ask
        t.freed = drop_epoch_checkpoints(tune_experiment(tune_home(s), name))
    t.seconds = time.perf_counter() - t0
    clock.add("trials", t.seconds)
    prog.bar.close()
    with clock.stage("mlflow_flush"):
        writer.close()  # every queued MLflow write and Optuna tell is done after this


def tune_home(s: SweepState) -> str:
    """Ray Tune's storage: on a cluster with a remote store, its ``tune/`` (every node must write checkpoints
    there, and nodes may not share the run directory: docs/scaling.md "One storage URI"); else DIR/tune."""
    return s.paths["tune"] if s.on_cluster and "tune" in s.paths else str(s.out_dir / "tune")


def run_sweep(spec: SweepSpec, out_dir: Path, store_dir: Path, cache_dir: Path, *, address: str | None = None,
              progress: bool = True, report: bool = True, num_cpus: int | None = None,
              resume: bool = False, refine_round: int | None = None, verbose: bool = False,
              clock: StageClock | None = None, owns_ray: bool = False, models: dict | None = None,
              retry_failed: bool = False) -> SweepResult:
    """Run a sweep into ``out_dir``; with ``resume``, continue the sweep recorded there, its run directory prepared
    by the caller (``lifecycle.resume.prepare_resume``; orchestrator/rundir/files.py):
    its sweep id, MLflow parent run and Optuna journal are reused, told trials are not run again. With
    ``refine_round`` (healsweep refine), ``spec`` is a refinement grid run as a continuation of that sweep: same
    sweep id, parent run, journal and stores; the refined spec is logged as ``refine_<round>/spec.json``.
    ``clock``: the CLI's, already holding the imports/spec stages; stage lines print unless ``progress`` is off.
    ``owns_ray``: the caller started Ray for this sweep (``healsweep run`` starts it while the spec is checked):
    shut it down at the end like a Ray this call started. ``models``: ``stages.prepare_models``'s result when the
    caller loaded them already (``healsweep run``, while Ray starts). ``retry_failed`` (with ``resume``): the
    failed trials of its cells run again (orchestrator/tracking/retry.py)."""
    faults.clear()  # a fault stops only the sweep that met it (orchestrator/rundir/faults.py)
    quiet_libraries(verbose)
    t0 = time.time()
    cluster.check_address(address)  # one line, before any work: ray://, unreachable address
    cluster.check_store_uri(spec.store.uri)  # one line for an unreachable endpoint / missing bucket
    clock = clock or StageClock(enabled=progress)
    s = open_sweep(spec, out_dir, store_dir, cache_dir, resume, refine_round, clock)
    s.retry_failed = retry_failed and resume
    try:
        return _started(s, address, num_cpus, verbose, owns_ray, models, t0, progress, report)
    finally:
        for f in s.store_holds:  # taken before the stages read the store (_before_trials)
            store_users.release(f)


def store_roots(uri: str | None, store_dir: Path) -> list[Path]:
    """The local directories where ``healsweep store gc`` looks for a sweep's hold (store_users.py): its store
    directory, and for a local ``store.uri`` that path's parent (gc run on the targets finds it there); none for a
    remote store (a bucket has no locks)."""
    if uri and cluster.is_remote(uri):
        return []
    local = [Path(uri[len("file://"):] if uri.startswith("file://") else uri).expanduser().resolve().parent] if uri else []
    return [Path(store_dir), *local]


def _started(s: SweepState, address: str | None, num_cpus: int | None, verbose: bool, owns_ray: bool,
             models: dict | None, t0: float, progress: bool, report: bool) -> SweepResult:
    """``run_sweep`` once its run directory and store are held: Ray, the stages, the end."""
    clock = s.clock
    s.on_cluster, s.preloaded = bool(address), models
    models_ready = None if address else Handoff(background(_timed_models, s, progress))  # local: while Ray starts
    if owns_ray:  # started by the caller (healsweep run: while the spec was checked)
        started_ray = True
    else:
        with clock.stage("ray", f"ray: {'attaching to ' + address if address else 'starting a local instance'}"):
            started_ray = start_ray(address, num_cpus, verbose)
    with interrupt.catching():  # after ray.init, which installs Ray's own SIGTERM handler
        return _run_and_end(s, t0, started_ray, models_ready, progress, report)


def _run_and_end(s: SweepState, t0: float, started_ray: bool, models_ready: Handoff[ModelsPart] | None, progress: bool,
                 report: bool) -> SweepResult:
    """The stages after Ray is up, then the ending: summary, report (in a thread while Ray shuts down), release.
    A SIGINT/SIGTERM (orchestrator/rundir/interrupt.py) before the trials abandons the stage it arrives in; during the
    trials it stops Tune; either way the sweep ends here, marked partial."""
    clock, report_done, early = s.clock, None, False
    try:
        try:
            with interrupt.raising():
                _before_trials(s, models_ready, progress)
        except KeyboardInterrupt:  # SweepInterrupted, or one raised inside Ray's wait on a stage's tasks
            early = True
            interrupt.record(signal.SIGINT)  # (the latter: no handler of ours ran; the sweep ends the same way)
        if early:
            finished, failed, seconds = sweep_end.ended_early(s, t0)
        else:
            tune_stage(s, progress, report)
            finished, failed, seconds = sweep_end.summary_stage(s, t0, interrupt.received())
            report_done = sweep_end.start_report(s.out_dir, clock) if report else None  # while Ray shuts down
    finally:
        if s.parent_stage is not None and not s.parent_stage.done:  # failed before the trials: it ends first
            with contextlib.suppress(Exception):  # (its own error, if any, is not the one to report)
                s.parent_stage.get()
        if s.tune.writer is not None:
            s.tune.writer.close()
        if s.guard is not None:
            s.guard.release()
        if started_ray:
            with clock.stage("ray_shutdown"):
                sweep_end.shutdown_ray()  # ~1 s of waiting for Ray's processes to exit; no Ray object freed meanwhile
    paths_out = report_done() if report_done else None
    run = s.tracking() if s.parent_stage is not None and s.parent_stage.done else None
    if run is not None and run.run_id:
        run.client.log_batch(run.run_id, metrics=sweep_end.report_metric(clock, s.session))
    clock.say(clock.summary())
    release_run_dir(s.out_dir)
    return SweepResult(s.info["sweep_id"], s.out_dir, s.info["tracking_uri"], run.run_id if run else "", finished, failed,
                       sum(s.dense.values()) + totals(s.draws)["dense"], seconds, paths_out, dict(clock.seconds),
                       trials_planned=s.tune.planned, interrupted=interrupt.received())


def _before_trials(s: SweepState, models_ready: Handoff[ModelsPart] | None, progress: bool) -> None:
    import ray

    if s.on_cluster:
        with s.clock.stage("ray"):  # part of attaching: which nodes can run the project's code
            check_nodes(s)
    cluster.check_fits(s.spec.resources.peak_request(), ray.nodes(), autoscaling=s.on_cluster)  # else Tune waits
    try:
        take_models(s, models_ready.get() if models_ready is not None else _timed_models(s, progress))
        # store gc keeps out from here on (a refused sweep made nothing in the store, not even its hold)
        s.store_holds = store_users.sweep_holds(store_roots(s.spec.store.uri, s.store_dir), s.out_dir)
        dense_and_masks(s, progress)
        _forget_loaded_models()
    except ray.exceptions.RayError as e:  # a node that joined since the check, without the project: one line
        if s.guard is None or not missing_project_line(e):
            raise
        raise cluster.ClusterError(missing_project_line(e)) from None
    s.parent_stage = parent_stage.start(s)  # while Tune starts the trial actors (see SweepState.tracking())


def _forget_loaded_models() -> None:
    """The driver's kept model copy (tasks.models.load_model_shared: the models, dense and mask stages load each
    model several times) is dropped once those stages ran, so the driver does not hold a model and its
    preprocessed dataset through the trials. Nothing to drop (and no torch imported) when no stage loaded one."""
    load = sys.modules.get("tasks.models.load")
    if load is not None:
        load.forget()


def check_nodes(s: SweepState) -> None:
    """Every node of the cluster imports the project and, when Ray Tune's storage is the run directory, sees it;
    or is named in one line and kept out of the sweep (orchestrator/raytune/node_guard.py); ClusterError when none
    is left that could run it."""
    must_see = None if cluster.is_remote(tune_home(s)) else str(s.out_dir)  # Tune's storage is the run directory
    s.guard = NodeGuard(run_dir=must_see, sweep_id=s.info["sweep_id"])
    s.guard.check()
    if s.guard.bad and (unplaced := s.guard.unplaced(node_guard.requests(s.spec.resources))):
        raise cluster.ClusterError(s.guard.refusal(unplaced))  # e.g. a GPU sweep whose GPU nodes are all fenced
    s.guard.wait_fenced()  # the stages' tasks come next: none may land on a fenced node


def missing_project_line(e: BaseException) -> str | None:
    """One line for a stage's Ray task that failed because its node cannot import the project (a node that joined
    after :func:`check_nodes`); None for any other error."""
    problem = missing_project(e)
    if problem is None:
        return None
    return (f"a node that joined during the sweep cannot import the project ({problem}): {install_hint()} on it "
            "and restart Ray there, then continue with healsweep run --resume DIR")
