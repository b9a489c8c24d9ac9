"""The trial record (orchestrator/rundir/records.py) and what is rebuilt from it, without Ray: checksummed lines, torn
and damaged lines told apart, an append on a full disk cut back and named in one line, the Optuna journal rebuilt
for every search design with the lost trials asked again exactly as before, a full tracking database named."""
from __future__ import annotations

import json
import shutil
import subprocess

import pytest

from orchestrator.rundir import faults
from orchestrator.rundir import records
from orchestrator.tracking.rebuild import journal_disagrees, rebuild_journal
from orchestrator.tracking.recorder import TrialRecorder
from orchestrator.rundir.files import told_states
from orchestrator.search import DESIGNS, make_searcher
from tasks.atomic import DiskFullError, atomic_write_bytes
from tests.faults.helpers import trial_line
from tests.orchestrator.test_search_contract import BUDGET, _cells, run

pytestmark = pytest.mark.timeout(120)


def test_lines_torn_and_damaged_are_told_apart(tmp_path):
    f = tmp_path / records.TRIALS_FILE
    for i in range(4):
        records.append(f, trial_line(f"c-{i}"))
    s = records.scan(f)
    assert s.clean and [r["trial_id"] for r in s.records] == ["c-0", "c-1", "c-2", "c-3"]
    lines = f.read_bytes().split(b"\n")
    lines[1] = lines[1].replace(b'"c-1"', b'"c-7"')  # a flipped digit: still JSON, the checksum catches it
    f.write_bytes(b"\n".join(lines)[:-40])  # and the last line torn
    s = records.scan(f)
    assert [r["trial_id"] for r in s.records] == ["c-0", "c-2"]
    assert [n for n, _ in s.damaged] == [2] and "checksum mismatch" in s.damaged[0][1]
    assert s.torn is not None and records.drop_torn(s) > 0
    records.rewrite(f, s.records)
    assert records.scan(f).clean and list(records.trials(records.scan(f))) == ["c-0", "c-2"]


@pytest.fixture
def small_fs(tmp_path):
    where = tmp_path / "fs"
    where.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(where)], capture_output=True)
    if r.returncode:
        pytest.skip("cannot mount a tmpfs here (needs root)")
    yield where
    subprocess.run(["umount", "-l", str(where)], check=False)


def test_a_line_with_a_good_checksum_and_another_shape_is_damaged(tmp_path):
    """A line that is checksummed JSON but not a record the resume can use (written by hand or another tool)
    is a damaged line naming what it lacks: it ended doctor and the resume in a KeyError."""
    f = tmp_path / records.TRIALS_FILE
    bad = [{"kind": "trial", "trial_id": "c-1", "cell_id": "c"}, {**trial_line("c-2"), "optuna": "x"},
           trial_line("c-3", state="RUNNING"), {**trial_line("c-4"), "mlflow": {"run_id": 7}}, {"kind": "note"}]
    for rec in [trial_line("c-0"), *bad, trial_line("c-5")]:
        records.append(f, rec)
    s = records.scan(f)
    assert list(records.trials(s)) == ["c-0", "c-5"] and [n for n, _ in s.damaged] == [2, 3, 4, 5, 6]
    assert [why for _, why in s.damaged] == [
        "a trial line without a valid 'optuna'", "a trial line without a valid 'optuna'",
        "a trial line with Optuna state 'RUNNING'", "a trial line's mlflow part without a valid 'run_id'",
        "a line of unknown kind 'note'"]
    assert journal_disagrees(tmp_path / "none.journal", records.trials(s)) == ["c-0", "c-5"]  # no KeyError


def test_blank_lines_are_neither_records_nor_torn_writes(tmp_path):
    """`echo >> trials.jsonl` made doctor say "torn last line (1 bytes: a write cut short); lost: that trial's
    result"; nothing was lost."""
    f = tmp_path / records.TRIALS_FILE
    for i in range(3):
        records.append(f, trial_line(f"c-{i}"))
    f.write_bytes(f.read_bytes().replace(b"\n", b"\n\n", 1) + b"  \n")
    s = records.scan(f)
    assert s.clean and list(records.trials(s)) == ["c-0", "c-1", "c-2"]
    records.append(f, trial_line("c-3"))
    assert list(records.trials(records.scan(f))) == ["c-0", "c-1", "c-2", "c-3"]


