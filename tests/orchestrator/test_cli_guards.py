"""Bad input to the CLI is one line on stderr and exit code 2, never a traceback (issue 16.7-16.9, 17.2); every case
runs the real `healsweep` console script in a subprocess. One driver per run directory (the run-dir lock)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from orchestrator.spec import load_spec
from tests.orchestrator.run_cli import lock_held

REPO = Path(__file__).resolve().parents[2]
EXE = Path(sys.executable).with_name("healsweep")


def cli(*args, cwd=REPO, timeout=120):
    env = dict(os.environ, PYTHONPATH=str(REPO), RAY_USAGE_STATS_ENABLED="0")
    return subprocess.run([str(EXE), *map(str, args)], capture_output=True, text=True, cwd=cwd, env=env,
                          timeout=timeout)


def assert_one_line_exit_2(r, *needles):
    err = r.stderr.strip()
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    assert "Traceback" not in r.stderr and len(err.splitlines()) == 1, err
    for n in needles:
        assert n in err, err


def sweep_record(d: Path, tmp_path: Path) -> Path:
    """A run directory with a genuine sweep.json of configs/tiny.yaml (as the driver writes it)."""
    d.mkdir(parents=True, exist_ok=True)
    spec = load_spec(REPO / "configs" / "tiny.yaml")
    (d / "sweep.json").write_text(json.dumps({
        "sweep_id": "abc123", "name": "tiny", "tracking_uri": f"sqlite:///{d / 'mlflow.db'}",
        "experiment": "healsweep", "store": str(tmp_path / "store"), "cache": str(tmp_path / "cache"),
        "spec": spec.to_dict(), "parent_run_id": "0" * 32}, default=list))
    return d


@pytest.mark.parametrize("content", ["garbage", '{"sweep_id": 3}'])
def test_resume_with_a_garbage_sweep_json(tmp_path, content):
    (tmp_path / "sweep.json").write_text(content, encoding="latin-1")
    assert_one_line_exit_2(cli("run", "--resume", tmp_path), "sweep.json")


def test_resume_refuses_a_store_or_cache_other_than_the_sweeps(tmp_path):
    """--store and --cache were silently ignored by --resume (the sweep's own are in sweep.json): another path is
    refused in one line; the sweep's own (the first command line repeated) is accepted."""
    d = sweep_record(tmp_path / "run", tmp_path)
    assert_one_line_exit_2(cli("run", "--resume", d, "--store", tmp_path / "other"),
                           f"--store {tmp_path / 'other'}: this sweep's store is {tmp_path / 'store'}")
    assert_one_line_exit_2(cli("run", "--resume", d, "--cache", tmp_path / "c2"), "--cache", "leave --cache out")
    r = cli("run", "--resume", d, "--store", tmp_path / "store", "--cache", tmp_path / "cache")
    assert "this sweep's" not in r.stderr, r.stderr  # past the check (this record has no database: refused later)


def test_resume_of_an_interrupted_refine_round_points_to_refine(tmp_path):
    """run --resume ran 0 trials of a stopped refine round (its cells are not the main grid's), marked the sweep
    complete and left the round's stopped trials RUNNING: refused, naming the command that continues it."""
    d = sweep_record(tmp_path / "run", tmp_path)
    rec = json.loads((d / "sweep.json").read_text())
    rec["refinements"] = [{"round": 1, "step": 0.02, "interval": [0.8, 0.9], "sparsities": [0.82],
                           "trials_finished": 1, "trials_failed": 0, "interrupted": True}]
    (d / "sweep.json").write_text(json.dumps(rec))
    assert_one_line_exit_2(cli("run", "--resume", d), f"refine round 1 of {d} did not finish: continue it with "
                           f"healsweep refine {d} (run --resume resumes the main grid only)")


def test_cpu_only_with_a_gpu_override_is_refused(tmp_path):
    assert_one_line_exit_2(cli("run", REPO / "configs" / "tiny.yaml", "--cpu-only", "--resources", "cpu=1,gpu=0.5"),
                           "--cpu-only runs every task on the CPU: give it or --resources gpu=/dense_gpu= above 0")
    # gpu=0 says the same as --cpu-only (usage.md gives them side by side): past that check, refused further on
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "optuna.journal").write_text("")
    r = cli("run", REPO / "configs" / "tiny.yaml", "--cpu-only", "--resources", "cpu=1,gpu=0,dense_gpu=0", "--out",
            tmp_path / "run")
    assert r.returncode == 2 and "--cpu-only" not in r.stderr and "already" in r.stderr, r.stderr


@pytest.mark.parametrize("days", ["nan", "inf"])
def test_store_gc_older_than_non_finite(tmp_path, days):
    (tmp_path / "targets").mkdir()
    assert_one_line_exit_2(cli("store", "gc", f"--older-than={days}", tmp_path), "--older-than")


