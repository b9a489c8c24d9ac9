"""The report's first-screen line for a sweep that has not ended complete: one interrupted (a signal, the loss of
its Ray cluster, or a stop nobody saw that ``healsweep doctor --repair`` recorded), one still running, or one whose
driver stopped without ending it (SIGKILL, the OOM killer, a machine that went down: its parent run is left
RUNNING and no live process holds the run directory)."""
from __future__ import annotations

import json
from pathlib import Path


def state_note(info: dict, finished: int, out: Path, driver: str | None) -> str:
    """"" for a sweep that ended complete, else the line. ``info``: ``runs.load_sweep_info``'s; ``finished``: its
    trial runs FINISHED in MLflow; ``driver``: None when not looked at (the report the sweep's own driver writes,
    after it marked the parent run), "" when no live process holds the run directory, else what holds it (its lock
    file's text: "<pid>" for a driver, "<pid> doctor" for a repair)."""
    rnd = interrupted_refine(out)  # a refine round is continued by refine: run --resume resumes the main grid only
    resume = f"Continue it with healsweep refine {out}" if rnd else f"Resume with healsweep run --resume {out}"
    if info.get("status") == "RUNNING" and driver is not None and not driver.endswith(" doctor"):
        if driver:  # a resume of an interrupted sweep runs it too: its old partial tag no longer says how it stands
            return (f"Sweep in progress: a healsweep driver (pid {driver.split()[0]}) is running it; {finished} "
                    "trials finished so far, and the findings cover those only.")
        return (f"Unfinished sweep: its driver stopped without ending it (killed, or its machine went down) with "
                f"{finished} trials finished; the findings cover those trials only. {resume}")
    p = info.get("partial")  # (a repair holding the run directory: what it leaves is told once it ends)
    if p:
        done = f"{p['finished']} of {p['planned']}" if p.get("planned") else str(p["finished"])
        return (f"Partial sweep: interrupted by {p['signal']} with {done} trials finished; the findings cover those "
                f"trials only. {resume}")
    return ""


def interrupted_refine(run_dir: Path) -> int | None:
    """The round of ``run_dir``'s last refinement when sweep.json marks it ``interrupted`` (stopped, or still
    running: orchestrator/lifecycle/refine.py marks a round before it starts), else None (no sweep.json either)."""
    try:
        rounds = json.loads((Path(run_dir) / "sweep.json").read_text(encoding="utf-8")).get("refinements") or []
    except (OSError, ValueError, AttributeError):
        return None
    last = rounds[-1] if rounds and isinstance(rounds[-1], dict) else {}
    return int(last["round"]) if last.get("interrupted") and "round" in last else None
