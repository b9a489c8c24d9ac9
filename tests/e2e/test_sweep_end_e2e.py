"""The end of a sweep, as a user meets it (the real console script in a subprocess, configs/tiny.yaml: 8 trials):
every run ends with exit 0 and its report; Ctrl-C (SIGINT to the process group, as a terminal sends it) or
SIGTERM (to the driver, as a scheduler or `ray job stop` sends it) ends with 130 / 143, one `interrupted:` line,
a report and an MLflow parent run marked partial; `--resume` then finishes the sweep with no trial run twice."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from mlflow import MlflowClient

from orchestrator.rundir.files import read_sweep, told_states

REPO = Path(__file__).resolve().parents[2]
HEALSWEEP = Path(sys.executable).with_name("healsweep")
CACHE = os.environ.get("HEALSWEEP_TEST_CACHE", str(REPO / ".healsweep" / "models"))
SHUTDOWN_CRASH = "already been shutdown"
pytestmark = pytest.mark.e2e


def _env() -> dict:
    return dict(os.environ, PYTHONPATH=str(REPO), RAY_USAGE_STATS_ENABLED="0")


def _cmd(tmp_path: Path, *args: str) -> list[str]:
    return [str(HEALSWEEP), "run", *args, "--store", str(tmp_path / "store"), "--cache", CACHE, "--num-cpus", "2",
            "--quiet"]


def _finished(out: Path) -> int:
    states = told_states(out / "optuna.journal").values() if (out / "optuna.journal").exists() else []
    return sum(s.name == "COMPLETE" for s in states)


def _children(out: Path) -> list:
    info = read_sweep(out)
    client = MlflowClient(info["tracking_uri"])
    exp = client.get_experiment_by_name(info["experiment"])
    return client.search_runs([exp.experiment_id], f"tags.sweep_id = '{info['sweep_id']}' and "
                                                   "tags.`healsweep.role` = 'trial'", max_results=1000)


def _parent(out: Path):
    info = read_sweep(out)
    return MlflowClient(info["tracking_uri"]).get_run(info["parent_run_id"])


@pytest.mark.timeout(900)
def test_every_run_ends_with_its_report_and_exit_0(tmp_path):
    """Two runs in a row (the ending used to die in 2 of 3 default-spec runs, orchestrator/sweep/end.py)."""
    for i in range(2):
        out = tmp_path / f"run{i}"
        proc = subprocess.run(_cmd(tmp_path, str(REPO / "configs" / "tiny.yaml"), "--out", str(out)),
                              capture_output=True, text=True, env=_env(), cwd=tmp_path, timeout=800)
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert SHUTDOWN_CRASH not in proc.stderr
        assert (out / "report.html").is_file() and (out / "report.md").is_file()
        assert "8 trials finished, 0 failed" in proc.stdout
        assert "Partial sweep" not in (out / "report.md").read_text()
        assert _parent(out).info.status == "FINISHED" and _parent(out).data.tags["partial"] == "false"


@pytest.mark.timeout(1200)
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_interrupted_sweep_says_so_and_resumes_without_running_a_trial_twice(tmp_path, sig):
    out = tmp_path / "run"
    with open(tmp_path / "stderr.txt", "w") as err:
        proc = subprocess.Popen(_cmd(tmp_path, str(REPO / "configs" / "tiny.yaml"), "--out", str(out)),
                                stdout=subprocess.PIPE, stderr=err, text=True, env=_env(), cwd=tmp_path,
                                start_new_session=True)
        deadline = time.monotonic() + 600
        while _finished(out) < 2:  # some trials finished, the rest still to come
            assert proc.poll() is None and time.monotonic() < deadline, "the sweep ended before it was interrupted"
            time.sleep(0.3)
        if sig == signal.SIGINT:
            os.killpg(proc.pid, sig)  # Ctrl-C: the terminal signals the whole foreground process group
        else:
            os.kill(proc.pid, sig)  # a scheduler / `ray job stop`: the driver
        stdout, _ = proc.communicate(timeout=300)
    stderr = (tmp_path / "stderr.txt").read_text()
    assert proc.returncode == 128 + sig, (proc.returncode, stderr[-3000:])
    assert SHUTDOWN_CRASH not in stderr and "Traceback" not in stderr, stderr[-3000:]
    lines = [ln for ln in stderr.splitlines() if ln.startswith("interrupted")]
    done = _finished(out)
    assert lines == [f"interrupted: {done} of 8 trials finished; resume with healsweep run --resume {out}"]
    assert 2 <= done < 8
    # the report, first thing on its first screen, and MLflow's parent run say it is partial
    name = signal.Signals(sig).name
    note = f"Partial sweep: interrupted by {name} with {done} of 8 trials finished"
    md = (out / "report.md").read_text().splitlines()
    assert md[0] == "# Sweep report: tiny" and md[2].startswith(f"**{note}")
    html = (out / "report.html").read_text()
    assert html.index(note) < html.index('class="sum"') < html.index("<details>")
    parent = _parent(out)
    assert parent.info.status == "KILLED"
    tags = parent.data.tags
    assert (tags["partial"], tags["trials_finished"], tags["trials_planned"], tags["interrupted_by"]) == \
        ("true", str(done), "8", name)
    before = {r.data.tags["trial_id"]: r.info.run_id for r in _children(out) if r.info.status == "FINISHED"}
    assert len(before) == done

    resumed = subprocess.run(_cmd(tmp_path, "--resume", str(out)), capture_output=True, text=True, env=_env(),
                             cwd=tmp_path, timeout=800)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "interrupted" not in resumed.stderr
    runs = _children(out)
    keys = [r.data.tags["trial_id"] for r in runs]
    assert len(keys) == len(set(keys)) == 8 and all(r.info.status == "FINISHED" for r in runs)
    assert {k: v for k, v in ((r.data.tags["trial_id"], r.info.run_id) for r in runs) if k in before} == before
    assert _finished(out) == 8
    parent = _parent(out)
    assert parent.info.status == "FINISHED" and parent.data.tags["partial"] == "false"
    assert parent.data.tags["trials_finished"] == "8"
    assert "Partial sweep" not in (out / "report.md").read_text()
    assert re.search(r"Trials: 8 \(8 finished, 0 failed\)", (out / "report.md").read_text())