def test_full_disk_is_one_line_and_leaves_nothing_partial(small_fs):
    f = small_fs / records.TRIALS_FILE
    records.append(f, trial_line("c-0"))
    size = f.stat().st_size
    with pytest.raises(DiskFullError) as e:
        records.append(f, trial_line("c-1", blob="x" * (300 << 10)))
    assert str(e.value).startswith(f"no space left on device writing the trial record {f} (needed 300.")
    assert f.stat().st_size == size and records.scan(f).clean  # cut back: no torn line for the next append
    with pytest.raises(DiskFullError) as e:
        atomic_write_bytes(small_fs / "shard-00003.arrow", b"\0" * (400 << 10))
    assert f"writing a target-store shard {small_fs / 'shard-00003.arrow'} (needed 400.0 KiB, " in str(e.value)
    assert sorted(p.name for p in small_fs.iterdir()) == [records.TRIALS_FILE]  # its temporary file is gone
    assert faults.one_line(RuntimeError("a bug"), small_fs) is None  # not a fault at the edges: a traceback


def test_full_tracking_database_names_it(small_fs):
    """SQLite on a full disk (MLflow's 'database or disk is full'): one line naming the run's database."""
    import sqlite3

    db = small_fs / "mlflow.db"
    con = sqlite3.connect(db)
    con.execute("CREATE TABLE metrics (v BLOB)")
    with pytest.raises(sqlite3.OperationalError) as e:
        for _ in range(1000):
            con.execute("INSERT INTO metrics VALUES (?)", (b"\0" * 4096,))
            con.commit()
    con.close()
    wrapped = RuntimeError("API request failed")
    wrapped.__cause__ = e.value
    msg, code = faults.one_line(wrapped, small_fs)
    assert code == 1 and msg.startswith(f"no space left on device writing the MLflow tracking database {db} (")
    assert "free there); free space there, then continue with healsweep run --resume" in msg
    again = f"run healsweep doctor {small_fs} --repair again"  # a repair that met the full disk: the repair again
    assert faults.one_line(wrapped, small_fs, again)[0].endswith(f"free there); free space there, then {again}")


def test_what_fails_after_the_fault_that_stopped_the_sweep_gives_way_to_it(tmp_path):
    """The report written after a full disk stopped the trials meets the same full disk: the command's line names
    the first write that failed (the stopped fault), not the report (orchestrator/commands/run.py)."""
    first = DiskFullError(tmp_path / "run" / "tune" / "trial_0", 1 << 20, "a trial's Tune checkpoint")
    later = DiskFullError(tmp_path / "run" / "report.html", 160 << 10)
    faults.clear()
    try:
        assert not faults.follows_fault(later)  # nothing stopped the sweep: the error is the command's own
        faults.stop(first)
        faults.stop(later)  # a second fault does not replace the first
        assert faults.follows_fault(later) and not faults.follows_fault(first)
        with pytest.raises(DiskFullError) as raised:
            faults.raise_stopped()
        assert raised.value is first and faults.stopped() is None
        msg, code = faults.one_line(raised.value, tmp_path / "run")
        assert code == 1 and msg.startswith(f"no space left on device writing a trial's Tune checkpoint {first.path} (")
    finally:
        faults.clear()


def _record_all(design: str, journal):
    searcher = make_searcher(_cells(3), {c["cell_id"]: BUDGET for c in _cells(3)}, design, 7, journal)
    searcher.record = TrialRecorder(journal.parent, searcher.design, lambda: None, lambda key: None, lambda: None)
    return {c["trial_id"]: c for c in run(searcher)}


@pytest.mark.parametrize("design", sorted(DESIGNS.names()))
def test_journal_rebuilt_from_the_record_asks_lost_trials_again_alike(tmp_path, design):
    journal = tmp_path / "optuna.journal"
    asked = _record_all(design, journal)
    s = records.scan(tmp_path / records.TRIALS_FILE)
    trials = records.trials(s)
    assert s.clean and set(trials) == set(asked) and all(r["mlflow"] is None for r in trials.values())
    assert {k: v.name for k, v in told_states(journal).items()} == {k: r["optuna"]["state"] for k, r in trials.items()}
    lost = sorted(t for t in trials if t.endswith("-0"))[0]  # a first search trial: later ones keep their numbers
    del trials[lost]
    shutil.copy(journal, tmp_path / "old.journal")
    journal.write_bytes(b"garbage\n")  # the journal lost entirely: the record alone
    assert rebuild_journal(journal, trials) == {"told": len(trials), "asked": 1}
    assert not journal_disagrees(journal, trials)
    again = make_searcher(_cells(3), {c["cell_id"]: BUDGET for c in _cells(3)}, design, 7, journal)
    assert again.rerun == [lost] and again.already_done == len(trials)
    cfg = again.suggest("x")
    assert cfg["trial_id"] == lost and BUDGET.lr[0] <= cfg["lr"] <= BUDGET.lr[1] and 4 <= cfg["steps"] <= 64
    if design != "tpe":  # TPE draws from its history, which holds every other trial now: a fresh draw there
        assert {k: cfg[k] for k in ("lr", "steps")} == {k: asked[lost][k] for k in ("lr", "steps")}
    json.dumps(cfg)  # a plain config, as Tune needs it


