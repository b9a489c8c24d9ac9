"""The files of a run directory, checked: the SQLite tracking database, the Optuna journal, the trial record and
leftover temporary files; and what ``healsweep run --resume`` does with them before it opens the sweep.

``prepare_resume``: a damaged tracking database, journal line or record line (anything but the last line) stops
the resume with one line naming the file and ``healsweep doctor DIR --repair``; a torn last line (a write cut
short by a kill or a full disk) is dropped with a note (a torn record's trial runs again); a journal that
disagrees with the record (a trial recorded but not told: the driver died between the two) is rebuilt from the
record (orchestrator/tracking/rebuild.py).
"""
from __future__ import annotations

import sqlite3
import sys
from pathlib import Path

from orchestrator.lifecycle.store_check import targets_gap
from orchestrator.rundir import records
from orchestrator.rundir.faults import damaged
from orchestrator.rundir.files import JOURNAL_FILE, SWEEP_FILE, read_sweep, spec_lacks, told_states
from orchestrator.tracking.rebuild import journal_disagrees, parent_gone, rebuild_journal, runs_off, stray_parents
from orchestrator.tracking.recorder import backfill
from orchestrator.tracking.store import local_tracking_uri, own_db, relocate  # noqa: F401 - own_db: resume's face
from tasks.atomic import TMP_PREFIX
from tasks.saved_trial import healed_problem, trial_dir
from tasks.errors import first_line

DB_FILE = "mlflow.db"
# The tables (and their columns, stable across MLflow's schema versions) that a sweep's runs live in
MLFLOW_TABLES = {"experiments": "experiment_id, name, lifecycle_stage", "runs": "run_uuid, status, experiment_id",
                 "tags": "key, value, run_uuid", "params": "key, value, run_uuid",
                 "metrics": "key, value, timestamp, run_uuid, step", "latest_metrics": "key, value, run_uuid, step"}


def db_problem(db: Path) -> str | None:
    """Why an SQLite tracking database cannot be used (``PRAGMA integrity_check``, MLflow's tables), or None."""
    if not db.is_file():
        return None
    try:
        con = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
        try:
            rows = con.execute("PRAGMA integrity_check").fetchall()
            if rows == [("ok",)]:
                for table, cols in MLFLOW_TABLES.items():  # a table dropped (or recreated by MLflow without
                    con.execute(f"SELECT {cols} FROM {table} LIMIT 0").fetchall()  # its columns): damaged
        finally:
            con.close()
    except sqlite3.Error as e:
        return first_line(e, 160)
    if rows != [("ok",)]:
        return "integrity check: " + "; ".join(str(r[0]) for r in rows[:2])[:160]
    return None


def tracking_gap(out_dir: Path, info: dict, trials: dict[str, dict]) -> bool:
    """Whether the sweep's own tracking database lacks what the record holds: its parent run, or a recorded
    trial's one run in its recorded status (``sync_record`` on the usual resume path settles both), or holds a
    stray parent run (``parent_run`` deletes it there). A tracking server or a shared database is not checked
    here."""
    if not own_db(out_dir, info):
        return False
    db = Path(out_dir) / DB_FILE
    if not db.is_file() or db_problem(db):
        return True
    from mlflow import MlflowClient

    client = MlflowClient(local_tracking_uri(out_dir))
    exp = client.get_experiment_by_name(info.get("experiment") or "healsweep")
    if not info.get("parent_run_id") or parent_gone(client, info["parent_run_id"]):
        return True
    exp_id = exp.experiment_id if exp else None
    return bool(runs_off(client, exp_id, info["sweep_id"], trials)
                or stray_parents(client, exp_id, info["sweep_id"], info["parent_run_id"]))


def journal_problem(journal: Path) -> str | None:
    """Why the journal's intact lines do not replay in Optuna, or None."""
    if not journal.exists():
        return None
    try:
        told_states(journal)
    except Exception as e:  # noqa: BLE001 - whatever Optuna raises on a journal it cannot replay
        return f"does not replay ({type(e).__name__}: {str(e)[:100]})"
    return None


def damaged_lines(s: records.Scan) -> str:
    (n, why), more = s.damaged[0], len(s.damaged) - 1
    return f"line {n}: {why}" + (f"; and {more} more line(s)" if more else "")


def temp_files(*roots: Path) -> list[Path]:
    """Leftover temporary files (``.tmp-*``: a write that did not finish) under ``roots``."""
    out: list[Path] = []
    for root in roots:
        if root.is_dir():
            out += [p for p in root.rglob(f"{TMP_PREFIX}*") if p.is_file() and not p.is_symlink()]
    return sorted(set(out))


def note(text: str) -> None:
    print(f"healsweep: note: {text}", file=sys.stderr)


def check_resumable(out_dir: Path) -> None:
    """The refusals of ``prepare_resume`` only (nothing is changed): DamagedFileError, one line."""

    out_dir = Path(out_dir)
    info = read_sweep(out_dir)
    if (lacks := spec_lacks(info)) is not None:
        raise damaged(out_dir / SWEEP_FILE, lacks, out_dir)
    why = db_problem(out_dir / DB_FILE) or ("missing" if own_db(out_dir, info) and info.get("parent_run_id")
                                             and not (out_dir / DB_FILE).exists() else None)
    if why:
        raise damaged(out_dir / DB_FILE, why, out_dir)
    for name, check in ((JOURNAL_FILE, records.check_json), (records.TRIALS_FILE, records.check_record)):
        s = records.scan(out_dir / name, check)
        if s.damaged:
            raise damaged(out_dir / name, damaged_lines(s), out_dir)


