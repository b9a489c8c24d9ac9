"""The sweep's MLflow parent stage: the tracking store (artifacts inside the run directory), the parent run
(created once, reopened on resume/refine) and what the earlier stages log to it (diagnostics, LAMP allocations,
where masks and dense shards were computed).

It runs in a thread (:func:`start`) from the end of the mask stage, while Tune starts the trial actors (their
imports take seconds). ``healsweep run`` has imported MLflow's client and SQL store by then, in a thread of their
own while Ray started (orchestrator/commands/run.py ``_import_mlflow_aside``; ~1.7 CPU-s that would otherwise
compete with the actors' imports here). The thread reads the sweep's state (no stage writes it after the masks)
and writes nothing into it: it returns a :class:`ParentRun`, which the sweep's MLflow writer and trial logger take
through ``SweepState.tracking()`` (orchestrator/sweep/state.py ``Handoff``; it joins this thread at the
first trial callback and re-raises its error there).
"""
from __future__ import annotations

import json
import sys
from dataclasses import asdict
from pathlib import Path

from orchestrator.rundir import records
from orchestrator.rundir.files import reconcile, write_sweep
from orchestrator.sweep.background import background
from orchestrator.sweep.draws import totals
from orchestrator.spec.schema import converge_of
from orchestrator.sweep.state import Handoff, ParentRun, SweepState
from orchestrator.tracking.rebuild import drop_stray_parents, parent_gone, reopen_parent, sync_runs
from orchestrator.tracking.store import experiment_id, keep_artifacts_inside, open_tracking, own_db


def start(s: SweepState) -> Handoff[ParentRun]:
    """The parent stage in a thread; -> its hand-off (``SweepState.parent_stage``). Ray Tune is imported here
    first, in the calling thread: the thread imports it too (orchestrator.tracking.logger) while this one goes on
    to Tune, and two threads importing ray.tune's circular modules at once can see one half-initialised
    (ImportError: "cannot import name ... from partially initialized module ray.train...")."""
    import ray.tune  # noqa: F401

    def stage() -> ParentRun:
        with s.clock.stage("parent"):
            return parent_run(s)
    return Handoff(background(stage))


def tracking_inside(uri: str, out_dir: Path, experiment: str):
    """The experiment created with its artifacts in the run directory (not $PWD/mlruns), then the client."""
    keep_artifacts_inside(uri, out_dir, experiment)
    return open_tracking(uri, experiment)


def converge_param(raw) -> str:
    """The parent run's ``search_converge`` param: every setting of ``search.converge`` resolved (defaults
    included, so a run says which walk and noise rules it used), or "null" for a fixed trial count."""
    c = converge_of(raw)
    return json.dumps(None if c is None else asdict(c), sort_keys=True)