@pytest.mark.parametrize("extra,needle", [
    (["--resources", "gpu=inf"], "--resources"), (["--resources", "cpu=nan"], "--resources"),
    (["--num-cpus", "-1"], "--num-cpus"), (["--out", "FILE"], "is a file"),
    # under a file: NotADirectoryError's traceback once Ray had started and the models were loaded
    (["--out", "FILE/sub"], "which is a file"), (["--store", "FILE/sub"], "which is a file"),
    (["--retry-failed"], "give it with --resume DIR")])
def test_run_rejects_bad_flags_before_ray(tmp_path, extra, needle):
    (tmp_path / "FILE").write_text("x")
    extra = [str(tmp_path / a) if a.startswith("FILE") else a for a in extra]
    out = ["--out", tmp_path / "run"] if "--out" not in extra else []
    assert_one_line_exit_2(cli("run", REPO / "configs" / "tiny.yaml", *out, *extra), needle)
    assert not (tmp_path / "run").exists()


def test_report_without_a_sweep_creates_nothing(tmp_path):
    assert_one_line_exit_2(cli("report", tmp_path), f"no sweep in {tmp_path}")
    d = sweep_record(tmp_path / "run", tmp_path)  # sweep.json, but its mlflow.db is gone
    assert_one_line_exit_2(cli("report", d), "no sweep in", "mlflow.db", "missing")
    assert sorted(p.name for p in d.iterdir()) == ["sweep.json"]  # no empty database, no report
    info = json.loads((d / "sweep.json").read_text())  # a sweep that ended before MLflow: no parent run, no database
    (d / "sweep.json").write_text(json.dumps({k: v for k, v in info.items() if k != "parent_run_id"}))
    assert_one_line_exit_2(cli("report", d), f"no sweep in {d}: it never reached MLflow (no parent run recorded)")
    assert sorted(p.name for p in d.iterdir()) == ["sweep.json"]


def test_second_driver_on_a_run_dir_is_refused_and_a_dead_drivers_lock_is_taken_over(tmp_path):
    d = sweep_record(tmp_path / "run", tmp_path)
    with lock_held(d) as holder:  # a live driver: holds the run directory's lock like run_sweep does
        r = cli("run", "--resume", d)
        assert_one_line_exit_2(r, f"another healsweep driver (pid {holder.pid}) is running this sweep")
    from orchestrator.rundir.files import lock_run_dir, release_run_dir

    time.sleep(0.1)
    f = lock_run_dir(d)  # stale: its holder is dead, the kernel dropped the flock
    try:
        assert (d / "driver.lock").read_text().strip() == str(os.getpid()) and not f.closed
    finally:
        release_run_dir(d)


def test_record_dense_keeps_every_sessions_images(tmp_path):
    from orchestrator.rundir.files import read_sweep, record_dense

    d = sweep_record(tmp_path / "run", tmp_path)
    info = read_sweep(d)
    assert record_dense(d, info, 0, 256) == 256  # first session, then the driver is killed
    info = read_sweep(d)  # the resumed driver reads sweep.json again
    assert record_dense(d, info, 1, 0) == 256 and read_sweep(d)["dense_forward_images"] == {"0": 256, "1": 0}
    assert record_dense(d, read_sweep(d), 2, 64) == 320


def test_store_commands_take_a_run_dir_from_any_cwd_and_list_everything(tmp_path):
    from tasks.store import TargetStore, content_key, ensure_targets
    from tests.store_helpers import Runner

    home = tmp_path / "home"
    st = TargetStore(home / "targets")
    key = content_key("cli")
    ensure_targets(st, key, 6, 4, Runner(st, key), meta={"model": "m6"}, dtype="float16")
    (home / "masks").mkdir()
    (home / "masks" / f"{'a' * 32}.safetensors").write_bytes(b"m" * 3000)
    (home / "rankings" / "vit").mkdir(parents=True)
    (home / "rankings" / "vit" / "r.safetensors").write_bytes(b"r" * 5000)
    (home / "diagnostics").mkdir()
    run = sweep_record(tmp_path / "run", tmp_path)
    info = json.loads((run / "sweep.json").read_text())
    (run / "sweep.json").write_text(json.dumps(dict(info, store=str(home))))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    r = cli("store", "ls", "../run", cwd=elsewhere)  # a relative run directory, from another cwd
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert any(line.startswith(key) and " m6 " in line for line in lines)
    assert any(f"{'a' * 32}.safetensors" in line and "0.00 MB" in line for line in lines)
    assert any(line.strip().startswith("vit/") and "0.01 MB" in line for line in lines)
    assert "masks: 1 entry, 0.00 MB" in r.stdout and "rankings: 1 entry" in r.stdout
    assert "diagnostics: 0 entries" in r.stdout
    r = cli("store", "verify", run, cwd=elsewhere)  # the targets are whole; the 3,000 bytes of "m" are no mask
    assert r.returncode == 1 and f"{key}: ok" in r.stdout and "1 masks checked, 1 damaged" in r.stdout, r.stdout
    assert cli("store", "verify", run, key, cwd=elsewhere).stdout.startswith(f"{key}: ok")  # one key: masks unread
    assert_one_line_exit_2(cli("store", "ls", cwd=elsewhere), ".healsweep/store does not exist")
    # WHERE and --store naming two places: refused (--store was used and WHERE ignored)
    assert_one_line_exit_2(cli("store", "ls", "--store", str(home), "../run", cwd=elsewhere),
                           "store: give WHERE or --store, not both")
    assert cli("store", "gc", "--older-than", "0", "--dry-run", home, cwd=elsewhere).stdout.startswith(
        f"would delete {key}")


