"""What a finished sweep's run directory holds beyond its line files, damaged and put right (copies of the session's
one undamaged run): a sweep.json missing a field a resume needs, a tracking database that lost a trial's run or
holds it RUNNING, a parent run deleted or gone. Each is named by doctor and by the complete-sweep check, and
repaired by ``doctor --repair`` or the usual resume, with every trial once and the reference's numbers."""
from __future__ import annotations

import json

import pytest

from tests.faults.helpers import cli, copy_run, ok, one_line, quoted, recorded, run_cli, trial_runs

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]


@pytest.mark.parametrize("damage", ["spec lacks search", "no parent_run_id"])
def test_a_sweep_json_missing_a_field_is_refused_and_rebuilt(reference, tmp_path, damage):
    """A readable sweep.json without the spec's search (a resume parsed the defaults and ran 16 trials of another
    search) or without parent_run_id while the record names the parent (a resume opened a second parent run):
    the resume refuses in one line, doctor rebuilds it keeping its model cache, and the resume then starts
    nothing."""
    from orchestrator.lifecycle.resume import nothing_to_resume

    run = copy_run(reference, tmp_path / "run")
    info = json.loads((run / "sweep.json").read_text())
    if damage == "spec lacks search":
        del info["spec"]["search"]
        why = "its spec lacks 'search'"
    else:
        del info["parent_run_id"]
        why = "field 'parent_run_id' missing, though trials.jsonl names the parent run"
    (run / "sweep.json").write_text(json.dumps(info))
    one_line(cli("run", "--resume", run), 2, "sweep.json", why)
    r = cli("doctor", run)
    assert r.returncode == 1 and f"sweep.json: damaged ({why}); lost: nothing (its model cache" in r.stdout, r.stdout
    ok(cli("doctor", run, "--repair"))
    got = json.loads((run / "sweep.json").read_text())
    assert got["spec"] == reference_info(reference)["spec"] and got["cache"] == info["cache"]
    assert got["parent_run_id"] == reference_info(reference)["parent_run_id"]
    assert nothing_to_resume(run) == (8, 0)


def test_a_deleted_sweep_json_is_named_and_rebuilt(reference, tmp_path):
    """A run directory whose sweep.json was deleted (its trials.jsonl still there) was "not a run directory" to
    resume, report and doctor alike, and doctor never rebuilt it (an empty one it did): now each names the repair,
    and doctor --repair rebuilds it as for an unreadable one; the sweep is complete again."""
    from orchestrator.lifecycle.resume import nothing_to_resume

    run = copy_run(reference, tmp_path / "run")
    (run / "sweep.json").unlink()
    repair = f"rebuild it with healsweep doctor {run} --repair"
    one_line(cli("run", "--resume", run), 2, "sweep.json: missing (trials.jsonl is there", repair)
    one_line(cli("report", run), 2, "sweep.json: missing", repair)
    r = cli("doctor", run)
    assert r.returncode == 1 and "sweep.json: damaged (missing); lost: the model cache it named" in r.stdout, r.stdout
    r = ok(cli("doctor", run, "--repair", "--cache", tmp_path / "models"))  # the cache it names: not recorded elsewhere
    assert "rebuilt from trials.jsonl, mlflow.db and the parent run's spec.json\n" in r.stdout, r.stdout
    got, ref = json.loads((run / "sweep.json").read_text()), reference_info(reference)
    assert got["cache"] == str((tmp_path / "models").resolve())
    assert {k: v for k, v in got.items() if k not in ("tracking_uri", "cache")} == \
        {k: v for k, v in ref.items() if k not in ("tracking_uri", "cache")}
    assert nothing_to_resume(run) == (8, 0) and not (run / "sweep.json.damaged").exists()
    # after a database rebuild (a new parent run id; the record keeps the old one): found by its tags, its spec
    # copied with it (the copy looked for an artifacts layout the run directory does not have: a traceback)
    (run / "mlflow.db").write_bytes((run / "mlflow.db").read_bytes()[:4096])
    ok(cli("doctor", run, "--repair"))
    (run / "sweep.json").unlink()
    ok(cli("doctor", run, "--repair"))
    assert json.loads((run / "sweep.json").read_text())["spec"] == ref["spec"] and nothing_to_resume(run) == (8, 0)


def reference_info(reference):
    return json.loads((reference["run"] / "sweep.json").read_text())


@pytest.mark.parametrize("damage", ["run deleted", "run left RUNNING"])
def test_a_complete_sweep_missing_a_run_resumes_the_usual_way(reference, tmp_path, damage):
    """A finished sweep whose database lost a trial's run (or holds it RUNNING: a driver killed after the record)
    was 'nothing to resume' with 7 runs left; the check now sees it, doctor --repair recreates (or ends) the run
    and the sweep is complete again."""
    from mlflow import MlflowClient

    from orchestrator.lifecycle.resume import nothing_to_resume

    run = copy_run(reference, tmp_path / "run")
    assert nothing_to_resume(run) == (8, 0)
    client = MlflowClient(f"sqlite:///{run.resolve()}/mlflow.db")
    victim = sorted(trial_runs(run))[3]
    run_id = next(r.info.run_id for r in client.search_runs(
        [client.get_experiment_by_name("healsweep").experiment_id], f"tags.trial_id = '{victim}'"))
    if damage == "run deleted":
        client.delete_run(run_id)
    else:
        client.update_run(run_id, status="RUNNING")
    assert nothing_to_resume(run) is None
    r = cli("doctor", run)
    assert r.returncode == 1 and f"1 recorded trial(s) without their one MLflow run in its recorded status ({victim})" \
        in r.stdout, r.stdout
    r = ok(cli("doctor", run, "--repair"))
    assert ("1 run(s) recreated" if damage == "run deleted" else "1 set to their recorded status") in r.stdout
    assert nothing_to_resume(run) == (8, 0) and trial_runs(run) == recorded(run)


