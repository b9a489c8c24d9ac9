"""A full disk under the store and under the run directory (a small tmpfs; where none can be mounted, an injected
quota: tests/faults/quota_plugin.py), and a trial
process killed in the middle of a write. Each ends in one line (or, for the kill, in a retried trial), leaves no
partial file that doctor does not find, and ``healsweep run --resume`` completes the sweep with every trial once
and the numbers of the session's undamaged run."""
from __future__ import annotations

import json
import os
import shutil

import pytest

from orchestrator.lifecycle.resume import temp_files
from tests.faults.helpers import assert_complete, cli, copy_run, ok, one_line, run_cli, tear_last_line

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]


def _edit_sweep(run, store: str | None = None, plugins: list | None = None) -> None:
    info = json.loads((run / "sweep.json").read_text())
    info["store"] = store or info["store"]
    info["spec"]["plugins"] = list(plugins or [])
    (run / "sweep.json").write_text(json.dumps(info, indent=1))


def test_full_store(reference, tmp_path, small_disk):
    """The store moved to a 3 MiB file system (the run's targets and masks are not there) and a trial to run
    again (a torn record: a sweep that ended complete resumes without a dense stage): the dense stage fills it."""
    mount, resize, plugins = small_disk
    full = mount(3)
    run, store = copy_run(reference, tmp_path / "run"), full / "store"
    _edit_sweep(run, store=str(store), plugins=plugins)
    tear_last_line(run / "trials.jsonl")
    r = run_cli("run", "--resume", run, "--quiet")
    line = one_line(r, 1, "no space left on device writing a target-store shard", str(store / "targets"), "needed ",
                    "free there", f"healsweep run --resume {run}")
    assert ".arrow" in line and not temp_files(full)  # the failed write left nothing partial
    r = cli("doctor", run)  # shards written before the disk filled are sound: the resume keeps them
    assert r.returncode == 1 and f"{store / 'targets'}/" in r.stdout and ": incomplete target key (" in r.stdout
    ok(cli("doctor", run, "--repair"))  # nothing to repair there: left to the resume
    resize(64)
    r = ok(run_cli("run", "--resume", run, "--quiet"))
    assert "8 trials finished, 0 failed" in r.stdout and "dense forward images " in r.stdout
    assert_complete(run, reference)
    ok(cli("doctor", run))


def _fill(where, leave_kib: int) -> None:
    """Fill the file system of ``where`` (or its injected quota) up to ``leave_kib`` KiB free."""
    quota = os.environ.get("HEALSWEEP_TEST_QUOTA", "").rpartition(":")[2]
    used = sum(p.stat().st_size for p in where.rglob("*") if p.is_file())
    free = int(quota) - used if quota else shutil.disk_usage(where).free
    with open(where / "filler", "wb") as f:
        f.write(b"\0" * max(0, free - leave_kib * 1024))


# What the resumed trial writes first into a full run directory: (checkpoint interval s, KiB left free, what the
# line may name). Its healed weights (1.1 MB) at the end; its Tune checkpoint (model and optimizer state, copied
# into DIR/tune/...) when one is due first (a slow machine: CI met it at the default interval, 2026-11-28), whose
# copy fills the disk so that the driver's next MLflow write may meet the full disk first; the MLflow database when
# nearly nothing is left (its writes come before the trial's).
DB = "the MLflow tracking database"
FIRST_TO_FAIL = {"healed weights": ("1e9", 300, ("a trial's healed weights",)),
                 "tune checkpoint": ("0", 300, ("a trial's Tune checkpoint", DB)),
                 "tracking database": ("1e9", 40, (DB,))}


@pytest.mark.parametrize("case", list(FIRST_TO_FAIL))
def test_full_run_directory(reference, tmp_path, small_disk, monkeypatch, case):
    interval, leave_kib, whats = FIRST_TO_FAIL[case]
    monkeypatch.setenv("HEALSWEEP_CHECKPOINT_INTERVAL_S", interval)
    mount, _, plugins = small_disk
    full = mount(16)
    if plugins and case != "healed weights":
        pytest.skip("needs a small file system (a tmpfs, mounted by root): the quota covers the project's own writes")
    run = copy_run(reference, full / "run")
    _edit_sweep(run, plugins=plugins)
    tear_last_line(run / "trials.jsonl")  # one trial runs again
    _fill(full, leave_kib)
    r = run_cli("run", "--resume", run, "--quiet")
    line = one_line(r, 1, f"healsweep run --resume {run}")
    assert any(f"no space left on device writing {w} {run}" in line for w in whats) and "free there" in line, line
    (full / "filler").unlink()
    monkeypatch.setenv("HEALSWEEP_CHECKPOINT_INTERVAL_S", "1e9")  # a checkpoint per epoch would not fit 16 MiB
    r = ok(run_cli("run", "--resume", run, "--quiet"))
    assert "8 trials finished, 0 failed" in r.stdout
    assert_complete(run, reference)
    ok(cli("doctor", run))


def test_worker_killed_mid_write(reference, tmp_path):
    run = copy_run(reference, tmp_path / "run")
    tear_last_line(run / "trials.jsonl")  # that trial runs again: its process is killed writing its weights
    _edit_sweep(run, plugins=["tests.faults.kill_plugin"])
    r = ok(run_cli("run", "--resume", run, "--quiet"))
    assert (run / "killed-mid-write").is_file()  # the kill happened, and the retry finished the trial
    assert "8 trials finished, 0 failed" in r.stdout
    assert_complete(run, reference)
    (left,) = temp_files(run)
    assert left.name.startswith(".tmp-") and left.name.endswith("-healed.safetensors")
    r = cli("doctor", run)
    assert r.returncode == 1 and f"{left}: leftover temporary file (65536 bytes" in r.stdout
    ok(cli("doctor", run, "--repair"))
    assert not left.exists() and not temp_files(run)
    ok(cli("doctor", run))


def test_a_trial_that_raises_is_retried_and_its_first_failure_named(reference, tmp_path):
    """The retry line names the first attempt's error (it said 'failed (unknown error)': Tune's synced error file
    did not exist yet when it called back), and the retry finishes the trial."""
    from tests.faults.raise_plugin import MESSAGE

    run = copy_run(reference, tmp_path / "run")
    tear_last_line(run / "trials.jsonl")
    _edit_sweep(run, plugins=["tests.faults.raise_plugin"])
    r = ok(run_cli("run", "--resume", run, "--quiet"))
    assert (run / "raised-once").is_file() and "8 trials finished, 0 failed" in r.stdout
    (line,) = [ln for ln in r.stderr.splitlines() if "retrying it" in ln]
    assert line.endswith(f"failed (RuntimeError: {MESSAGE}); retrying it (attempt 2)"), line
    assert "unknown error" not in r.stderr and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert_complete(run, reference)