def prepare_resume(out_dir: Path, say=note) -> dict[str, dict]:
    """Check the run directory's files and settle torn last lines and the journal against the record; -> the
    recorded trials (``records.trials``)."""

    out_dir = Path(out_dir)
    check_resumable(out_dir)
    journal = out_dir / JOURNAL_FILE
    js = records.scan(journal, records.check_json)
    if js.torn is not None:
        say(f"{journal}: dropped a torn last line ({records.drop_torn(js)} bytes: a write cut short)")
    rs = records.scan(out_dir / records.TRIALS_FILE)
    if rs.torn is not None:
        say(f"{rs.path}: dropped a torn last record ({records.drop_torn(rs)} bytes: a write cut short); its trial "
            "runs again")
    why = journal_problem(journal)
    if rs.clean and not records.trials(rs) and not why and journal.exists():
        _backfill(out_dir, say, rs.path.exists())  # a sweep from before trials.jsonl (or a record emptied since):
        # recorded before it runs on, else the trials the journal tells would be done and recorded nowhere
        rs = records.scan(rs.path)
    trials = records.trials(rs)
    if why and not rs.records:
        raise damaged(journal, why, out_dir)
    if rs.records and (why or journal_disagrees(journal, trials)):
        c = rebuild_journal(journal, trials)
        say(f"{journal}: rebuilt from {records.TRIALS_FILE} ({c['told']} trials told, {c['asked']} to run again)")
    return trials


def weights_note(out_dir: Path, trials: dict[str, dict] | None = None) -> str | None:
    """A note on recorded trials whose healed weights are lost since (``lost_weights``; a resume leaves them: the
    record, which holds their numbers, is the truth), or None. ``trials``: the record's, when already read."""
    if trials is None:
        trials = records.trials(records.scan(Path(out_dir) / records.TRIALS_FILE))
    gone = lost_weights(out_dir, trials)
    if not gone:
        return None
    named = ", ".join(list(gone)[:4]) + (", ..." if len(gone) > 4 else "")
    return (f"{Path(out_dir) / 'trials'}: {len(gone)} finished trial(s) without whole healed weights ({named}): "
            f"their numbers stand, healsweep export of them fails; healsweep doctor {out_dir} --repair "
            f"--rerun-lost-weights has the next resume heal them again")


def nothing_to_resume(out_dir: Path) -> tuple[int, int] | None:
    """(finished, failed) when the sweep of ``out_dir`` ended complete (sweep.json's ``complete``, written by
    ``healsweep run`` after its last trial and widening round) and nothing changed since: both files whole, the
    journal's told trials exactly those the record holds and as many as at the end, its local target keys whole or
    gone (``store_check.targets_gap``). None otherwise: the resume runs as usual (what is left, or 0 trials)."""
    out_dir = Path(out_dir)
    info = read_sweep(out_dir)
    done = info.get("complete")
    journal = out_dir / JOURNAL_FILE
    js, rs = records.scan(journal, records.check_json), records.scan(out_dir / records.TRIALS_FILE)
    if not isinstance(done, dict) or not js.clean or not rs.clean or not rs.path.exists():
        return None
    try:
        told = told_states(journal)
    except Exception:  # noqa: BLE001 - lines Optuna cannot replay: the usual resume names them (check_resumable)
        return None
    states = [st for st in told.values() if st.is_finished()]
    trials = records.trials(rs)
    if len(states) != done.get("told") or len(trials) != len(states) or journal_disagrees(journal, trials, told):
        return None
    if targets_gap(out_dir, info):  # a shard doctor moved aside: the resume recomputes it, as doctor says
        return None
    if tracking_gap(out_dir, info, trials):  # runs lost or left RUNNING: the usual resume recreates them
        return None
    failed = sum(st.name == "FAIL" for st in states)
    return len(states) - failed, failed


def told_count(journal: Path) -> int:
    """Trials the journal has told (finished, failed or pruned); a trial only asked (RUNNING when the sweep was
    interrupted) is not one: a new sweep stopped before its first result has no record yet and lacks nothing."""
    return sum(st.is_finished() for st in told_states(journal).values())


def _backfill(out_dir: Path, say, emptied: bool = False) -> None:
    """The record of a sweep from before trials.jsonl (``emptied``: a record that holds no trial line), written
    from its journal and MLflow (without it, the trials told before would count as unrecorded and run again on the
    next resume, or, with the journal left as it is, be recorded nowhere)."""

    if not told_count(out_dir / JOURNAL_FILE):  # none told: nothing to record (a sweep interrupted before its first)
        return
    from mlflow import MlflowClient

    relocate(out_dir)
    info = read_sweep(out_dir)
    n = backfill(out_dir, MlflowClient(info["tracking_uri"]), info.get("experiment") or "healsweep",
                 info["sweep_id"], info.get("parent_run_id"))
    why = "it held none of the trials the journal tells" if emptied else "a sweep from before it"
    say(f"{out_dir / records.TRIALS_FILE}: written from the journal and MLflow ({n} trials: {why})")


def lost_weights(run_dir: Path, trials: dict[str, dict]) -> dict[str, str]:
    """{trial id: why} for recorded trials whose healed weights were whole in the run directory when the trial was
    recorded (its line's ``weights``: "saved"; tracking/recorder.py) and are not now (tasks/saved_trial.py
    ``healed_problem``). Trials that saved theirs elsewhere (a node without the run directory), lines from before
    the field, and a trial directory that is a symlink (weights moved to another disk) are not judged."""
    out = {}
    for tid, rec in sorted(trials.items()):
        if rec.get("weights") != "saved":
            continue
        try:
            why = healed_problem(trial_dir(run_dir, tid))
        except (ValueError, RuntimeError):  # resolves outside trials/ (a symlink), or a symlink loop
            continue
        if why:
            out[tid] = why
    return out
