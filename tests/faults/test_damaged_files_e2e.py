"""Damaged files of a finished tiny sweep (copies of the session's one undamaged run): torn and damaged lines in
the Optuna journal and the trial record, a truncated and a garbage tracking database, a deleted and a damaged
store shard. Each ends in one line naming the file (and the repair command); after ``healsweep doctor DIR
--repair`` (where needed) ``healsweep run --resume DIR`` completes the sweep with every trial once and the
reference's numbers."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests.faults.helpers import (assert_complete, cli, copy_run, damage_line, ok, one_line, quoted, recorded,
                                  run_cli, tear_last_line, trial_runs)

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]


def test_torn_and_damaged_journal_lines(reference, tmp_path):
    run = copy_run(reference, tmp_path / "run")
    journal = run / "optuna.journal"
    damage_line(journal, 21)  # a middle line
    tear_last_line(journal)
    tear_last_line(run / "trials.jsonl")  # the last trial's record: that trial runs again
    torn_trial = sorted(set(reference["trials"]) - set(recorded_lenient(run)))
    assert len(torn_trial) == 1
    one_line(cli("run", "--resume", run), 2, str(journal), "line 21", f"healsweep doctor {run} --repair")
    r = cli("doctor", run)
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert f"{run / 'trials.jsonl'}: torn last line" in r.stdout and f"{journal}: line 21 damaged" in r.stdout
    ok(cli("doctor", run, "--repair"))
    ok(cli("doctor", run))
    r = ok(run_cli("run", "--resume", run, "--quiet"))
    assert "8 trials finished, 0 failed" in r.stdout
    assert_complete(run, reference)


def recorded_lenient(run):
    from orchestrator.rundir import records

    return records.trials(records.scan(run / "trials.jsonl"))


def test_torn_last_lines_alone_need_no_doctor(reference, tmp_path):
    """What a killed driver leaves: torn last lines are dropped by the resume itself, with a note each."""
    run = copy_run(reference, tmp_path / "run")
    journal = run / "optuna.journal"
    torn = b'{"op_code": 5, "worker_id": "w", "trial_id": 3, "sta'
    with open(journal, "ab") as f:
        f.write(torn)
    from orchestrator.lifecycle.resume import prepare_resume

    notes = []
    prepare_resume(run, notes.append)
    assert notes == [f"{journal}: dropped a torn last line ({len(torn)} bytes: a write cut short)"]
    from orchestrator.rundir.files import told_states

    assert {k: v.name for k, v in told_states(journal).items()} == reference["states"]


DB_FAULTS = {"truncated": "database disk image is malformed", "garbage": "file is not a database",
             "deleted": "missing",  # a table dropped: doctor said "no problem" (params, metrics), crashed
             # (experiments) or pointed at a repair that never repaired it (latest_metrics)
             **{f"no {t}": f"no such table: {t}" for t in ("experiments", "params", "metrics", "latest_metrics")}}


@pytest.mark.parametrize("damage", list(DB_FAULTS))
def test_damaged_tracking_database(reference, tmp_path, damage):
    run = copy_run(reference, tmp_path / "run")
    db, why = run / "mlflow.db", DB_FAULTS[damage]
    if damage == "truncated":
        with open(db, "rb+") as f:
            f.truncate(4096)
    elif damage == "garbage":
        db.write_bytes(bytes(range(256)) * 400)
    elif damage == "deleted":
        db.unlink()
    else:
        import sqlite3

        with sqlite3.connect(db) as con:
            con.execute(f"DROP TABLE {damage.split()[1]}")
    one_line(cli("report", run), 2, str(db), f"healsweep doctor {run} --repair")
    state = "is missing" if damage == "deleted" else f"is damaged ({why})"
    one_line(cli("run", "--resume", run), 2, f"{db} {state}: repair it with healsweep doctor {run} --repair")
    r = cli("doctor", run)
    assert r.returncode == 1 and f"{db}: damaged ({why}); lost: nothing recorded: 8 trial runs" in r.stdout
    ok(cli("doctor", run, "--repair"))
    assert damage == "deleted" or list(run.glob("mlflow.db.damaged-*"))  # a damaged file is kept aside
    ok(cli("report", run))
    assert quoted(run) == reference["quoted"]
    assert trial_runs(run) == recorded(run)
    if damage == "truncated":  # the resume of a rebuilt database: nothing runs again, nothing twice
        info = json.loads((run / "sweep.json").read_text())
        del info["complete"]  # through Ray and Tune, as a sweep from before the mark (else nothing starts)
        (run / "sweep.json").write_text(json.dumps(info))
        r = ok(run_cli("run", "--resume", run, "--quiet"))
        assert "8 trials finished, 0 failed" in r.stdout
        assert_complete(run, reference)


def test_deleted_and_damaged_shards(reference, tmp_path):
    run = copy_run(reference, tmp_path / "run", own_store=True)
    (key,) = json.loads((run / "targets.json").read_text())["keys"].values()
    kdir = tmp_path / "run-store" / "targets" / key
    (kdir / "shard-00001.arrow").unlink()
    data = bytearray((kdir / "shard-00002.arrow").read_bytes())
    data[len(data) // 2] ^= 0x40
    (kdir / "shard-00002.arrow").write_bytes(bytes(data))
    r = cli("doctor", run)
    assert r.returncode == 1
    lines = r.stdout.splitlines()
    assert any(ln.startswith(f"{kdir / 'shard-00001.arrow'}: target shard missing") and "rows 64-128" in ln
               for ln in lines), r.stdout
    assert any(ln.startswith(f"{kdir / 'shard-00002.arrow'}: target shard fails its sha256 check") for ln in lines)
    ok(cli("doctor", run, "--repair"))
    assert len(list((tmp_path / "run-store" / "targets" / ".quarantine").iterdir())) == 1  # the damaged one
    r = cli("doctor", run)  # both now missing: the resume recomputes exactly them
    assert r.returncode == 1 and sum(": target shard missing; lost: rows" in ln for ln in r.stdout.splitlines()) == 2
    r = ok(run_cli("run", "--resume", run, "--quiet"))
    assert "dense forward images 128" in r.stdout  # exactly the two lost shards, recomputed
    assert_complete(run, reference)
    ok(cli("doctor", run))


@pytest.mark.parametrize("damage", ["missing", "emptied"])
def test_a_sweep_from_before_the_record_gets_one(reference, tmp_path, damage):
    """No trials.jsonl (a sweep older than it), or one emptied since (it said "no problem found"; a resume then
    left it empty, and after a damaged database all 8 trials were lost): doctor writes it from the journal and
    MLflow, equal to the one the sweep wrote itself (Optuna side, and the run's params, metrics and history)."""
    run = copy_run(reference, tmp_path / "run")
    if damage == "missing":
        (run / "trials.jsonl").unlink()
    else:
        (run / "trials.jsonl").write_bytes(b"")
    r = cli("doctor", run)
    what = "missing (a sweep from before it)" if damage == "missing" else "holds none of the trials the journal tells"
    assert r.returncode == 1 and f"{run / 'trials.jsonl'}: {what}; 8 trials in the journal" in r.stdout, r.stdout
    ok(cli("doctor", run, "--repair"))
    from orchestrator.rundir import records

    got = records.trials(records.scan(run / "trials.jsonl"))
    want = records.trials(records.scan(reference["run"] / "trials.jsonl"))
    assert set(got) == set(want)
    for tid, rec in want.items():
        assert got[tid]["optuna"] == rec["optuna"]
        for k in ("run_id", "params", "metrics", "history", "status", "step"):
            assert got[tid]["mlflow"][k] == rec["mlflow"][k], (tid, k)
    ok(cli("doctor", run))


def test_a_resume_records_a_sweep_from_before_the_record_first(reference, tmp_path):
    """Resuming such a sweep writes its record before anything runs: the trials it told before are not taken
    for unrecorded ones (which would run again) by this resume or the next."""
    from orchestrator.tracking.rebuild import journal_disagrees
    from orchestrator.lifecycle.resume import prepare_resume

    run = copy_run(reference, tmp_path / "run")
    (run / "trials.jsonl").unlink()
    notes = []
    prepare_resume(run, notes.append)
    assert notes == [f"{run / 'trials.jsonl'}: written from the journal and MLflow (8 trials: a sweep from before it)"]
    assert recorded(run) == recorded(reference["run"])
    assert not journal_disagrees(run / "optuna.journal", recorded_lenient(run))
    (run / "trials.jsonl").write_bytes(b"")  # emptied since: recorded again, not left empty
    notes.clear()
    prepare_resume(run, notes.append)
    assert notes == [f"{run / 'trials.jsonl'}: written from the journal and MLflow (8 trials: it held none of the "
                     "trials the journal tells)"]
    assert recorded(run) == recorded(reference["run"])


def test_a_check_writes_nothing_in_a_copied_run(reference, tmp_path):
    """`doctor DIR` (no --repair) on a copied run directory reads its database where it now is: it rewrote the
    paths in sweep.json and mlflow.db (relocate), so a read-only copy ended the check in a traceback. Every file
    is byte-identical afterwards; `report` then relocates it as before."""
    run = copy_run(reference, tmp_path / "run")
    before = {p: p.read_bytes() for p in run.rglob("*") if p.is_file()}
    r = cli("doctor", run)
    assert r.returncode == 0 and r.stdout.strip().endswith("every file checked, no problem found")
    assert {p: p.read_bytes() for p in run.rglob("*") if p.is_file()} == before


def test_a_finished_sweep_resumes_without_starting_anything(reference, tmp_path):
    """`run --resume` of a sweep that ended complete started Ray (~10 s, minutes to attach a cluster) to run 0
    trials, and recomputed the dense pass when `store gc` had deleted its targets. It now checks its files, says
    there is nothing to resume, rewrites the report and prints a run's summary lines, exit 0; no session is added
    (sweep.json counts dense images per session) and the gc'ed key stays gone."""
    from orchestrator.lifecycle.resume import nothing_to_resume

    run = copy_run(reference, tmp_path / "run", own_store=True)
    assert json.loads((run / "sweep.json").read_text())["complete"] == {"told": 8}  # written by `healsweep run`
    (key,) = json.loads((run / "targets.json").read_text())["keys"].values()
    kdir = tmp_path / "run-store" / "targets" / key
    shutil.rmtree(kdir)  # what `healsweep store gc` leaves
    (run / "report.html").unlink()
    r = ok(run_cli("run", "--resume", run, "--quiet"))
    assert f"healsweep: {run}: the sweep ended complete and its files are unchanged since: nothing to resume" in r.stderr
    info = json.loads((run / "sweep.json").read_text())
    assert info["dense_forward_images"] == {"0": 256} and not kdir.exists()  # no second session, nothing computed
    assert r.stdout.splitlines()[:2] == [f"sweep {info['sweep_id']}: 8 trials finished, 0 failed, dense forward "
                                         f"images 0, {r.stdout.split(' s wall')[0].rsplit(' ', 1)[1]} s wall",
                                         f"mlflow: sqlite:///{run.resolve()}/mlflow.db"]  # relocated: its own store
    assert (run / "report.html").is_file() and quoted(run) == reference["quoted"]
    assert nothing_to_resume(run) == (8, 0)


def test_what_makes_a_finished_sweep_resume_as_usual(reference, tmp_path):
    """Anything changed since the end (a torn or damaged line, a trial recorded but not told, more trials told
    than at the end: a refine round, a target key present but not whole) sends the resume down its usual path,
    which settles it."""
    from orchestrator.lifecycle.resume import nothing_to_resume

    def fresh(name: str) -> Path:
        return copy_run(reference, tmp_path / name, own_store=True)

    assert nothing_to_resume(fresh("clean")) == (8, 0)
    tear_last_line((r := fresh("torn-journal")) / "optuna.journal")
    assert nothing_to_resume(r) is None
    tear_last_line((r := fresh("torn-record")) / "trials.jsonl")
    assert nothing_to_resume(r) is None
    r = fresh("more-told")
    info = json.loads((r / "sweep.json").read_text())
    (r / "sweep.json").write_text(json.dumps({**info, "complete": {"told": 7}}))
    assert nothing_to_resume(r) is None
    r = fresh("shard")
    (key,) = json.loads((r / "targets.json").read_text())["keys"].values()
    (tmp_path / "shard-store" / "targets" / key / "shard-00001.arrow").unlink()  # doctor --repair's quarantine
    assert nothing_to_resume(r) is None  # the resume recomputes it, as doctor says
    r = fresh("no-marker")
    info = json.loads((r / "sweep.json").read_text())
    del info["complete"]  # a sweep that ended before `healsweep run` wrote the mark
    (r / "sweep.json").write_text(json.dumps(info))
    assert nothing_to_resume(r) is None


def test_a_damaged_sweep_json_is_rebuilt(reference, tmp_path):
    """sweep.json was read first by every command, doctor --repair included: a damaged one stopped them all though
    the record, the database and the parent run's spec artifact hold all of it but the model cache."""
    run = copy_run(reference, tmp_path / "run")
    want = json.loads((run / "sweep.json").read_text())
    (run / "sweep.json").write_bytes(b'{"sweep_id": "90d7af6')  # cut short
    one_line(cli("report", run), 2, str(run / "sweep.json"))
    r = cli("doctor", run)
    assert r.returncode == 1 and r.stdout.startswith(f"{run.resolve() / 'sweep.json'}: damaged (unreadable")
    assert "lost: the model cache it named" in r.stdout
    ok(cli("doctor", run, "--repair"))
    got = json.loads((run / "sweep.json").read_text())
    same = ("sweep_id", "name", "experiment", "store", "spec", "dense_forward_images", "parent_run_id")
    assert {k: got[k] for k in same} == {k: want[k] for k in same}
    assert got["tracking_uri"] == f"sqlite:///{run.resolve()}/mlflow.db"
    assert (run / "sweep.json.damaged").read_bytes() == b'{"sweep_id": "90d7af6'
    ok(cli("report", run))
    assert quoted(run) == reference["quoted"]
    ok(cli("doctor", run))


def test_a_damaged_sweep_json_with_nothing_to_rebuild_it_from_is_one_line(reference, tmp_path):
    run = copy_run(reference, tmp_path / "run")
    (run / "sweep.json").write_text("[]")
    (run / "mlflow.db").unlink()
    one_line(cli("doctor", run, "--repair"), 2, f"{run / 'sweep.json'}: damaged (expected a JSON object, got list) "
             "and not rebuildable: the run directory's mlflow.db is missing")
    assert (run / "sweep.json").read_text() == "[]"


def test_a_journal_cut_in_half_is_not_told_as_a_torn_last_write(reference, tmp_path):
    """A journal truncated mid-file ends in a torn line too; doctor said only "torn last line (a write cut short)".
    It now says how many recorded trials the intact lines lack; a torn last write alone says nothing more."""
    run = copy_run(reference, tmp_path / "run")
    journal = run / "optuna.journal"
    data = journal.read_bytes()
    journal.write_bytes(data[: len(data) // 2])
    r = cli("doctor", run)
    assert r.returncode == 1 and f"{journal}: torn last line (" in r.stdout
    assert "its intact lines lack 8 recorded trial(s): more than that write was lost" in r.stdout, r.stdout
    ok(cli("doctor", run, "--repair"))
    ok(cli("doctor", run))
    from orchestrator.rundir.files import told_states

    assert {k: v.name for k, v in told_states(journal).items()} == reference["states"]  # rebuilt from the record
    run2 = copy_run(reference, tmp_path / "run2")
    tear_last_line(run2 / "optuna.journal")
    r = cli("doctor", run2)
    assert "torn last line (" in r.stdout and "intact lines lack" not in r.stdout, r.stdout


def test_repairs_are_counted_once_each(reference, tmp_path):
    """Two damaged record lines are two problems settled by one rewrite: the summary said "3 repair(s)" (the
    rewrite, its "already rewritten" echo, the journal); it counts what was done."""
    run = copy_run(reference, tmp_path / "run")
    damage_line(run / "trials.jsonl", 3)
    damage_line(run / "trials.jsonl", 5)
    r = cli("doctor", run, "--repair")
    assert r.returncode == 0 and "already rewritten" in r.stdout, r.stdout
    assert r.stdout.splitlines()[-1].startswith("2 repair(s), nothing left"), r.stdout


def test_a_damaged_record_line_says_which_trial_it_lost(reference, tmp_path):
    """A damaged line of a trial's record loses that trial (named, from the intact journal); a garbage line
    inserted between intact ones loses nothing, and doctor says so (it said "that line's trial result")."""
    run = copy_run(reference, tmp_path / "run")
    lines = (run / "trials.jsonl").read_bytes().split(b"\n")
    tid = json.loads(lines[4])["trial_id"]
    damage_line(run / "trials.jsonl", 5)
    r = cli("doctor", run)
    assert "line 5 damaged (" in r.stdout and f"lost: 1 trial result(s) ({tid}): they run again" in r.stdout, r.stdout
    run2 = copy_run(reference, tmp_path / "run2")
    lines = (run2 / "trials.jsonl").read_bytes().split(b"\n")
    (run2 / "trials.jsonl").write_bytes(b"\n".join([*lines[:3], b"#\x00garbage", *lines[3:]]))
    r = cli("doctor", run2)
    assert "line 4 damaged (" in r.stdout and "lost: nothing (every trial the journal tells" in r.stdout, r.stdout
    ok(cli("doctor", run2, "--repair"))
    assert recorded(run2) == recorded(reference["run"])


def test_lost_healed_weights_are_named_and_healed_again_on_request(reference, tmp_path):
    """A trial's saved weights deleted (its whole trials/<id>/) or cut short: the sweep's numbers were all there, so
    doctor said "no problem found" and a resume "nothing to resume" while `healsweep export` of those trials failed
    (a truncated file in a traceback). The resume now notes them and doctor names them; --repair alone keeps their
    recorded numbers; --repair --rerun-lost-weights drops their record lines and the resume heals exactly them
    again: the same seeds write the same weights, bit for bit, and the other trials' files are not touched. A trial
    whose line says its weights went elsewhere (a node without the run directory) is not judged."""
    from orchestrator.rundir import records

    assert {r.get("weights") for r in records.trials(records.scan(reference["run"] / "trials.jsonl")).values()} == \
        {"saved"}  # what the driver saw when it recorded each trial
    run = copy_run(reference, tmp_path / "run")
    gone, cut = reference["trials"][0], reference["trials"][3]
    shutil.rmtree(run / "trials" / gone)
    weights = run / "trials" / cut / "healed.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])
    others = {t: (run / "trials" / t / "healed.safetensors").stat().st_mtime_ns for t in reference["trials"]
              if t not in (gone, cut)}
    r = ok(run_cli("run", "--resume", run, "--quiet"))  # a sweep that ended complete: nothing runs, a note says why
    assert f"healsweep: note: {run / 'trials'}: 2 finished trial(s) without whole healed weights ({gone}, {cut}): " \
        f"their numbers stand, healsweep export of them fails; healsweep doctor {run} --repair --rerun-lost-weights" \
        in r.stderr, r.stderr
    r = cli("doctor", run)
    assert r.returncode == 1 and f"{run / 'trials'}: 2 finished trial(s) without whole healed weights ({gone}: its " \
        f"directory is missing; {cut}: healed.safetensors truncated (" in r.stdout, r.stdout
    hint = "(lost healed weights: --repair --rerun-lost-weights has the resume heal those trials again"
    assert f"1 problem(s); repair with healsweep doctor {run} --repair {hint}" in r.stdout, r.stdout
    before = (run / "trials.jsonl").read_bytes()
    r = cli("doctor", run, "--repair")  # their numbers are kept: nothing dropped without the flag
    assert r.returncode == 1 and "not repaired: " in r.stdout and (run / "trials.jsonl").read_bytes() == before
    assert f"0 repair(s), 1 problem(s) left {hint}" in r.stdout, r.stdout
    one_line(cli("doctor", run, "--rerun-lost-weights"), 2, "--rerun-lost-weights repairs: give --repair with it")
    r = ok(cli("doctor", run, "--repair", "--rerun-lost-weights"))
    assert "dropped 2 trial(s) from trials.jsonl and the journal" in r.stdout, r.stdout
    from orchestrator.rundir.files import told_states

    assert sorted(t for t, st in told_states(run / "optuna.journal").items() if st.is_finished()) == \
        sorted(set(reference["states"]) - {gone, cut})  # asked again, not told
    r = ok(run_cli("run", "--resume", run, "--quiet"))
    assert "8 trials finished, 0 failed" in r.stdout
    assert_complete(run, reference)
    for t in reference["trials"]:
        assert (run / "trials" / t / "healed.safetensors").read_bytes() == \
            (reference["run"] / "trials" / t / "healed.safetensors").read_bytes(), t
    assert {t: (run / "trials" / t / "healed.safetensors").stat().st_mtime_ns for t in others} == others
    ok(cli("doctor", run))

    run2 = copy_run(reference, tmp_path / "run2")  # weights saved on another node's disk: not the run directory's
    s = records.scan(run2 / "trials.jsonl")
    records.rewrite(run2 / "trials.jsonl", [{**r, "weights": "elsewhere"} if r.get("trial_id") == gone else r
                                            for r in s.records])
    shutil.rmtree(run2 / "trials" / gone)
    ok(cli("doctor", run2))


def test_every_trials_weights_lost_heals_the_whole_sweep_again(reference, tmp_path):
    """All of trials/ deleted: the repair left a record without trial lines, which the next pass wrote again from
    the journal (without the field), and the resume said "nothing to resume". The journal is now rebuilt first:
    every trial is asked again, and the resume heals the whole sweep, with the reference's numbers and weights."""
    run = copy_run(reference, tmp_path / "run")
    shutil.rmtree(run / "trials")
    r = ok(cli("doctor", run, "--repair", "--rerun-lost-weights"))
    assert "dropped 8 trial(s) from trials.jsonl and the journal" in r.stdout and "written from the journal" \
        not in r.stdout, r.stdout
    r = ok(run_cli("run", "--resume", run, "--quiet"))
    assert "8 trials finished, 0 failed" in r.stdout and "nothing to resume" not in r.stderr
    assert_complete(run, reference)
    for t in reference["trials"]:
        assert (run / "trials" / t / "healed.safetensors").read_bytes() == \
            (reference["run"] / "trials" / t / "healed.safetensors").read_bytes(), t