def test_a_file_the_command_cannot_write_is_one_line(tmp_path):
    """A read-only run directory (a read-only mount, an immutable file, another user's files) ended report,
    doctor and resume in a traceback: one line naming the file and what to do, exit 1. SQLite's own wording for
    a read-only database is met for real; the OS's PermissionError is the one open() raises for EACCES."""
    import errno
    import sqlite3

    db = tmp_path / "mlflow.db"
    sqlite3.connect(db).execute("CREATE TABLE runs (v)").connection.close()
    with pytest.raises(sqlite3.OperationalError) as e:
        sqlite3.connect(f"file:{db}?mode=ro", uri=True).execute("INSERT INTO runs VALUES (1)")
    msg, code = faults.one_line(e.value, tmp_path)
    assert code == 1 and msg == (f"cannot write {db}: it is read-only; make {tmp_path} and its files writable (or "
                                 "copy it somewhere writable), then run the command again")
    for no, why in ((errno.EACCES, "Permission denied"), (errno.EROFS, "Read-only file system")):
        err = PermissionError(no, why, str(tmp_path / "optuna.journal")) if no == errno.EACCES else \
            OSError(no, why, str(tmp_path / "driver.lock"))
        msg, code = faults.one_line(err, tmp_path)
        assert code == 1 and msg.startswith(f"cannot write {err.filename}: {why} ({errno.errorcode[no]}); make ")


def test_the_parent_line_is_written_once_the_parent_run_can_be_read(tmp_path):
    """The first trial's record asks MLflow for the parent run's line; when that read fails (the run not there yet,
    a tracking server's hiccup) the next trial's record tries again: it was marked done, so no parent line was ever
    written and a rebuild named the parent after the spec."""
    from mlflow import MlflowClient

    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    parent = client.create_run(client.create_experiment("e")).info.run_id
    ids = iter(["0" * 32, parent, parent])  # the first read: no such run
    journal = tmp_path / "optuna.journal"
    searcher = make_searcher(_cells(3), {c["cell_id"]: BUDGET for c in _cells(3)}, "grid", 7, journal)
    searcher.record = TrialRecorder(tmp_path, searcher.design, lambda: client, lambda key: None,
                                    lambda: next(ids, parent))
    run(searcher)
    s = records.scan(tmp_path / records.TRIALS_FILE)
    kinds = [r["kind"] for r in s.records]
    assert kinds.count(records.PARENT) == 1 and kinds.index(records.PARENT) == 1  # after the first trial's line
    assert records.parent(s)["run_id"] == parent


def test_parent_gone_is_only_a_run_that_does_not_exist(tmp_path, monkeypatch):
    """``parent_gone`` says "missing" (a new parent run is opened, every trial run re-pointed) only for MLflow's
    RESOURCE_DOES_NOT_EXIST; a tracking server that answers 503 is an error, not a missing parent."""
    import http.server
    import threading

    from mlflow import MlflowClient
    from mlflow.exceptions import MlflowException

    from orchestrator.tracking.rebuild import parent_gone

    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    run = client.create_run(client.create_experiment("e")).info.run_id
    assert parent_gone(client, run) is None and parent_gone(client, "0" * 32) == "missing"
    client.delete_run(run)
    assert parent_gone(client, run) == "deleted"

    class Busy(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(503)
            self.end_headers()

        def log_message(self, *a):
            pass

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Busy)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    try:
        with pytest.raises(MlflowException) as e:
            parent_gone(MlflowClient(f"http://127.0.0.1:{srv.server_address[1]}"), run)
        assert e.value.error_code != "RESOURCE_DOES_NOT_EXIST"
    finally:
        srv.shutdown()


def test_first_line_of_any_error_message():
    """The one-line cause every user-facing error quotes: ``str(e).splitlines()[0]`` raised IndexError (inside the
    very ``except``) for an exception with an empty message, and quoted a blank first line."""
    from tasks.errors import first_line

    assert first_line(OSError()) == "OSError" and first_line(ValueError("  \n")) == "ValueError"
    assert first_line(ValueError("\n  header too large  \nat byte 8")) == "header too large"
    assert first_line(RuntimeError("x" * 300), 120) == "x" * 120
