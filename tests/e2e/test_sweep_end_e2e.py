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
from mlflow.entities import ViewType

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
    # the stopped trials' runs of the first session: deleted (hidden) and ended KILLED, none left RUNNING
    info = read_sweep(out)
    client = MlflowClient(info["tracking_uri"])
    gone = client.search_runs([client.get_experiment_by_name(info["experiment"]).experiment_id],
                              f"tags.sweep_id = '{info['sweep_id']}' and tags.`healsweep.role` = 'trial'",
                              run_view_type=ViewType.DELETED_ONLY)
    assert gone and all(r.info.status == "KILLED" for r in gone), [(r.data.tags["trial_id"], r.info.status) for r in gone]
    assert _finished(out) == 8
    parent = _parent(out)
    assert parent.info.status == "FINISHED" and parent.data.tags["partial"] == "false"
    assert parent.data.tags["trials_finished"] == "8"
    assert "Partial sweep" not in (out / "report.md").read_text()
    assert re.search(r"Trials: 8 \(8 finished, 0 failed\)", (out / "report.md").read_text())


@pytest.mark.timeout(1500)
def test_an_interrupted_refine_round_says_its_own_counts_and_refine_continues_it(tmp_path):
    """Ctrl-C during `healsweep refine`: it printed "22 of 4 trials finished" (the sweep's finished over the round's
    plan) and told the user to `run --resume`, which resumes the main grid only (0 trials): the stopped trials'
    runs stayed RUNNING and the next `refine` refused ("already has every sparsity"). Now the line counts the round
    and `healsweep refine DIR` continues it: every trial once, none left RUNNING, the round recorded whole."""
    out = tmp_path / "run"
    first = subprocess.run(_cmd(tmp_path, str(REPO / "configs" / "tiny.yaml"), "--out", str(out)),
                           capture_output=True, text=True, env=_env(), cwd=tmp_path, timeout=800)
    assert first.returncode == 0, first.stderr[-3000:]
    refine = [str(HEALSWEEP), "refine", str(out), "--num-cpus", "2", "--quiet"]
    with open(tmp_path / "stderr.txt", "w") as err:
        proc = subprocess.Popen([*refine, "--step", "0.02"], stdout=subprocess.PIPE, stderr=err, text=True,
                                env=_env(), cwd=tmp_path, start_new_session=True)
        deadline = time.monotonic() + 600
        while _finished(out) < 9:  # a trial of the round finished, others still to come
            assert proc.poll() is None and time.monotonic() < deadline, "the round ended before it was interrupted"
            time.sleep(0.3)
        os.killpg(proc.pid, signal.SIGINT)
        stdout, _ = proc.communicate(timeout=300)
    stderr = (tmp_path / "stderr.txt").read_text()
    assert proc.returncode == 130 and "Traceback" not in stderr, (proc.returncode, stderr[-3000:])
    rec = read_sweep(out)["refinements"][-1]
    planned = int(stdout.split(" new trial")[0].rsplit("\n", 1)[-1])  # the plan's line: "N new trials, about ..."
    assert rec["interrupted"] and 1 <= rec["trials_finished"] < planned
    assert [ln for ln in stderr.splitlines() if ln.startswith("interrupted")] == [
        f"interrupted: {rec['trials_finished']} of refine round 1's {planned} trials finished; continue it with "
        f"healsweep refine {out}"]
    tags = _parent(out).data.tags  # the report's partial line reads them: the sweep's finished over the sweep's plan
    assert (tags["trials_finished"], tags["trials_planned"]) == (str(_finished(out)), str(8 + planned))

    again = subprocess.run(refine, capture_output=True, text=True, env=_env(), cwd=tmp_path, timeout=800)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "refine round 1 was interrupted: it goes on (step 0.02" in again.stdout
    rec = read_sweep(out)["refinements"]
    assert len(rec) == 1 and "interrupted" not in rec[0] and rec[0]["trials_finished"] == planned
    runs = _children(out)
    keys = [r.data.tags["trial_id"] for r in runs]
    assert len(keys) == len(set(keys)) == 8 + planned and all(r.info.status == "FINISHED" for r in runs)
    assert _parent(out).data.tags["partial"] == "false" and "Partial sweep" not in (out / "report.md").read_text()


# configs/tiny.yaml's model with one widening round (its seed puts a winner on the lr edge: 6 trials, then 3 more)
WIDEN = {"name": "widen", "models": ["vit_digits"], "sparsities": [0.9], "calib_sizes": [128, 256],
         "pruners": ["magnitude"], "healers": ["starfish"],
         "search": {"trials_per_cell": 2, "lr": [1e-3, 3e-3], "epochs": [3, 5], "reevaluate": 1, "sampler_seed": 1,
                    "widen": {"rounds": 1, "factor": 4}}}
# a real SIGINT between the sweep's trials and its widening round (in plan_widening: the sweep's own handling has
# ended, the command's goes on); the round is planned, then stops before its trials
CTRL_C_IN_PLANNING = ("import os, signal, sys\nimport orchestrator.lifecycle.widen as w\nplan = w.plan_widening\n"
                      "def ctrl_c(*a, **k):\n    os.kill(os.getpid(), signal.SIGINT)\n    return plan(*a, **k)\n"
                      "w.plan_widening = ctrl_c\nfrom orchestrator.cli import main\nsys.exit(main())")


@pytest.mark.timeout(900)
def test_ctrl_c_before_a_widening_round_ends_partial_and_the_resume_runs_the_round(tmp_path):
    """It exited 130 with the resume line, but the parent run stayed FINISHED with partial=false and no report was
    written: the sweep read as complete. Now KILLED and partial as any interrupted sweep, a partial report; the
    resume runs the round and ends complete."""
    import yaml

    spec, out = tmp_path / "widen.yaml", tmp_path / "run"
    spec.write_text(yaml.safe_dump(WIDEN))
    first = subprocess.run([sys.executable, "-c", CTRL_C_IN_PLANNING, *_cmd(tmp_path, str(spec), "--out", str(out))[1:]],
                           capture_output=True, text=True, env=_env(), cwd=tmp_path, timeout=800)
    assert first.returncode == 130 and "Traceback" not in first.stderr, (first.returncode, first.stderr[-3000:])
    done = _finished(out)
    assert [ln for ln in first.stderr.splitlines() if ln.startswith("interrupted")] == [
        f"interrupted before the trials started ({done} finished earlier); resume with healsweep run --resume {out}"]
    assert "widen round" not in first.stdout  # the round did not run
    parent = _parent(out)
    assert parent.info.status == "KILLED" and parent.data.tags["partial"] == "true"
    assert parent.data.tags["interrupted_by"] == "SIGINT" and "widenings" not in read_sweep(out)
    assert "Partial sweep" in (out / "report.md").read_text()

    resumed = subprocess.run([*_cmd(tmp_path, "--resume", str(out))], capture_output=True, text=True, env=_env(),
                             cwd=tmp_path, timeout=800)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    rounds = read_sweep(out)["widenings"]
    assert len(rounds) == 1 and rounds[0]["trials_finished"] >= 1 and _finished(out) > done
    parent = _parent(out)
    assert parent.info.status == "FINISHED" and parent.data.tags["partial"] == "false"
    assert "Partial sweep" not in (out / "report.md").read_text()
