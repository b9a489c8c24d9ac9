"""Two tiny real sweeps on real Ray: faults (a retried trial, a NaN trial) on a two-node cluster made with
ray.cluster_utils.Cluster, and a driver killed with SIGKILL then resumed."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from mlflow import MlflowClient
from optuna.trial import TrialState

from orchestrator.raytune.resources import override_resources
from orchestrator.lifecycle.resume import prepare_resume
from orchestrator.rundir.files import read_sweep, told_states
from orchestrator.spec import load_spec, parse_spec
from tests.orchestrator.run_cli import lock_held
from tests.orchestrator.test_orchestration import _gpu_spec

pytestmark = pytest.mark.e2e
REPO = Path(__file__).resolve().parents[2]


# --- real sweeps -------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def model_cache() -> Path:
    return Path(os.environ.get("HEALSWEEP_TEST_CACHE", REPO / ".healsweep" / "models"))


def _child_runs(tracking_uri: str, sweep_id: str):
    client = MlflowClient(tracking_uri)
    exp = client.get_experiment_by_name("healsweep")
    return client, client.search_runs([exp.experiment_id], f"tags.sweep_id = '{sweep_id}' and "
                                                           "tags.`healsweep.role` = 'trial'")


@pytest.fixture(scope="module")
def fault_sweep(tmp_path_factory, model_cache):
    """A GPU spec, overridden to CPU, on a simulated two-node cluster (1 CPU each): one healthy trial, one
    that fails once after epoch 1, one whose loss becomes NaN in epoch 2."""
    import ray
    from ray.cluster_utils import Cluster

    from orchestrator.sweep.run import run_sweep

    root = tmp_path_factory.mktemp("fault")
    marks = root / "marks"
    marks.mkdir()
    raw = _gpu_spec()
    raw.update(name="fault", plugins=["tests.fault_plugins"], healers=[
        "starfish", {"name": "test_flaky", "settings": {"marker_dir": str(marks)}},
        {"name": "test_nan", "settings": {"marker_dir": str(marks)}}])
    raw["search"]["epochs"] = [3, 3]
    raw["search"]["reevaluate"] = 0  # retries are the subject: one trial per healer, no re-evaluations
    spec = override_resources(parse_spec(raw), cpu_only=True)
    os.environ["HEALSWEEP_CHECKPOINT_INTERVAL_S"] = "0"  # a checkpoint after every epoch (inherited by workers)
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    cluster.add_node(num_cpus=1)
    try:
        ray.init(address=cluster.address, include_dashboard=False, log_to_driver=False)
        res = run_sweep(spec, root / "run", root / "store", model_cache, progress=False, report=False)
    finally:
        ray.shutdown()
        cluster.shutdown()
        os.environ.pop("HEALSWEEP_CHECKPOINT_INTERVAL_S", None)
    client, runs = _child_runs(res.tracking_uri, res.sweep_id)
    return res, marks, client, {r.data.params["healer"]: r for r in runs}


def test_two_node_cluster_sweep_completes_on_cpu_from_a_gpu_spec(fault_sweep):
    res, _, client, runs = fault_sweep
    assert set(runs) == {"starfish", "test_flaky", "test_nan"}
    assert res.trials_finished == 2 and res.trials_failed == 1
    assert res.dense_forward_images == 64
    assert all(r.data.params["device"] == "cpu" for r in runs.values())
    # 3 trials, 2 at a time, 1 CPU per trial on two 1-CPU nodes: the first two run side by side, one per node
    nodes = {r.data.tags.get("node_id") for r in runs.values()}
    assert None not in nodes
    # every node any attempt ran on (a retried trial may finish on the other node than it started on)
    assert len({n for r in runs.values() for n in r.data.tags["nodes"].split(",")}) == 2
    parent = client.get_run(res.parent_run_id)
    assert parent.data.metrics["concurrency"] == 2  # both nodes' CPUs


def test_failed_trial_is_retried_from_its_checkpoint(fault_sweep):
    _, marks, client, runs = fault_sweep
    r = runs["test_flaky"]
    logs = list(marks.glob("flaky-*.log"))
    assert len(logs) == 1 and logs[0].read_text().split() == ["0", "1"]  # attempt 2 started after epoch 1
    assert r.info.status == "FINISHED" and r.data.tags["retries"] == "1"
    assert r.data.metrics["resumed_from_epoch"] == 1
    hist = client.get_metric_history(r.info.run_id, "train_loss")
    assert sorted(h.step for h in hist) == [1, 2, 3]  # epoch 1 from attempt 1, epochs 2-3 from attempt 2
    # selection accuracy: measured after the last epoch only (no scheduler reads it per epoch)
    assert [h.step for h in client.get_metric_history(r.info.run_id, "selection_acc")] == [3]
    assert r.data.metrics["mask_violations"] == 0 and r.data.metrics["healed_acc"] > 0


def test_nan_trial_fails_with_its_reason_and_is_not_retried(fault_sweep):
    _, _, client, runs = fault_sweep
    r = runs["test_nan"]
    assert r.info.status == "FAILED" and "retries" not in r.data.tags
    assert r.data.tags["failure_reason"].startswith("HealingDiverged: healer 'test_nan': loss became nan at epoch 2")
    assert "healed_acc" not in r.data.metrics
    assert runs["starfish"].info.status == "FINISHED" and runs["starfish"].data.metrics["resumed_from_epoch"] == 0


KILL_SPEC = """name: killme
models: [vit_digits]
sparsities: [0.9]
calib_sizes: [64, 128]
pruners: [magnitude]
healers: [starfish]
search: {trials_per_cell: 2, lr: [1.0e-3, 3.0e-3], epochs: [2, 2], startup_trials: 2}
"""


def _unended_is_named_then_recorded(out: Path, capsys) -> None:
    """A driver killed with SIGKILL runs no end: doctor said "no problem found" and the report nothing of a resume.
    Beside a live driver (another process holding the run directory's lock) the report says the sweep is in
    progress and doctor --repair refuses; with none, doctor names the unended sweep, the report says to resume, and
    doctor --repair records it as interrupted (the parent run KILLED and partial, no trial run left RUNNING)."""
    from orchestrator.cli import main
    from orchestrator.lifecycle.unended import UNSEEN

    client, runs = _child_runs(f"sqlite:///{out / 'mlflow.db'}", read_sweep(out)["sweep_id"])
    done = sum(r.info.status == "FINISHED" for r in runs)  # what MLflow holds (its writes trail the journal's)
    first = lambda: (out / "report.md").read_text().splitlines()[2]  # noqa: E731 - the first screen's first line
    with lock_held(out) as driver:
        assert main(["report", str(out)]) == 0
        assert first().startswith(f"**Sweep in progress: a healsweep driver (pid {driver.pid}) is running it; "
                                  f"{done} trials finished so far")
        assert main(["doctor", str(out), "--repair"]) == 2
        assert f"another healsweep driver (pid {driver.pid}) is running this sweep" in capsys.readouterr().err
    assert main(["doctor", str(out)]) == 1
    assert "the sweep did not end: no healsweep driver holds it, yet its parent run is RUNNING" in capsys.readouterr().out
    assert main(["report", str(out)]) == 0
    assert first() == (f"**Unfinished sweep: its driver stopped without ending it (killed, or its machine went down) "
                       f"with {done} trials finished; the findings cover those trials only. Resume with healsweep run "
                       f"--resume {out.resolve()}**")
    assert main(["doctor", str(out), "--repair"]) == 0
    parent = client.get_run(read_sweep(out)["parent_run_id"])
    told = sum(st == TrialState.COMPLETE for st in told_states(out / "optuna.journal").values())
    assert parent.info.status == "KILLED" and (parent.data.tags["partial"], parent.data.tags["interrupted_by"],
                                               parent.data.tags["trials_finished"]) == ("true", UNSEEN, str(told))
    assert not [r for r in _child_runs(client.tracking_uri, read_sweep(out)["sweep_id"])[1] if r.info.status == "RUNNING"]
    capsys.readouterr()
    assert main(["doctor", str(out)]) == 0 and "(the sweep is partial: interrupted by" in capsys.readouterr().out


def test_killed_driver_resumes_without_rerunning_or_duplicating(tmp_path, model_cache, capsys):
    from orchestrator.sweep.run import run_sweep

    (tmp_path / "kill.yaml").write_text(KILL_SPEC)
    out, journal = tmp_path / "run", tmp_path / "run" / "optuna.journal"
    cmd = [sys.executable, "-m", "orchestrator.cli", "run", str(tmp_path / "kill.yaml"), "--out", str(out),
           "--store", str(tmp_path / "store"), "--cache", str(model_cache), "--num-cpus", "2", "--quiet"]
    proc = subprocess.Popen(cmd, cwd=REPO, start_new_session=True, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 300
        while time.time() < deadline and proc.poll() is None:
            if journal.exists() and TrialState.COMPLETE in told_states(journal).values():
                break
            time.sleep(0.5)
        assert proc.poll() is None, "the sweep ended before it could be killed"
        os.kill(proc.pid, signal.SIGKILL)  # the driver only
        proc.wait()
    finally:
        time.sleep(1)
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # Ray processes this driver started
        except ProcessLookupError:
            pass
    before = told_states(journal)
    done_before = {k for k, s in before.items() if s == TrialState.COMPLETE}
    assert 1 <= len(done_before) < 8  # 2 cells x (2 searched + 2 re-evaluations of the winner)
    _unended_is_named_then_recorded(out, capsys)
    info = read_sweep(out)
    spec = load_spec(tmp_path / "kill.yaml")
    prepare_resume(out)  # what healsweep run --resume does before the sweep
    res = run_sweep(spec, out, tmp_path / "store", model_cache, progress=False, report=True, num_cpus=2,
                    resume=True)
    assert res.sweep_id == info["sweep_id"] and res.parent_run_id == info["parent_run_id"]
    assert res.dense_forward_images == 0 and res.trials_finished == 8 and res.trials_failed == 0
    client, runs = _child_runs(res.tracking_uri, res.sweep_id)
    keys = sorted(r.data.tags["trial_id"] for r in runs)
    cells = sorted({k.rsplit("-", 1)[0] for k in keys})
    assert len(cells) == 2 and keys == sorted(f"{c}-{n}" for c in cells for n in ("0", "1", "r0", "r1"))  # once each
    assert all(r.info.status == "FINISHED" and "healed_acc" in r.data.metrics for r in runs)
    parent = client.get_run(res.parent_run_id).data.metrics
    assert parent["trials_run"] == 8 - len(done_before)  # finished trials were not run again
    # the 128 images of the killed session count in the sweep's total; this session computed none
    assert parent["dense_forward_images"] == 128 and parent["dense_forward_images_session"] == 0
    for r in runs:
        if r.data.tags["trial_id"] not in done_before:
            assert r.data.metrics["dense_forward_images"] == 0
    md = (out / "report.md").read_text()
    assert sum(line.startswith("| magnitude |") for line in md.split("## Details", 1)[1].splitlines()) == 2  # per cell