def test_a_search_the_design_cannot_run_is_one_line_exit_2_before_any_work(tmp_path):
    spec = yaml.safe_load((REPO / "configs" / "tiny.yaml").read_text())
    spec["search"].update(reevaluate=9)
    (tmp_path / "s.yaml").write_text(yaml.safe_dump(spec))
    r = cli("run", tmp_path / "s.yaml", "--out", tmp_path / "run", "--quiet")
    assert_one_line_exit_2(r, "search.reevaluate")
    assert not (tmp_path / "run").exists()  # nothing made: refused before Ray, MLflow or the run directory


def test_a_spec_store_uri_under_a_file_is_one_line_before_ray(tmp_path):
    """validate passed it; the run died at the dense stage in NotADirectoryError, its run directory half made."""
    import yaml

    (tmp_path / "FILE").write_text("x")
    raw = yaml.safe_load((REPO / "configs" / "tiny.yaml").read_text())
    raw["store"] = {**(raw.get("store") or {}), "uri": str(tmp_path / "FILE" / "targets")}
    (tmp_path / "spec.yaml").write_text(yaml.safe_dump(raw))
    r = cli("run", tmp_path / "spec.yaml", "--out", tmp_path / "run")
    err = r.stderr.strip().splitlines()  # the spec is checked while Ray starts: its status line, then the refusal
    assert r.returncode == 2 and "Traceback" not in r.stderr and err[-1].startswith("healsweep: error: store.uri: ")
    assert err[-1].endswith("which is a file, not a directory") and len(err) <= 2, err
    assert not (tmp_path / "run").exists()


def test_models_train_refuses_a_cache_under_a_file_before_training(tmp_path):
    """The trained weights were lost: the write failed only after the whole training (about 3 minutes)."""
    (tmp_path / "FILE").write_text("x")
    assert_one_line_exit_2(cli("models", "train", "resnet_digits", "--cache", tmp_path / "FILE" / "sub"),
                           "--cache", "which is a file")


def test_store_commands_on_a_file_an_unknown_scheme_or_a_missing_file_uri(tmp_path):
    """Tracebacks (FileExistsError, ArrowInvalid) for the first two; a missing file:// store was created and
    reported "0 keys checked, 0 damaged"."""
    (tmp_path / "FILE").write_text("x")
    assert_one_line_exit_2(cli("store", "ls", tmp_path / "FILE"), "is a file, not a store directory")
    assert_one_line_exit_2(cli("store", "verify", "foo://bar"), "cannot open foo://bar", "Unrecognized filesystem")
    assert_one_line_exit_2(cli("store", "verify", f"file://{tmp_path / 'typo'}"), "does not exist")
    assert not (tmp_path / "typo").exists()


def test_refine_num_cpus_0_and_export_to_a_server_that_is_down_are_one_line(tmp_path):
    """refine --num-cpus 0 printed its plan and started Ray before failing (run refuses it at once); export
    --tracking-uri at a server that is down waited out MLflow's retries with no output (killed after 150 s)."""
    import time

    d = sweep_record(tmp_path / "run", tmp_path)
    assert_one_line_exit_2(cli("refine", d, "--num-cpus", "0"), "--num-cpus must be >= 1, got 0")
    t0 = time.monotonic()
    assert_one_line_exit_2(cli("export", "0" * 32, "--out", tmp_path / "ex", "--run-dir", d, "--tracking-uri",
                               "http://127.0.0.1:1"), "--tracking-uri: cannot reach 127.0.0.1:1 within 3 s")
    assert time.monotonic() - t0 < 60 and not (tmp_path / "ex").exists()


