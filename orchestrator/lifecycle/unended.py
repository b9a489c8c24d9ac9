"""A sweep left unended: its parent run RUNNING in MLflow while no live process holds the run directory (its driver
was killed - SIGKILL, the OOM killer - or its machine went down: nothing ran the sweep's end). ``healsweep doctor``
names it; ``--repair`` records it as what it is, as a signal's end would have (the parent run KILLED and tagged
partial, the trial runs that were running KILLED), so that MLflow's UI and the report say so. ``healsweep run
--resume`` continues it either way (it reopens the parent run and replaces those trial runs)."""
from __future__ import annotations

from pathlib import Path

from orchestrator.sweep.end import mark_parent, told_counts
from orchestrator.tracking.rebuild import unrecorded_running

UNSEEN = "its driver's end without a trace (killed, or its machine went down)"  # the parent run's interrupted_by


def parent_state(client, parent_id: str | None) -> tuple[str, dict] | None:
    """(status, tags) of the sweep's parent run; None when there is none to read (check_tracking says why)."""
    if not parent_id:
        return None
    try:
        run = client.get_run(parent_id)
    except Exception:  # noqa: BLE001 - missing or unreadable: the tracking check names it
        return None
    return run.info.status, run.data.tags


def mark_unended(client, exp_id: str, info: dict, journal: Path, trials: dict[str, dict]) -> str:
    """The unended sweep recorded as interrupted (module docstring); -> what was done."""
    ids = unrecorded_running(client, exp_id, info["sweep_id"], trials)
    for run_id in ids:
        client.set_terminated(run_id, "KILLED")
    finished, failed = told_counts(journal) if journal.exists() else (0, 0)
    mark_parent(client, info["parent_run_id"], finished, failed, None, None, lost=UNSEEN)
    return (f"the parent run marked KILLED and partial ({finished} trials finished)"
            + (f", {len(ids)} trial run(s) that were running marked KILLED" if ids else ""))


def partial_words(tags: dict, run_dir: Path) -> str:
    """" (the sweep is partial: ...)" for a parent run tagged ``partial=true`` (doctor's "no problem found" line),
    else ""."""
    if tags.get("partial") != "true":
        return ""
    return (f" (the sweep is partial: interrupted by {tags.get('interrupted_by') or 'a signal'} with "
            f"{tags.get('trials_finished', '?')} trials finished; continue with healsweep run --resume {run_dir})")
