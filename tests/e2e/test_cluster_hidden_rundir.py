"""A cluster whose nodes share only the store URI, for real: the worker node (``ray start`` in a mount namespace of
its own, an empty tmpfs over the driver's directory) cannot see the driver's run directory, store or cache; the
head has no CPU, so every trial runs there; the store is an S3 endpoint with enforced auth. Trials checkpoint after
every epoch (``HEALSWEEP_CHECKPOINT_INTERVAL_S=0``, what a long trial does every 10 s).

Before 2026-12-02 Ray Tune's storage was the run directory (``DIR/tune``): every checkpoint on the worker failed
("Unable to set up cluster storage ... A local path on the head node is not accessible by worker nodes") and both
trials failed after 3 attempts; trials too short to checkpoint finished, their healed weights on the worker's disk,
out of ``healsweep export``'s reach. Now Tune's storage and those weights are under the store URI."""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile

import pytest
from safetensors.torch import load_file

from tests.cluster_fixtures import DRIVER_ONLY
from tests.orchestrator.run_cli import healsweep
from tests.ray_nodes import (NODE_ENV, REPO, completed, join_after, run_on_nodes, scaleout_spec, start_node, sweep_cmd,
                             unshare_cmd)

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]


def why_no_hiding() -> str | None:
    """Why a node cannot be started with a path hidden from it here (no ``unshare``, or mount namespaces not
    allowed), or None."""
    if shutil.which("unshare") is None:
        return "no unshare(1) on this machine"
    with tempfile.TemporaryDirectory(prefix="hs-hide-") as d:
        r = subprocess.run([*unshare_cmd(), "sh", "-c", 'mount -t tmpfs none "$0" && touch "$0/x"', d],
                           capture_output=True, text=True)
        if r.returncode != 0 or os.path.exists(os.path.join(d, "x")):
            return f"this machine does not allow a mount namespace ({r.stderr.strip()[:200]})"
    return None


def wait_for_cpus(address: str, cpus: float, timeout: float = 60) -> None:
    """Until the cluster at ``address`` lists ``cpus`` CPUs (a node's raylet is up before the GCS lists it), asked
    from another process (this one's Ray stays unconnected)."""
    code = ("import sys, time, ray; ray.init(address=sys.argv[1], log_to_driver=False); t0 = time.monotonic()\n"
            "while ray.cluster_resources().get('CPU', 0) < float(sys.argv[2]):\n"
            "    assert time.monotonic() - t0 < float(sys.argv[3]), ray.cluster_resources()\n"
            "    time.sleep(0.2)\n")
    r = subprocess.run([sys.executable, "-c", code, address, str(cpus), str(timeout)], timeout=timeout + 60,
                       env={**os.environ, **NODE_ENV}, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]


def _cluster(tmp_path, monkeypatch, head_cpus: int, node_gpus: int = 0):
    """A ``head_cpus``-CPU head and a 2-CPU node (and ``node_gpus`` logical GPUs) that does not see
    ``tmp_path / "driver"``; yields (head, node)."""
    if why := why_no_hiding():
        pytest.skip(why)
    driver = tmp_path / "driver"
    driver.mkdir()
    for k, v in NODE_ENV.items():
        monkeypatch.setenv(k, v)
    head = start_node(head_cpus)
    try:
        node = start_node(2, head.address, hide=str(driver), num_gpus=node_gpus,
                          env={k: None for k in os.environ if k.startswith(DRIVER_ONLY)})
        try:
            wait_for_cpus(head.address, head_cpus + 2)  # both nodes there when the sweep starts
            yield head, node
        finally:
            node.stop()
    finally:
        head.stop()


@pytest.fixture
def hidden_worker(tmp_path, monkeypatch):
    """The head has no CPU: every trial runs on the node without the driver's directory."""
    yield from _cluster(tmp_path, monkeypatch, 0)


@pytest.fixture
def hidden_worker_and_head(tmp_path, monkeypatch):
    yield from _cluster(tmp_path, monkeypatch, 1)