@pytest.mark.parametrize("content", ["", '{"sweep_id": "ab', "[1]", "{}", '{"tracking_uri": 5}'])
def test_a_damaged_sweep_json_is_one_line_for_every_command_that_reads_it(tmp_path, capsys, content):
    """refine (JSONDecodeError, KeyError), report, store ls/gc (AttributeError on a list) and export (a tracking_uri
    that is not a string) ended in tracebacks on an empty, torn or foreign sweep.json; doctor and --resume did not."""
    from orchestrator.cli import main

    d = tmp_path / "run"
    d.mkdir()
    (d / "sweep.json").write_text(content)
    commands = [["refine", str(d), "--dry-run"], ["report", str(d)], ["store", "ls", str(d)],
                ["store", "gc", "--older-than", "1", "--dry-run", str(d)],
                ["export", "0" * 32, "--out", str(tmp_path / "x"), "--run-dir", str(d)]]
    for argv in commands:
        code = main(argv)
        err = capsys.readouterr().err.strip()
        assert code == 2 and len(err.splitlines()) == 1 and "Traceback" not in err, (argv, code, err)
        assert any(w in err for w in ("sweep.json", "not a readable run directory", "not found in")), (argv, err)
    assert (d / "sweep.json").read_text() == content  # nothing rewritten


def test_export_takes_run_dir_or_runs_not_both(tmp_path, capsys):
    """--runs was silently ignored next to --run-dir (docs/usage.md: either one)."""
    from orchestrator.cli import main

    with pytest.raises(SystemExit) as e:
        main(["export", "0" * 32, "--out", str(tmp_path / "x"), "--run-dir", str(tmp_path), "--runs", str(tmp_path)])
    assert e.value.code == 2 and "argument --runs: not allowed with argument --run-dir" in capsys.readouterr().err


def test_export_names_the_repair_of_a_run_directory_that_lost_its_sweep_json(tmp_path, capsys):
    from orchestrator.cli import main

    (tmp_path / "trials.jsonl").write_text("")
    assert main(["export", "0" * 32, "--out", str(tmp_path / "x"), "--run-dir", str(tmp_path)]) == 2
    assert capsys.readouterr().err.strip() == (f"healsweep: error: --run-dir {tmp_path}: sweep.json missing; rebuild "
                                               f"it with healsweep doctor {tmp_path} --repair")


def test_doctor_repair_and_a_driver_keep_out_of_each_others_run_directory(tmp_path):
    """doctor --repair rewrote what a live driver was writing (its temporary files, the database), and a sweep could
    start in the middle of a repair: each now holds the run directory's lock against the other, and a check beside
    a live driver says what holds the directory before its problem lines."""
    d = sweep_record(tmp_path / "run", tmp_path)
    with lock_held(d) as driver:
        assert_one_line_exit_2(cli("doctor", d, "--repair"), f"another healsweep driver (pid {driver.pid}) is running "
                               "this sweep; wait for it to end or stop it first")
        r = cli("doctor", d)
        assert r.stdout.splitlines()[0] == (f"{d.resolve()}: a healsweep driver (pid {driver.pid}) is running this "
                                            "sweep now: a file it is writing may show as a problem"), r.stdout
    with lock_held(d, "doctor") as repair:
        assert_one_line_exit_2(cli("run", "--resume", d), f"{d}: healsweep doctor --repair (pid {repair.pid}) is "
                               "repairing this run directory; wait for it to end")
        assert cli("doctor", d).stdout.startswith(f"{d.resolve()}: healsweep doctor --repair (pid {repair.pid}) is "
                                                  "repairing it now")
    assert (d / "driver.lock").read_text().split()[1] == "doctor"  # the holder's role, written beside its pid


def test_doctor_cache_is_for_a_rebuilt_sweep_json_only(tmp_path):
    """--cache names the model cache of a rebuilt sweep.json (recorded nowhere else); beside a sound one it would be
    ignored: refused in one line, nothing written."""
    d = sweep_record(tmp_path / "run", tmp_path)
    before = (d / "sweep.json").read_text()
    assert_one_line_exit_2(cli("doctor", d, "--repair", "--cache", tmp_path / "c2"), f"--cache names the model cache "
                           f"of a rebuilt sweep.json; {d / 'sweep.json'} is sound (its cache: {tmp_path / 'cache'}): "
                           "leave --cache out")
    assert (d / "sweep.json").read_text() == before and sorted(p.name for p in d.iterdir()) == ["sweep.json"]


def test_refine_of_a_running_sweep_is_refused_before_ray_and_its_dry_run_says_so(tmp_path):
    """refine started Ray and only then met the run directory's lock; its dry run planned from a sweep still running
    without a word."""
    d = sweep_record(tmp_path / "run", tmp_path)
    with lock_held(d) as driver:
        assert_one_line_exit_2(cli("refine", d), f"another healsweep driver (pid {driver.pid}) is running this sweep")
        r = cli("refine", d, "--dry-run")
        assert r.stdout.startswith(f"note: a healsweep driver (pid {driver.pid}) is running this sweep now: this plan "
                                   "is from the trials finished so far"), r.stdout
