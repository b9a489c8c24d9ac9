"""A run directory's own files: ``sweep.json``, the Optuna journal's told states, the driver lock, and the MLflow
runs reconciled with the journal. What makes a sweep whose driver died resumable (``healsweep run --resume DIR``;
its files are checked and prepared by orchestrator/lifecycle/resume.py).

We do not use ``Tuner.restore``: the durable state of a sweep is already outside Tune. The per-cell Optuna
journal (DIR/optuna.journal) records every asked trial, its parameters and whether it was told; the target and
mask stores are content-addressed; DIR/sweep.json holds the sweep id, the spec and the MLflow parent run.
A restart therefore rebuilds the searcher over the journal (told trials are never run again; asked-but-untold
trials run again with the same trial number and parameters, from scratch) and starts a new Tune experiment
for the remaining work. Optuna is told only after that trial's MLflow writes (same writer thread), so a told
trial always has its complete child run; ``reconcile`` closes child runs whose final status was lost.
"""
from __future__ import annotations

import fcntl
import json
import os
from pathlib import Path
from typing import TYPE_CHECKING

from orchestrator.rundir import records
from tasks.atomic import atomic_write_text

if TYPE_CHECKING:  # imported where used: `healsweep run` checks a run directory before Ray starts
    from mlflow import MlflowClient
    from optuna.trial import TrialState

SWEEP_FILE = "sweep.json"
JOURNAL_FILE = "optuna.journal"
STATUS = {"COMPLETE": "FINISHED", "FAIL": "FAILED", "PRUNED": "KILLED"}  # Optuna TrialState name -> MLflow


class ResumeError(ValueError):
    pass


_SWEEP_KEYS = {"sweep_id": str, "tracking_uri": str, "store": str, "cache": str, "spec": dict}
# Keys every written spec holds (orchestrator/spec/schema.py to_dict), since the first sweep.json
_SPEC_KEYS = ("models", "sparsities", "calib_sizes", "pruners", "healers", "seeds", "search", "heal")


def interrupted_round(info: dict) -> dict | None:
    """sweep.json's last ``refinements`` record when it is marked ``interrupted`` (orchestrator/lifecycle/refine.py
    marks a round before it starts, unmarks it once it ends complete), else None."""
    last = (info.get("refinements") or [None])[-1]
    return last if isinstance(last, dict) and last.get("interrupted") else None


def read_sweep(out_dir: Path, repair_hint: bool = True) -> dict:
    """DIR/sweep.json, checked: ResumeError (one line) when it is missing, unreadable or lacks a field; in a run
    directory (its trials.jsonl is there) the line names the repair that rebuilds it (``repair_hint``; doctor,
    which is that repair, reads it without)."""
    try:
        return _checked_sweep(Path(out_dir))
    except ResumeError as e:
        if not repair_hint or not (Path(out_dir) / records.TRIALS_FILE).is_file():
            raise
        raise ResumeError(f"{e}; rebuild it with healsweep doctor {out_dir} --repair") from None


def _checked_sweep(out_dir: Path) -> dict:
    f = out_dir / SWEEP_FILE
    if not f.is_file():
        if (out_dir / records.TRIALS_FILE).is_file():
            raise ResumeError(f"{f}: missing ({records.TRIALS_FILE} is there: a run directory that lost it)")
        raise ResumeError(f"{out_dir}: not a run directory (no {SWEEP_FILE})")
    try:
        info = json.loads(f.read_bytes()[: 64 << 20].decode("utf-8"))
    except (ValueError, UnicodeDecodeError, RecursionError) as e:
        raise ResumeError(f"{f}: unreadable ({type(e).__name__}: {str(e)[:100]})") from None
    if not isinstance(info, dict):
        raise ResumeError(f"{f}: expected a JSON object, got {type(info).__name__}")
    for k, t in _SWEEP_KEYS.items():
        if not isinstance(info.get(k), t):
            raise ResumeError(f"{f}: field {k!r} missing or not a {t.__name__}")
    if not isinstance(info.get("parent_run_id"), str) and _recorded_parent(out_dir):
        raise ResumeError(f"{f}: field 'parent_run_id' missing, though {records.TRIALS_FILE} names the parent run")
    return info


def spec_lacks(info: dict) -> str | None:
    """What sweep.json's spec lacks of what every written spec holds, or None: a spec parsed without them takes
    the defaults, and a resume would run another sweep (checked where the spec is used: the resume, doctor)."""
    lacks = [k for k in _SPEC_KEYS if k not in info["spec"]]
    return f"its spec lacks {', '.join(map(repr, lacks))}" if lacks else None


def _recorded_parent(out_dir: Path) -> bool:
    """Whether the trial record holds a parent-run line (only read when sweep.json names no parent run)."""
    return records.parent(records.scan(out_dir / records.TRIALS_FILE)) is not None


def write_sweep(out_dir: Path, info: dict) -> None:
    atomic_write_text(out_dir / SWEEP_FILE, json.dumps(info, indent=1, default=list))


def told_states(journal: Path) -> dict[str, TrialState]:
    """{trial id: state} for every trial in the journal: "<cell_id>-<number>" (search), "<cell_id>-r<number>"
    (re-evaluations of the cell's winner)."""
    from orchestrator.search import Ask, journal_cells, open_journal

    storage = open_journal(journal)
    out = {}
    for cid, studies in journal_cells(storage).items():
        for stage, sid in studies.items():
            for t in storage.get_all_trials(sid, deepcopy=False):
                out[Ask(cid, t.number, {}, stage).trial_id] = t.state
    return out


