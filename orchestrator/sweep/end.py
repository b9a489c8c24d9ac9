"""The end of a sweep: the parent run's final marking (complete or partial), Ray's shutdown with nothing freeing
Ray objects meanwhile, and the report written in a thread while Ray shuts down.

Why ``shutdown_ray`` collects garbage first: ``ray.shutdown()`` tears the driver's core worker down in C++ with
the GIL released (``CoreWorker.shutdown_driver``, ~0.25 s on 2 cores) and only then drops the Python attribute
``global_worker.core_worker``. An ``ObjectRef`` freed by another thread in that window calls into the destroyed
core worker, which ends the process (``core_worker_process.cc:1109: The core worker has already been shutdown
... The process will exit``, exit status 1) - found with a thread freeing ObjectRefs during ``ray.shutdown()``:
3 of 3 runs died that way. A finished Tune ``fit`` leaves unreachable reference cycles that hold ObjectRefs
(its controller's actor-task futures: 6 ObjectRefs after a 6-trial fit); cyclic garbage is freed by whichever
thread's allocation triggers the next collection - in a sweep, the report thread, busy with pandas and
matplotlib exactly while Ray shuts down. The more trials, the more garbage and the likelier the crash (2 of 3
default-spec runs). So: collect while the core worker is alive, and keep the cyclic collector off until the
shutdown returns; the report thread holds no Ray object, so it still overlaps the shutdown.
"""
from __future__ import annotations

import gc
import json
import os
import signal
import sys
import time
from pathlib import Path

from orchestrator.rundir.files import release_run_dir, told_states
from orchestrator.rundir.interrupt import received
from orchestrator.sweep.background import background
from orchestrator.sweep.console import StageClock
from orchestrator.sweep.draws import totals
from orchestrator.sweep.state import SweepState
from tasks.errors import first_line


def shutdown_ray() -> None:
    """``ray.shutdown()`` with every unreachable Ray object freed first and no garbage collection (in any
    thread) until it returns."""
    import ray

    enabled = gc.isenabled()
    gc.collect()  # Tune's leftover cycles (ObjectRefs, actor handles) freed while the core worker is alive
    gc.disable()  # process-wide: the report thread's allocations trigger no collection during the teardown
    try:
        ray.shutdown()
    finally:
        if enabled:
            gc.enable()


def mark_parent(client, parent: str, finished: int, failed: int, planned: int | None, signum: int | None,
                lost: str = "") -> None:
    """The parent run's final state: FINISHED, or KILLED and tagged ``partial=true`` when a signal interrupted
    the sweep; tags ``trials_finished`` / ``trials_failed`` / ``trials_planned`` (empty: interrupted before the
    trials were planned) either way, so a resumed sweep that completes clears ``partial``. The report's first
    screen reads them (analysis/report.py)."""

    from mlflow.entities import RunTag

    stopped = lost or (signal.Signals(signum).name if signum is not None else "")  # lost: what ended it instead
    tags = {"partial": "true" if stopped else "false", "trials_finished": str(finished),
            "trials_failed": str(failed), "trials_planned": "" if planned is None else str(planned),
            "interrupted_by": stopped}
    client.log_batch(parent, tags=[RunTag(k, v) for k, v in tags.items()])
    client.set_terminated(parent, "KILLED" if stopped else "FINISHED")


def told_counts(journal: Path) -> tuple[int, int]:
    """(finished, failed) trials over every session of the sweep, from its Optuna journal."""
    states = told_states(journal).values() if journal.exists() else []
    return sum(st.name in ("COMPLETE", "PRUNED") for st in states), sum(st.name == "FAIL" for st in states)


def summary_stage(s: SweepState, t_start: float, signum: int | None = None) -> tuple[int, int, float]:
    """Counts from the journal; the parent run's metrics (stage times included); the parent run FINISHED, or
    KILLED and tagged partial when ``signum`` interrupted the sweep."""
    from mlflow.entities import Metric

    run = s.tracking()  # the parent stage's thread, joined (its error re-raised)
    client, parent = run.client, run.run_id
    t, logger_cb, writer, diag = s.tune, s.tune.logger, s.tune.writer, s.diag
    finished, failed = told_counts(s.journal)
    seconds = time.time() - t_start
    compute = logger_cb.trial_seconds
    s.clock.trial_compute = compute  # Σ trial compute (in the trials), printed next to the trials' wall time
    ts = int(time.time() * 1000)
    drawn = totals(s.draws)  # search.calib_draws: the other draws' work counts with the sweep's own
    values = {
        "dense_forward_images": s.dense_total, "dense_forward_images_session": sum(s.dense.values()) + drawn["dense"],
        "trials_finished": finished, "trials_failed": failed,
        "trials_run": logger_cb.finished + logger_cb.failed, "trials_rerun": len(t.searcher.rerun),
        "sweep_seconds": seconds, "tune_seconds": t.seconds, "concurrency": t.concurrency,
        "masks_computed": len(s.mask_keys.computed) + drawn["masks"],
        "diagnostics_layers_computed": diag.computed_layers + drawn["layers"], "diagnostics_seconds": diag.seconds,
        "dense_shards_computed": sum(s.dense_rep.shards.values()) + drawn["shards"],
        "store_integrity_events": len(s.dense_rep.events) + len(drawn["events"]),
        "mlflow_callback_seconds": logger_cb.callback_seconds, "mlflow_writer_seconds": writer.write_seconds,
        "mlflow_flush_seconds": s.clock.seconds.get("mlflow_flush", 0.0), "mlflow_write_errors": writer.errors,
        "tune_checkpoint_bytes_freed": t.freed, "trial_compute_seconds": compute, **s.clock.metrics()}
    client.log_batch(parent, metrics=[Metric(k, float(v), ts, s.session) for k, v in values.items()])
    client.log_text(parent, json.dumps(t.searcher.design.noise(), indent=1), "search_noise.json")
    mark_parent(client, parent, finished, failed, t.planned, signum)
    return finished, failed, seconds


