"""The sweep's MLflow parent stage: the tracking store (artifacts inside the run directory), the parent run
(created once, reopened on resume/refine) and what the earlier stages log to it (diagnostics, LAMP allocations,
where masks and dense shards were computed).

It runs in a thread (:func:`start`) from the end of the mask stage, while Tune starts the trial actors (their
imports take seconds). ``healsweep run`` has imported MLflow's client and SQL store by then, in a thread of their
own while Ray started (orchestrator/commands/run.py ``_import_mlflow_aside``; ~1.7 CPU-s that would otherwise
compete with the actors' imports here). The sweep's MLflow writer and trial
logger take the client and the parent run id through ``_Sweep.tracking()``, which joins this thread at the first
trial callback and re-raises its error there (orchestrator/tracking.py).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

_Sweep = Any  # orchestrator.sweep._Sweep (not imported: sweep imports this module)


def start(s: _Sweep) -> Callable[[], None]:
    """The parent stage in a thread; -> the callable that joins it (re-raising its error). Ray Tune is imported
    here first, in the calling thread: the thread imports it too (orchestrator.tracking) while this one goes on to
    Tune, and two threads importing ray.tune's circular modules at once can see one half-initialised (ImportError:
    "cannot import name ... from partially initialized module ray.train...")."""
    import ray.tune  # noqa: F401

    from orchestrator.background import background

    def stage() -> None:
        with s.clock.stage("parent"):
            parent_run(s)
    return background(stage)


def tracking_inside(uri: str, out_dir: Path, experiment: str):
    """The experiment created with its artifacts in the run directory (not $PWD/mlruns), then the client."""
    from orchestrator import cluster
    from orchestrator.stages import open_tracking

    cluster.keep_artifacts_inside(uri, out_dir, experiment)
    return open_tracking(uri, experiment)


def parent_run(s: _Sweep) -> None:
    """The sweep's MLflow parent run: created once, reopened on resume/refine; diagnostics logged to it."""
    from orchestrator.diagnostics import log_diagnostics
    from orchestrator.resume import reconcile, write_sweep
    from orchestrator.tracking import experiment_id, start_parent

    spec, info = s.spec, s.info
    s.client = client = tracking_inside(info["tracking_uri"], s.out_dir, spec.mlflow.experiment)
    spec_json = json.dumps(spec.to_dict(), indent=1, default=list)
    if info.get("parent_run_id") is None:
        info["parent_run_id"] = start_parent(client, spec.mlflow.experiment, info["sweep_id"], spec.name, {
            "spec_name": spec.name, "cells": len(s.cells), "trials_per_cell": spec.search.trials_per_cell,
            "models": ",".join(spec.models), "objective": spec.search.objective, "store": str(s.store_dir),
            "scheduler": spec.search.scheduler, "grids": ",".join(["main", *(g.name for g in spec.grids)]),
            "search_design": spec.search.design, "reevaluate": spec.search.reevaluate,
            "sampler_seed": spec.search.sampler_seed, "search_converge": json.dumps(spec.search.converge)})
        client.log_text(info["parent_run_id"], spec_json, "spec.json")
        write_sweep(s.out_dir, info)
    else:
        client.update_run(info["parent_run_id"], status="RUNNING")
        client.set_tag(info["parent_run_id"], "resumes", str(info["resumes"]))
        if s.refine_round is not None:
            client.log_text(info["parent_run_id"], spec_json, f"refine_{s.refine_round}/spec.json")
        reconcile(client, experiment_id(client, spec.mlflow.experiment), info["sweep_id"], s.journal)
        sync_record(s, client, info["parent_run_id"])
    s.parent = info["parent_run_id"]
    diag_root = s.paths["diagnostics"]
    if s.mask_keys.computed:  # where this session's masks were computed (node ids; "driver" in-process)
        client.set_tag(s.parent, f"mask_placement_{s.session}", s.mask_keys.placement)
        client.set_tag(s.parent, f"mask_nodes_{s.session}",
                       ",".join(sorted({r["node_id"] for r in s.mask_keys.computed})))
    log_diagnostics(client, s.parent, diag_root, s.diag)
    if s.diag.models:  # LAMP allocations need weights: computed here, read back by the report's CTS section
        log_lamp(s, diag_root)
    if s.dense_rep.nodes:  # where this session's dense shards were computed (Ray node id: shards)
        client.set_tag(s.parent, f"dense_nodes_{s.session}",
                       ",".join(f"{n}:{k}" for n, k in sorted(s.dense_rep.nodes.items())))
    if s.dense_rep.events:  # damaged shards found and recomputed
        client.log_text(s.parent, "\n".join(s.dense_rep.events) + "\n", f"store_events_{s.session}.txt")


def sync_record(s: _Sweep, client, parent: str) -> None:
    """Every trial of the record (DIR/trials.jsonl) has its one MLflow run: one that the tracking store lost is
    recreated from the record (orchestrator/rebuild.py)."""
    from orchestrator import records
    from orchestrator.rebuild import sync_runs
    from orchestrator.tracking import experiment_id

    trials = records.trials(records.scan(s.out_dir / records.TRIALS_FILE))
    if trials:
        sync_runs(client, experiment_id(client, s.spec.mlflow.experiment), s.info["sweep_id"], parent, trials)


def log_lamp(s: _Sweep, diag_root: str) -> None:
    from analysis.cts import CTSSettings
    from orchestrator.diagnostics import log_lamp_allocations
    from tasks.models import load_model

    def weights_of(m):
        lm = load_model(m, s.paths["cache"], data_seed=s.spec.data_seed, progress=False, **s.spec.load_kwargs(m))
        return {k: v.detach() for k, v in lm.model.named_parameters()}

    log_lamp_allocations(s.client, s.parent, diag_root, s.diag, weights_of, CTSSettings().targets)