@pytest.fixture
def hidden_gpu_worker_and_head(tmp_path, monkeypatch):
    """The only GPU (a logical one) is on the node without the driver's directory; the head has 2 CPUs."""
    yield from _cluster(tmp_path, monkeypatch, 2, node_gpus=1)


def _sweep(driver, spec: dict, address: str, timeout: float = 420):
    """``healsweep run`` through the console script, as the scale-out tests run it: a driver process of its own
    (a test process that ran Ray with another auth mode before would refuse the node's workers' reports) and a hard
    time limit (a Ray wait blocked in C never sees pytest-timeout's signal). -> CompletedProcess."""
    (driver / "spec.yaml").write_text(json.dumps(spec))  # JSON is YAML
    cmd = sweep_cmd(driver / "spec.yaml", driver / "run", driver / "store", driver / "cache", address)
    return subprocess.run(cmd, cwd=driver, env={**os.environ, **NODE_ENV}, capture_output=True, text=True,
                          timeout=timeout)


def _parent_metrics(out) -> dict:
    from mlflow import MlflowClient

    info = json.loads((out / "sweep.json").read_text())
    return MlflowClient(info["tracking_uri"]).get_run(info["parent_run_id"]).data.metrics


SPEC = {"name": "hidden", "models": ["vit_digits"], "sparsities": [0.9], "calib_sizes": [64], "pruners": ["magnitude"],
        "healers": ["starfish"], "search": {"trials_per_cell": 2, "lr": [1e-3, 3e-3], "epochs": [2, 3], "reevaluate": 0}}


def test_a_node_without_the_run_directory_checkpoints_and_heals_into_the_store(tmp_path, aws_env, hidden_worker,
                                                                               monkeypatch):
    import pyarrow.fs as pafs

    from orchestrator.commands.export import fetch_stored
    from orchestrator.raytune.cluster import store_subdir
    from orchestrator.rundir import records
    from tasks.evaluate import accuracy
    from tasks.models.load import load_model
    from tasks.saved_trial import HEALED, healed_problem, trial_dir
    from tasks.store.healed import PAIR

    head, _ = hidden_worker
    driver = tmp_path / "driver"
    monkeypatch.chdir(driver)
    monkeypatch.setenv("HEALSWEEP_CHECKPOINT_INTERVAL_S", "0")  # to the workers through the job's runtime_env
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    uri = f"s3://{aws_env['bucket']}/hidden?endpoint_override={aws_env['host']}&scheme=http"
    out = driver / "run"
    r = _sweep(driver, {**SPEC, "store": {"uri": uri, "shard_size": 16}}, head.address)
    assert r.returncode == 0 and "2 trials finished, 0 failed" in r.stdout + r.stderr, r.stdout[-3000:] + r.stderr[-3000:]
    assert _parent_metrics(out)["tune_checkpoint_bytes_freed"] > 0  # the worker's checkpoints reached the bucket

    sweep_id = json.loads((out / "sweep.json").read_text())["sweep_id"]
    lines = sorted(records.trials(records.scan(out / records.TRIALS_FILE)).values(), key=lambda r: r["trial_id"])
    assert sorted(r["weights"] for r in lines) == ["store", "store"]
    assert not (out / "trials").exists()  # nothing of them on the driver's disk
    (out / records.TRIALS_FILE).unlink()  # a record rebuilt from the journal and MLflow asks the store too
    r = healsweep("doctor", out, "--repair")
    assert r.returncode == 0 and "written from the journal and MLflow (2 trials)" in r.stdout, r.stdout + r.stderr
    rebuilt = records.trials(records.scan(out / records.TRIALS_FILE)).values()
    assert sorted(x["weights"] for x in rebuilt) == ["store", "store"]  # before 2026-12-02: "elsewhere"
    fs, path = pafs.FileSystem.from_uri(store_subdir(uri, "healed"))
    held = {i.path[len(path) + 1:] for i in fs.get_file_info(pafs.FileSelector(path, recursive=True))
            if i.type == pafs.FileType.File}
    assert held == {f"{sweep_id}/{r['trial_id']}/{n}" for r in lines for n in (HEALED, "trial.json", PAIR)}
    tfs, tpath = pafs.FileSystem.from_uri(store_subdir(uri, "tune"))
    left = [i.path for i in tfs.get_file_info(pafs.FileSelector(tpath, recursive=True)) if "checkpoint_" in i.path]
    assert left == []  # dropped after the fit, as DIR/tune's are

    # export fetches them: the same bytes, and the healed model scores what the trial measured
    run = lines[0]["mlflow"]
    d = trial_dir(out, lines[0]["trial_id"])
    assert fetch_stored(out, d.name, d) is None and healed_problem(d) is None
    stored = fs.open_input_stream(f"{path}/{sweep_id}/{d.name}/{HEALED}").read()
    assert hashlib.sha256((d / HEALED).read_bytes()).hexdigest() == hashlib.sha256(stored).hexdigest()
    (d / HEALED).unlink()  # the command itself fetches them
    r = healsweep("export", run["run_id"], "--out", tmp_path / "x", "--run-dir", out)
    assert r.returncode == 0, r.stderr
    assert healed_problem(d) is None and (d / HEALED).read_bytes() == stored
    # a run whose numbers the stored copy does not repeat (a copy of the run directory resumed elsewhere writes
    # under the same keys): refused, nothing left behind; its own numbers: fetched
    d2, acc = trial_dir(out, lines[1]["trial_id"]), lines[1]["mlflow"]["metrics"]["healed_acc"]
    assert fetch_stored(out, d2.name, d2, acc + 0.25) == (
        f"the store has no usable copy (its copy there is of another run (healed_acc {acc}, this run's {acc + 0.25}))")
    assert not (d2 / HEALED).exists()
    assert fetch_stored(out, d2.name, d2, acc) is None and healed_problem(d2) is None
    lm = load_model("vit_digits", str(driver / "cache"), progress=False)
    lm.model.load_state_dict(load_file(str(tmp_path / "x" / "model.safetensors")))
    ev = lm.dataset["evaluation"]
    assert accuracy(lm.model.eval(), ev.images, ev.labels) == pytest.approx(run["metrics"]["healed_acc"], abs=1e-12)


