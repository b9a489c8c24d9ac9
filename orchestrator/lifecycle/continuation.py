"""What refinement and widening share: a finished sweep read back (sweep.json, its MLflow parent run and
trials) and the error that refuses one in one line."""
from __future__ import annotations

from pathlib import Path

from orchestrator.rundir.files import ResumeError, read_sweep


class RefineError(ValueError):
    """Why a sweep cannot be refined (one line)."""


def read_run(run_dir: Path) -> tuple[dict, str, dict, object]:
    """(sweep.json, tracking URI, parent-run info, every trial's row) of a finished sweep; RefineError (one line)
    without sweep.json or without the sweep's parent run in MLflow. Shared by refinement and widening."""
    from analysis.runs import load_sweep_info, load_trials

    try:
        meta = read_sweep(Path(run_dir))  # checked: an empty, torn or foreign sweep.json is one line
    except ResumeError as e:
        raise RefineError(str(e)) from None
    uri = meta.get("tracking_uri") or f"sqlite:///{(Path(run_dir) / 'mlflow.db').resolve()}"
    exp = meta.get("experiment") or "healsweep"
    info = load_sweep_info(uri, meta["sweep_id"], exp, meta.get("parent_run_id"))
    if info["run_id"] is None:
        raise RefineError(f"{run_dir}: parent run of sweep {meta['sweep_id']} not found in MLflow")
    return meta, uri, info, load_trials(uri, meta["sweep_id"], exp)