def _drop_run_rows(db, run_id: str) -> None:
    import sqlite3

    with sqlite3.connect(db) as con:
        for table in ("tags", "params", "metrics", "latest_metrics", "runs"):
            con.execute(f"DELETE FROM {table} WHERE run_uuid = ?", (run_id,))


@pytest.mark.parametrize("damage", ["deleted", "missing"])
def test_a_parent_run_deleted_or_gone_comes_back(reference, tmp_path, damage):
    """The parent run's rows deleted: doctor said no problem, report said "parent run ... is not in", and the
    resume of an unfinished sweep ended in MLflow's "Run ... not found" traceback. Doctor restores a deleted one
    and recreates a missing one from the record (a complete sweep's FINISHED), pointing the trial runs at it; the
    usual resume does the same before it reopens it."""
    from mlflow import MlflowClient

    from orchestrator.lifecycle.resume import nothing_to_resume

    def gone(run):
        client = MlflowClient(f"sqlite:///{run.resolve()}/mlflow.db")
        parent = json.loads((run / "sweep.json").read_text())["parent_run_id"]
        if damage == "deleted":
            client.delete_run(parent)
        else:
            _drop_run_rows(run / "mlflow.db", parent)
        return client, parent

    run = copy_run(reference, tmp_path / "run")
    client, parent = gone(run)
    assert nothing_to_resume(run) is None
    r = cli("doctor", run)
    assert r.returncode == 1 and f"the sweep's parent run {parent} is {damage}" in r.stdout, r.stdout
    ok(cli("doctor", run, "--repair"))
    info = json.loads((run / "sweep.json").read_text())
    assert (info["parent_run_id"] == parent) == (damage == "deleted")
    p = client.get_run(info["parent_run_id"])
    assert p.info.status == "FINISHED" and p.info.lifecycle_stage == "active"
    kids = client.search_runs([p.info.experiment_id], "tags.`healsweep.role` = 'trial'")
    assert {k.data.tags["mlflow.parentRunId"] for k in kids} == {info["parent_run_id"]}
    assert nothing_to_resume(run) == (8, 0)
    ok(cli("report", run))
    assert quoted(run) == reference["quoted"]
    if damage == "missing":  # an unfinished sweep: the usual resume recreates it before reopening it
        run2 = copy_run(reference, tmp_path / "run2")
        info = json.loads((run2 / "sweep.json").read_text())
        del info["complete"]
        (run2 / "sweep.json").write_text(json.dumps(info))
        _, parent = gone(run2)
        r = ok(run_cli("run", "--resume", run2, "--quiet"))
        assert f"parent run {parent} recreated from trials.jsonl as " in r.stderr and "Traceback" not in r.stderr
        assert trial_runs(run2) == recorded(run2) and quoted(run2) == reference["quoted"]


def test_a_stray_parent_run_is_deleted(reference, tmp_path):
    """A second parent run of the sweep (a driver killed between creating its parent run and writing the id to
    sweep.json, or a database rebuild cut short): doctor said no problem and the report read whichever parent it
    found first. Doctor names it and deletes it, pointing a trial run under it at the sweep's own; a resume does
    the same with a note, also for a sweep that ended complete (it goes the usual way and runs nothing)."""
    from mlflow import MlflowClient

    from orchestrator.lifecycle.resume import nothing_to_resume

    def stray(run):
        client = MlflowClient(f"sqlite:///{run.resolve()}/mlflow.db")
        exp_id = client.get_experiment_by_name("healsweep").experiment_id
        info = json.loads((run / "sweep.json").read_text())
        s = client.create_run(exp_id, run_name="stray", tags={"sweep_id": info["sweep_id"],
                                                               "healsweep.role": "sweep"}).info.run_id
        kid = client.search_runs([exp_id], "tags.`healsweep.role` = 'trial'")[2].info.run_id
        client.set_tag(kid, "mlflow.parentRunId", s)
        return client, exp_id, info["parent_run_id"], s

    def settled(client, exp_id, parent):
        sweeps = client.search_runs([exp_id], "tags.`healsweep.role` = 'sweep'")
        kids = client.search_runs([exp_id], "tags.`healsweep.role` = 'trial'")
        return [r.info.run_id for r in sweeps] == [parent] and {k.data.tags["mlflow.parentRunId"] for k in kids} == \
            {parent}

    from analysis.runs import load_sweep_info

    run = copy_run(reference, tmp_path / "run")
    client, exp_id, parent, s = stray(run)
    assert nothing_to_resume(run) is None
    uri, sweep_id = f"sqlite:///{run.resolve()}/mlflow.db", json.loads((run / "sweep.json").read_text())["sweep_id"]
    assert load_sweep_info(uri, sweep_id, parent_run_id=parent)["run_id"] == parent  # the report's, until deleted
    assert load_sweep_info(uri, sweep_id, parent_run_id=s)["run_id"] == s
    r = cli("doctor", run)
    assert r.returncode == 1 and f"1 stray parent run(s) of the sweep besides its own {parent} ({s}: " in r.stdout, \
        r.stdout
    r = ok(cli("doctor", run, "--repair"))
    assert "deleted 1 stray parent run(s)" in r.stdout
    assert settled(client, exp_id, parent) and client.get_run(s).info.lifecycle_stage == "deleted"
    assert nothing_to_resume(run) == (8, 0)
    ok(cli("report", run))
    assert quoted(run) == reference["quoted"]
    run2 = copy_run(reference, tmp_path / "run2")
    client, exp_id, parent, s = stray(run2)
    r = ok(run_cli("run", "--resume", run2, "--quiet"))
    assert "healsweep: note: deleted 1 stray parent run(s) of sweep" in r.stderr and "8 trials finished, 0 failed" \
        in r.stdout, r.stderr
    assert settled(client, exp_id, parent) and trial_runs(run2) == recorded(run2)
    assert quoted(run2) == reference["quoted"]