def ended_early(s: SweepState, t0: float) -> tuple[int, int, float]:
    """A sweep interrupted before its trials: the journal's counts (earlier sessions), the parent run KILLED and
    tagged partial: the one its parent stage opened, else the one sweep.json names (a resumed sweep or a widening
    round stopped before that stage: the parent of a complete sweep read FINISHED, partial=false)."""
    finished, failed = told_counts(s.journal)
    run = s.tracking()  # the parent stage, if it had started
    if run.run_id:
        mark_parent(run.client, run.run_id, finished, failed, None, received())
    elif s.info.get("parent_run_id") and not s.info.get("complete"):  # a complete sweep's extra round added nothing
        try:
            _mark_recorded_parent(s.info["tracking_uri"], s.info["parent_run_id"], finished, failed)
        except Exception as e:  # noqa: BLE001 - a tracking server's hiccup: the interrupt's own line still comes
            print(f"healsweep: could not mark the parent run interrupted ({type(e).__name__}: {first_line(e)})",
                  file=sys.stderr)
    return finished, failed, time.time() - t0


def _mark_recorded_parent(uri: str, parent: str, finished: int, failed: int) -> None:
    """``mark_parent`` on sweep.json's parent run, its earlier plan kept (``trials_planned``); a parent that is gone
    is left to the resume, which reopens it."""
    from mlflow import MlflowClient
    from mlflow.exceptions import MlflowException

    client = MlflowClient(uri)
    try:
        run = client.get_run(parent)
    except MlflowException as e:
        if e.error_code == "RESOURCE_DOES_NOT_EXIST":
            return
        raise
    if run.info.lifecycle_stage != "active":
        return
    tagged = run.data.tags.get("trials_planned") or ""
    planned = max(int(tagged), finished + failed) if tagged.isdigit() else None
    mark_parent(client, parent, finished, failed, planned, received())


def start_report(out_dir: Path, clock: StageClock):
    """write_report in a thread (figures use matplotlib's Agg canvas, no pyplot); -> a callable that joins it
    and returns the report's paths (re-raising its error). Everything it reads is in MLflow already. The report's
    modules (~0.3 s of imports) are imported in that thread too, so Ray's shutdown starts at once."""
    def write():
        with clock.stage("report", "report: writing report.html and report.md"):
            from analysis.report import write_report

            return write_report(out_dir)
    return background(write)


def report_metric(clock: StageClock, step: int) -> list:
    from mlflow.entities import Metric

    ts = int(time.time() * 1000)
    return [Metric(k, float(v), ts, step) for k, v in clock.metrics().items()
            if k in ("stage_report_seconds", "stage_ray_shutdown_seconds")]


# ------------------------------------------------------------------------------------ the cluster lost
LOST = "the loss of its Ray cluster"  # the parent run's interrupted_by: the report's partial note quotes it
LOST_WRITES_S, LOST_REPORT_S = 10.0, 25.0  # within what is left of Ray's 60 s (orchestrator/raytune/gcs_watch.py)


def cluster_lost(s: SweepState, address: str, seconds: float, report: bool) -> None:
    """The whole Ray cluster gone during the trials (``gcs_watch``): the queued MLflow writes flushed, the parent
    run KILLED and tagged partial, the report written (each bounded in time), one line, the run directory
    released, then the process ends with exit 1 (``os._exit``: Tune's loop in the main thread hangs on the dead
    cluster, and Ray's core ends the process anyway 60 s after the loss). Every told trial is in trials.jsonl
    already (recorded as it is told): ``healsweep run --resume DIR`` runs the rest."""
    if s.tune.writer is not None:
        s.tune.writer.flush(LOST_WRITES_S)
    finished, failed = told_counts(s.journal)
    planned = s.tune.planned
    try:
        run = s.tracking()
        if run.run_id:
            mark_parent(run.client, run.run_id, finished, failed, planned, None, lost=LOST)
    except Exception:  # noqa: BLE001 - a tracking server that went with the cluster: the record has it all
        pass
    extra = f", {failed} failed" if failed else ""
    print(f"\nhealsweep: error: the Ray cluster at {address} stopped answering ({seconds:.0f} s without its GCS) "
          f"during the trials: {finished} of {planned or '?'} trials finished{extra}, each recorded in "
          f"{s.out_dir / 'trials.jsonl'}; resume with healsweep run --resume {s.out_dir} (with --address once "
          "the cluster is back, or on a local Ray)", file=sys.stderr, flush=True)
    paths = _report_within(LOST_REPORT_S, s.out_dir) if report else None
    if paths:
        print(f"report: {Path(paths['html']).resolve()} (partial)", flush=True)
    release_run_dir(s.out_dir)
    os._exit(1)


def _report_within(seconds: float, out_dir: Path) -> dict | None:
    """The report's paths if it is written within ``seconds`` (None if not, or if it failed: the sweep ends
    either way, and `healsweep report DIR` writes it later)."""
    def write() -> dict:
        from analysis.report import write_report

        return write_report(out_dir)
    try:
        return background(write)(seconds)
    except Exception:  # noqa: BLE001 - TimeoutError, or whatever the report met
        return None