def reconcile(client: MlflowClient, experiment_id: str, sweep_id: str, journal: Path) -> int:
    """Terminate child runs left RUNNING whose trial the journal has told; returns how many were fixed."""
    states = told_states(journal)
    fixed = 0
    for r in client.search_runs([experiment_id], f"tags.sweep_id = '{sweep_id}' and "
                                                 "tags.`healsweep.role` = 'trial' and attributes.status = 'RUNNING'",
                                max_results=50000):
        st = states.get(r.data.tags.get("trial_id", ""))
        if st is not None and st.name in STATUS:
            client.set_terminated(r.info.run_id, STATUS[st.name])
            fixed += 1
    return fixed


# ------------------------------------------------------------------------------------ one driver per run
LOCK_FILE = "driver.lock"


class RunLockedError(ResumeError):
    pass


def existing_sweep(out_dir: Path) -> ResumeError:
    return ResumeError(f"{out_dir} already holds a sweep: continue it with --resume {out_dir} or choose another --out")


def probe_run_dir(out_dir: Path, resume: bool) -> None:
    """``open_sweep``'s refusals, made early (before Ray starts) without creating or keeping anything: a new sweep
    over a directory that holds one (ResumeError), a directory another live driver holds (RunLockedError).
    ``lock_run_dir`` still decides when the sweep opens."""

    if not resume and (out_dir / JOURNAL_FILE).exists():
        raise existing_sweep(out_dir)
    holder = lock_holder(out_dir)
    if holder is not None:
        raise locked_error(out_dir, holder)


def lock_holder(out_dir: Path) -> str | None:
    """What DIR/driver.lock says of the live process holding it ("<pid>" for a sweep's driver, "<pid> doctor" for
    ``healsweep doctor --repair``), or None when no live process does (no lock file, or its holder died: the kernel
    dropped its flock). A probe: the flock taken here is dropped when the file closes."""
    try:
        f = open(Path(out_dir) / LOCK_FILE)  # noqa: SIM115 - closed below
    except OSError:  # no lock file (never run, or not a run directory), or unreadable
        return None
    with f:
        try:  # shared: works on a file opened for reading (NFS turns flock into a POSIX lock, whose exclusive kind
            fcntl.flock(f.fileno(), fcntl.LOCK_SH | fcntl.LOCK_NB)  # needs it open for writing) and still conflicts
        except BlockingIOError:  # with the holder's exclusive lock
            return f.read().strip()[:40] or "unknown"
        except OSError:  # a file system without locks: cannot tell (a repair's own lock_run_dir still decides)
            return None
    return None


def holder_words(holder: str) -> str:
    """``lock_holder``'s text in words: "a healsweep driver (pid N)" or "healsweep doctor --repair (pid N)"."""
    pid, _, role = holder.partition(" ")
    return f"healsweep doctor --repair (pid {pid})" if role == "doctor" else f"a healsweep driver (pid {pid})"


def locked_error(out_dir: Path, holder: str) -> RunLockedError:
    if holder.partition(" ")[2] == "doctor":
        return RunLockedError(f"{out_dir}: {holder_words(holder)} is repairing this run directory; wait for it to end")
    return RunLockedError(f"{out_dir}: another healsweep driver (pid {holder}) is running this sweep; "
                          "wait for it to end or stop it first")


def lock_run_dir(out_dir: Path, role: str = ""):
    """Hold DIR/driver.lock for this process's lifetime (one driver per run directory); returns the open file.

    An exclusive, non-blocking fcntl.flock: the kernel drops it when its holder dies, so a dead driver's lock is
    stale by construction and simply taken over (the file is rewritten with our pid, and ``role``: "doctor" for a
    repair, which no sweep may run beside). Another live holder is a RunLockedError naming it. Calling again in
    the same process returns the held lock.
    """

    key = str(Path(out_dir).resolve())
    if key in _HELD:
        return _HELD[key]
    out_dir.mkdir(parents=True, exist_ok=True)
    f = open(out_dir / LOCK_FILE, "a+")  # noqa: SIM115 - held until the process exits
    try:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.seek(0)
        holder = f.read().strip()[:40] or "unknown"
        f.close()
        raise locked_error(out_dir, holder) from None
    f.seek(0)
    f.truncate()
    f.write(f"{os.getpid()}{' ' + role if role else ''}\n")
    f.flush()
    _HELD[key] = f
    return f


_HELD: dict[str, object] = {}


def release_run_dir(out_dir: Path) -> None:
    """Give up this process's lock on ``out_dir`` (the driver is done with it)."""
    f = _HELD.pop(str(Path(out_dir).resolve()), None)
    if f is not None:
        f.close()


# --------------------------------------------------------------------------------- per-session totals
def record_dense(out_dir: Path, info: dict, session: int, images: int) -> int:
    """Record this session's dense forward images in sweep.json (right after the dense stage, so a later kill
    loses nothing) and return the sweep's total over every session."""
    per = {str(k): int(v) for k, v in (info.get("dense_forward_images") or {}).items()}
    per[str(session)] = int(images)
    info["dense_forward_images"] = per
    write_sweep(out_dir, info)
    return sum(per.values())


def record_complete(out_dir: Path, told: int) -> None:
    """Mark in sweep.json that the sweep ended with nothing left to run (no interruption, no fault, widening
    rounds done) when its journal had told ``told`` trials: ``run --resume`` of it then starts nothing
    (``lifecycle.resume.nothing_to_resume``). A later session that tells more trials (refine) outgrows it."""
    info = read_sweep(out_dir)
    info["complete"] = {"told": int(told)}
    write_sweep(out_dir, info)