def test_a_database_rebuild_cut_short_is_finished_by_the_next_repair(reference, tmp_path, monkeypatch):
    """doctor --repair killed while it rebuilt a damaged database (here: after 3 of 8 trial runs): the rebuild is
    made beside the database and moved into place only when whole, so the damaged database is still there, as it
    was, and no half-built one (a full disk there left a database that every later command failed on); the next
    doctor rebuilds it whole; the report quotes the reference's numbers."""
    from mlflow import MlflowClient

    from orchestrator.rundir import records
    from orchestrator.rundir.files import read_sweep
    from orchestrator.tracking import rebuild

    run = copy_run(reference, tmp_path / "run")
    damaged = bytes(range(256)) * 400
    (run / "mlflow.db").write_bytes(damaged)
    made, create = [], rebuild.create_run

    def killed_after_3(*a, **kw):
        if len(made) == 3:
            raise KeyboardInterrupt  # what SIGINT raises there
        made.append(create(*a, **kw))

    monkeypatch.setattr(rebuild, "create_run", killed_after_3)
    with pytest.raises(KeyboardInterrupt):
        rebuild.rebuild_tracking(run, read_sweep(run), records.scan(run / "trials.jsonl"))
    monkeypatch.undo()  # doctor runs in this process (tests/faults/helpers.py cli)
    assert len(made) == 3 and (run / "mlflow.db").read_bytes() == damaged  # untouched
    assert not list(run.glob("mlflow.db.rebuilding-*")) and not list(run.glob("mlflow.db.damaged-*"))
    r = ok(cli("doctor", run, "--repair"))
    assert f"rebuilt from trials.jsonl ({len(recorded(run))} trial runs and the parent run)" in r.stdout, r.stdout
    assert "stray" not in r.stdout
    assert [p.read_bytes() for p in run.glob("mlflow.db.damaged-*")] == [damaged]  # kept aside once replaced
    ok(cli("doctor", run))
    info = json.loads((run / "sweep.json").read_text())
    client = MlflowClient(info["tracking_uri"])
    exp_id = client.get_experiment_by_name("healsweep").experiment_id
    assert [p.info.run_id for p in client.search_runs([exp_id], "tags.`healsweep.role` = 'sweep'")] == \
        [info["parent_run_id"]]
    assert trial_runs(run) == recorded(run)
    ok(cli("report", run))
    assert quoted(run) == reference["quoted"]


def test_what_the_run_directory_cannot_repair_is_said_so(reference, tmp_path):
    """The record gone and the database damaged: doctor --repair said "continue with healsweep run --resume", which
    refused and sent the user back to doctor; a damaged sweep.json beside a damaged database was "not rebuildable"
    because of a tracking server it never had. Both now say what is left to do."""
    run = copy_run(reference, tmp_path / "run")
    (run / "trials.jsonl").unlink()
    (run / "mlflow.db").write_bytes((run / "mlflow.db").read_bytes()[: 4096])
    r = cli("doctor", run, "--repair")
    assert r.returncode == 1 and r.stdout.rstrip().endswith(
        "what is left cannot be repaired from this run directory's own files (a resume would refuse it too): restore "
        "them from a copy, or run the sweep again into another --out"), r.stdout
    run = copy_run(reference, tmp_path / "run2")
    (run / "sweep.json").write_text("")
    (run / "mlflow.db").write_bytes((run / "mlflow.db").read_bytes()[: 4096])
    one_line(cli("doctor", run, "--repair"), 2, "and not rebuildable: the run directory's mlflow.db is damaged too "
             "(each is rebuilt from the other: restore one of them from a copy)")