def test_with_a_local_store_a_node_without_the_run_directory_is_named_once_and_kept_out(tmp_path,
                                                                                       hidden_worker_and_head,
                                                                                       monkeypatch):
    """No store URI: Ray Tune's storage is DIR/tune, which every node must see. The node that does not is named in
    one line before any work and fenced; the sweep runs on the head, 0 failed (before: its trials' checkpoints
    failed with Ray's "Unable to set up cluster storage", each counted against max_failures)."""
    from orchestrator.rundir import records

    head, node = hidden_worker_and_head
    driver = tmp_path / "driver"
    monkeypatch.setenv("HEALSWEEP_CHECKPOINT_INTERVAL_S", "0")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    out = driver / "run"
    r = _sweep(driver, SPEC, head.address)
    assert r.returncode == 0 and "2 trials finished, 0 failed" in r.stdout + r.stderr, r.stdout[-3000:] + r.stderr[-3000:]
    lines = [re.sub(r"\(\S+\)", "(ADDR)", ln, count=1) for ln in r.stderr.splitlines()
             if "does not see the run directory" in ln]  # ADDR: the node's address as Ray has it
    assert lines == [f"healsweep: node {node.node_id()[:12]} (ADDR) does not see the run directory {out}: kept "
                     "out of this sweep (2 CPU held); share it with the nodes (Ray Tune writes the trials' checkpoints "
                     "there), or set store.uri so that the nodes need only the store (docs/scaling.md, One storage URI)"]
    trials = records.trials(records.scan(out / records.TRIALS_FILE)).values()
    assert [t["mlflow"]["tags"]["node_id"] for t in trials] == [head.node_id()] * 2
    assert sorted(t["weights"] for t in trials) == ["saved", "saved"]