def parent_run(s: SweepState) -> ParentRun:
    """The sweep's MLflow parent run: created once, reopened on resume/refine; diagnostics logged to it. Works on
    a copy of sweep.json's contents (written to the file here); the caller takes the run id from the result."""
    from orchestrator.tracking.logger import start_parent  # ray.tune + MLflow: this thread's imports
    spec, info = s.spec, dict(s.info)
    client = tracking_inside(info["tracking_uri"], s.out_dir, spec.mlflow.experiment)
    spec_json = json.dumps(spec.to_dict(), indent=1, default=list)
    if info.get("parent_run_id") is None:
        info["parent_run_id"] = start_parent(client, spec.mlflow.experiment, info["sweep_id"], spec.name, {
            "spec_name": spec.name, "cells": len(s.cells), "trials_per_cell": spec.search.trials_per_cell,
            "models": ",".join(spec.models), "objective": spec.search.objective, "store": str(s.store_dir),
            "scheduler": spec.search.scheduler, "grids": ",".join(["main", *(g.name for g in spec.grids)]),
            "search_design": spec.search.design, "reevaluate": spec.search.reevaluate,
            "sampler_seed": spec.search.sampler_seed, "search_converge": converge_param(spec.search.converge),
            "calib_seed": spec.calib_seed, "calib_draws": spec.search.calib_draws})
        client.log_text(info["parent_run_id"], spec_json, "spec.json")
        write_sweep(s.out_dir, info)
    else:
        if parent_gone(client, info["parent_run_id"]):  # its rows deleted: back from the record, then reopened
            print(f"healsweep: {reopen_parent(client, experiment_id(client, spec.mlflow.experiment), s.out_dir, info)}",
                  file=sys.stderr)
        client.update_run(info["parent_run_id"], status="RUNNING")
        client.set_tag(info["parent_run_id"], "resumes", str(info["resumes"]))
        if s.refine_round is not None:
            client.log_text(info["parent_run_id"], spec_json, f"refine_{s.refine_round}/spec.json")
        reconcile(client, experiment_id(client, spec.mlflow.experiment), info["sweep_id"], s.journal)
        sync_record(s, client, info["parent_run_id"])
    parent = info["parent_run_id"]
    if own_db(s.out_dir, info) and (n := drop_stray_parents(client, experiment_id(client, spec.mlflow.experiment),
                                                             info["sweep_id"], parent)):  # not a server's runs
        print(f"healsweep: note: deleted {n} stray parent run(s) of sweep {info['sweep_id']} (a start or a repair cut "
              f"short); its parent run is {parent}", file=sys.stderr)
    log_stages(s, client, parent)
    return ParentRun(client, parent)


def log_stages(s: SweepState, client, parent: str) -> None:
    """What the stages before the trials leave on the parent run: mask and dense placement, RR diagnostics,
    LAMP allocations, store integrity events."""
    from orchestrator.sweep.diagnostics import log_diagnostics  # ray, pyarrow: imported in this thread

    diag_root = s.paths["diagnostics"]
    if s.mask_keys.computed:  # where this session's masks were computed (node ids; "driver" in-process)
        client.set_tag(parent, f"mask_placement_{s.session}", s.mask_keys.placement)
        client.set_tag(parent, f"mask_nodes_{s.session}",
                       ",".join(sorted({r["node_id"] for r in s.mask_keys.computed})))
    log_diagnostics(client, parent, diag_root, s.diag)
    if s.diag.models:  # LAMP allocations need weights: computed here, read back by the report's CTS section
        log_lamp(s, client, parent, diag_root)
    if s.dense_rep.nodes:  # where this session's dense shards were computed (Ray node id: shards)
        client.set_tag(parent, f"dense_nodes_{s.session}",
                       ",".join(f"{n}:{k}" for n, k in sorted(s.dense_rep.nodes.items())))
    # damaged shards and masks found and recomputed, the other calibration draws' too (search.calib_draws)
    events = [*s.dense_rep.events, *s.mask_keys.events, *totals(s.draws)["events"]]
    if events:
        client.log_text(parent, "\n".join(events) + "\n", f"store_events_{s.session}.txt")


def sync_record(s: SweepState, client, parent: str) -> None:
    """Every trial of the record (DIR/trials.jsonl) has its one MLflow run: one that the tracking store lost is
    recreated from the record (orchestrator/tracking/rebuild.py)."""
    trials = records.trials(records.scan(s.out_dir / records.TRIALS_FILE))
    if trials:
        sync_runs(client, experiment_id(client, s.spec.mlflow.experiment), s.info["sweep_id"], parent, trials)


def log_lamp(s: SweepState, client, parent: str, diag_root: str) -> None:
    from analysis.cts import CTSSettings
    from orchestrator.sweep.diagnostics import log_lamp_allocations
    from tasks.models import load_model

    def weights_of(m):
        lm = load_model(m, s.paths["cache"], data_seed=s.spec.data_seed, progress=False, **s.spec.load_kwargs(m))
        return {k: v.detach() for k, v in lm.model.named_parameters()}

    log_lamp_allocations(client, parent, diag_root, s.diag, weights_of, CTSSettings().targets)