def test_with_a_local_store_and_no_node_that_sees_the_run_directory_the_sweep_is_refused(tmp_path, hidden_worker,
                                                                                        monkeypatch):
    """The head has no CPU and the only node with CPUs does not see the run directory: one line, before any work."""
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    _refused(tmp_path / "driver", SPEC, hidden_worker[0].address, "a trial (1 CPU) or a dense task (1 CPU)")


def test_a_gpu_sweep_whose_only_gpu_node_is_kept_out_is_refused(tmp_path, hidden_gpu_worker_and_head, monkeypatch):
    """The head sees the run directory but has no GPU; the GPU node does not see it (no store URI). Before
    2026-12-02 the head's CPUs counted as a node left: the stages ran and the trials waited for a GPU for ever."""
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    _refused(tmp_path / "driver", {**SPEC, "resources": {"gpus_per_trial": 0.5, "device": "cpu"}},
             hidden_gpu_worker_and_head[0].address, "a trial (1 CPU, 0.5 GPU)")


def _refused(driver, spec: dict, address: str, unplaced: str) -> None:
    """The sweep is refused in one line (exit 2) naming the node without the run directory and what no node left
    can place, before any work."""
    r = _sweep(driver, spec, address, timeout=240)
    assert r.returncode == 2, r.stdout[-3000:] + r.stderr[-3000:]
    assert r.stderr.strip().splitlines()[-1] == (
        f"healsweep: error: no node of the cluster can run the sweep: 1 node without the run directory "
        f"{driver / 'run'} (share it with the nodes, or set store.uri: docs/scaling.md, One storage URI); no node "
        f"left can place {unplaced}")
    assert not (driver / "store").exists() and not (driver / "run" / "trials.jsonl").exists()  # no work done


def test_a_node_joining_without_the_run_directory_is_named_and_its_trials_run_on_the_head(tmp_path):
    """A node joins after 3 trials without the run directory (no store URI) and trials shorter than a checkpoint
    interval: no checkpoint fails there, so nothing named it before 2026-12-02, and the trials it took healed there,
    their weights on its own disk ("elsewhere"). Now a trial refuses to start there (RunDirUnseen, a node fault:
    not counted), the node is named once and fenced, and every trial finishes on the head with its weights saved."""
    from orchestrator.raytune.trial_faults import UNSEEN_RETRIES
    from orchestrator.rundir import records

    if why := why_no_hiding():
        pytest.skip(why)
    spec = scaleout_spec(tmp_path / "spec.yaml", trials_per_cell=4)
    cache = os.environ.get("HEALSWEEP_TEST_CACHE", str(REPO / ".healsweep" / "models"))
    r = run_on_nodes(spec, tmp_path, tmp_path / "store", cache, head_cpus=1,
                     event=join_after(3, 2, hide_run_dir=True), timeout=420)
    out, t = tmp_path / "run", r.trials
    assert len(set(t.trial_ids)) == len(t.runs) == completed(out) and t.failed == 0
    assert set(t.per_node()) == {r.head_id}  # nothing finished on the node without the run directory
    log = (tmp_path / "sweep.log").read_text()
    assert "Traceback" not in log, log[-3000:]
    [line] = [ln for ln in log.splitlines() if "does not see the run directory" in ln]  # no trial's line either
    assert f"node {r.late_id[:12]} " in line and f"{out}: kept out of this sweep (2 CPU held)" in line, line
    refused = [int(x.data.tags.get("node_faults", 0)) for x in t.runs]  # Tune may place a retry there again until
    assert 1 <= sum(refused) and max(refused) < UNSEEN_RETRIES, refused  # the fence holds: none counted
    lines = records.trials(records.scan(out / records.TRIALS_FILE)).values()
    assert {x["weights"] for x in lines if x["optuna"]["state"] == "COMPLETE"} == {"saved"}
