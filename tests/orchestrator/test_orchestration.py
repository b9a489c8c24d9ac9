"""Cluster-scale orchestration without a cluster: resumable healing, per-cell search bookkeeping, the asynchronous
MLflow writer, resource overrides and the scheduler (the real sweeps are in tests/e2e/test_cluster_faults.py)."""
from __future__ import annotations

import logging
import threading
from pathlib import Path

import pytest
import torch
from mlflow import MlflowClient
from mlflow.entities import Metric
from optuna.trial import TrialState

from orchestrator.raytune.resources import override_resources, parse_override, trial_device
from orchestrator.rundir.files import told_states
from orchestrator.search import PerCellOptunaSearch
from orchestrator.spec import SpecError, parse_spec
from tasks.healing import HEALERS, HealConfig

REPO = Path(__file__).resolve().parents[2]
STARFISH = HEALERS.get("starfish")


# --- resumable healing (tasks/, no Ray) ------------------------------------------------------------------

def test_heal_resumed_from_a_checkpoint_is_bit_identical(heal_case):
    cfg = HealConfig(lr=1e-2, epochs=3, batch_size=8)
    full = heal_case("timm_vit", "qkv_out_mlp")
    STARFISH.heal(full.ctx, cfg)

    first = heal_case("timm_vit", "qkv_out_mlp")
    saved = {}

    class Stop(Exception):
        pass

    def stop_after_1(epoch, _m):
        if epoch == 1:
            raise Stop
    first.ctx.checkpoint = lambda epoch, st: saved.update(
        st, weights={e.param: dict(first.model.named_parameters())[e.param].detach().clone() for e in first.entries})
    with pytest.raises(Stop):
        STARFISH.heal(first.ctx, cfg, stop_after_1)
    assert saved["epoch"] == 1 and saved["steps"] == 4 and len(saved["losses"]) == 1

    second = heal_case("timm_vit", "qkv_out_mlp")  # a fresh process: pruned model, then the checkpoint
    params = dict(second.model.named_parameters())
    with torch.no_grad():
        for n, w in saved["weights"].items():
            params[n].copy_(w)
    second.ctx.resume = saved
    seen = []
    res = STARFISH.heal(second.ctx, cfg, lambda e, m: seen.append(e))
    assert seen == [2, 3] and res.steps == 12 and len(res.epoch_losses) == 3
    for k, v in full.model.state_dict().items():
        assert torch.equal(v, second.model.state_dict()[k]), k
    second.assert_invariants()


# --- per-cell search bookkeeping (Optuna journal, no Tune run) ---------------------------------------------

CELLS = [{"cell_id": "cellA", "x": 1}, {"cell_id": "cellB", "x": 2}]


def test_search_round_major_and_restart_reruns_untold_trials_with_same_params(tmp_path):
    j = tmp_path / "optuna.journal"
    s = PerCellOptunaSearch(CELLS, 2, (1e-4, 1e-2), (1, 5), 0, j)
    cfgs = [s.suggest(f"t{i}") for i in range(2)]
    assert s.suggest("t2") is None  # cellA-1 is TPE's (past the 1 start-up trial): it waits for cellA-0's tell
    s.on_trial_complete("t0", {"selection_acc": 0.7, "final": True, "epoch": 3})
    cfgs.append(s.suggest("t2"))
    assert [c["trial_id"] for c in cfgs] == ["cellA-0", "cellB-0", "cellA-1"]
    assert all(c["x"] == (1 if c["cell_id"] == "cellA" else 2) and 1 <= c["epochs"] <= 5 for c in cfgs)
    s.on_trial_complete("t1", {"selection_acc": 0.5, "epoch": 1}, error=True)
    s.flush_errors()  # Tune's step after the error (its callbacks wrote the failure_reason): the tell is handed on
    # driver dies here: cellA-1 asked, never told; cellB-1 never asked
    r = PerCellOptunaSearch(CELLS, 2, (1e-4, 1e-2), (1, 5), 0, j)
    assert r.total == 2 and r.rerun == ["cellA-1"] and r.already_done == 2
    again = [r.suggest("u0"), r.suggest("u1")]
    assert again[0]["trial_id"] == "cellA-1" and again[0]["lr"] == cfgs[2]["lr"]
    assert again[0]["epochs"] == cfgs[2]["epochs"]
    assert again[1]["trial_id"] == "cellB-1" and r.suggest("u2") is PerCellOptunaSearch.FINISHED
    states = told_states(j)
    assert states == {"cellA-0": TrialState.COMPLETE, "cellB-0": TrialState.FAIL, "cellA-1": TrialState.RUNNING,
                      "cellB-1": TrialState.RUNNING}
    # a fresh journal with the same seed asks the same first parameters, whatever the order of cells
    other = PerCellOptunaSearch(CELLS[::-1], 2, (1e-4, 1e-2), (1, 5), 0, tmp_path / "other.journal")
    first_b = other.suggest("v0")
    assert first_b["trial_id"] == "cellB-0" and first_b["lr"] == cfgs[1]["lr"]


def test_suggestions_do_not_depend_on_which_trial_finishes_first(tmp_path):
    """Two searches, same seed: in one every trial finishes at once, in the other the cells' trials finish in
    reverse order with other cells' asks in between. The parameters of every trial are the same."""
    cells = [{"cell_id": f"c{i}"} for i in range(3)]
    score = {("c0", 0): 0.2, ("c0", 1): 0.9, ("c1", 0): 0.5, ("c1", 1): 0.1, ("c2", 0): 0.7, ("c2", 1): 0.3}

    def done(s, tid, cfg):
        s.on_trial_complete(tid, {"selection_acc": score[(cfg["cell_id"], cfg["optuna_trial"])], "final": True,
                                  "epoch": cfg["epochs"]})

    eager = PerCellOptunaSearch(cells, 4, (1e-4, 1e-2), (1, 8), 7, tmp_path / "a")
    got_a, i = {}, 0
    while (cfg := eager.suggest(f"a{i}")) is not PerCellOptunaSearch.FINISHED:
        got_a[cfg["trial_id"]] = (cfg["lr"], cfg["epochs"])
        done(eager, f"a{i}", {**cfg, "optuna_trial": cfg["optuna_trial"] % 2})
        i += 1
    lazy = PerCellOptunaSearch(cells, 4, (1e-4, 1e-2), (1, 8), 7, tmp_path / "b")
    got_b, live, i = {}, [], 0
    while True:
        cfg = lazy.suggest(f"b{i}")
        if cfg is PerCellOptunaSearch.FINISHED:
            break
        if cfg is None:  # nothing ready: finish the most recent live trial first (reverse order)
            tid, c = live.pop()
            done(lazy, tid, {**c, "optuna_trial": c["optuna_trial"] % 2})
            continue
        got_b[cfg["trial_id"]] = (cfg["lr"], cfg["epochs"])
        live.append((f"b{i}", cfg))
        i += 1
    for tid, c in reversed(live):
        done(lazy, tid, {**c, "optuna_trial": c["optuna_trial"] % 2})
    assert len(got_a) == 12 and got_a == got_b


def test_search_with_asha_searches_lr_only_and_tells_early_stopped_trials_pruned(tmp_path):
    s = PerCellOptunaSearch(CELLS[:1], 3, (1e-4, 1e-2), (2, 6), 0, tmp_path / "j", asha=True)
    a, b, c = (s.suggest(t) for t in ("a", "b", "c"))
    assert a["epochs"] == b["epochs"] == c["epochs"] == 6
    study = s.study("cellA")
    assert set(study.trials[0].distributions) == {"lr"}
    for e in (1, 2):
        s.on_trial_result("a", {"selection_acc": 0.1 * e, "epoch": e})
    s.on_trial_complete("a", {"selection_acc": 0.35, "epoch": 3})  # stopped by ASHA after epoch 3
    s.on_trial_complete("b", {"selection_acc": 0.9, "epoch": 6, "final": True})
    s.on_trial_complete("c", {"selection_acc": 0.0, "epoch": 1, "final": True, "diverged": True})
    t = s.study("cellA").trials
    assert [x.state for x in t] == [TrialState.PRUNED, TrialState.COMPLETE, TrialState.FAIL]
    assert t[0].intermediate_values == {1: 0.1, 2: 0.2, 3: 0.35} and t[1].value == 0.9


# --- asynchronous single MLflow writer ---------------------------------------------------------------------

def test_async_writer_batches_in_order_and_never_blocks(tmp_path):
    from orchestrator.tracking.writer import AsyncMlflowWriter

    client = MlflowClient(f"sqlite:///{tmp_path / 'm.db'}")
    exp = client.create_experiment("x")
    w = AsyncMlflowWriter(client)
    runs, gate, ready = {}, threading.Event(), threading.Event()
    w.submit(lambda: runs.update(a=client.create_run(exp).info.run_id))
    w.submit(ready.set)
    w.submit(gate.wait)  # the tracking server "hangs": the caller must still never wait
    for step in range(2500):
        w.log_metrics(lambda: runs.get("a"), [Metric("m", float(step), 0, step)])
    assert ready.wait(30)
    assert client.get_metric_history(runs["a"], "m") == []
    gate.set()
    w.submit(lambda: client.set_terminated(runs["a"], "FINISHED"))
    w.log_metrics(lambda: None, [Metric("lost", 1.0, 0, 0)])  # no run: dropped, not raised
    w.close()
    w.close()  # idempotent
    hist = client.get_metric_history(runs["a"], "m")
    assert sorted(h.step for h in hist) == list(range(2500)) and w.errors == 0
    assert w.batches <= 2500 // 1000 + 3  # coalesced, not one call per metric
    assert client.get_run(runs["a"]).info.status == "FINISHED"


def test_async_writer_stops_the_sweep_on_a_full_database_without_a_second_stderr_line(caplog):
    """A full disk under the tracking database: the writer hands the error to the sweep (which prints one line,
    orchestrator/rundir/faults.py) and logs it at DEBUG only; any other failed write stays a WARNING. Before
    2026-11-27 the full database also printed "mlflow write failed: ..." through logging's last-resort handler:
    tests/faults/test_disk_full_e2e.py failed whenever MLflow, not the trial, hit the full disk first."""
    import sqlite3

    from orchestrator.rundir import faults
    from orchestrator.tracking.writer import AsyncMlflowWriter

    def full():
        raise sqlite3.OperationalError("database or disk is full")

    def other():
        raise RuntimeError("tracking server said 503")

    faults.clear()
    w = AsyncMlflowWriter(lambda: None)
    try:
        with caplog.at_level(logging.DEBUG, logger="orchestrator.tracking.writer"):
            w.submit(full)
            w.flush()
            assert isinstance(faults.stopped(), sqlite3.OperationalError)
            assert [r.levelno for r in caplog.records] == [logging.DEBUG]
            faults.clear()
            w.submit(other)
            w.close()
        assert faults.stopped() is None and w.errors == 2
        assert [r.levelno for r in caplog.records] == [logging.DEBUG, logging.WARNING]
    finally:
        faults.clear()


def _trial(trial_id: str, key: str):
    from types import SimpleNamespace

    return SimpleNamespace(trial_id=trial_id, config={
        "trial_id": key, "cell_id": "c", "store_key": "s", "mask_key": "k", "pattern": "unstructured",
        "healer_settings": {}, "pruner_settings": {}, "default_granularity": "block", "optuna_trial": 0,
        "model": "m", "pruner": "magnitude", "scope": "all", "sparsity": 0.9, "calib_size": 8, "healer": "starfish",
        "seed": 0, "lr": 1e-3, "epochs": 1, "batch_size": 8, "target_mode": "store"})


def test_trial_logger_opens_mlflow_at_its_first_callback_not_before(tmp_path):
    """A sweep creates its MLflow parent run in a thread while Tune starts the trial actors
    (orchestrator/sweep/parent.py): the writer and the logger take callables, which nothing calls until the first
    trial callback (Tune pickles both before that), and the first trial's run is then the parent's child."""
    from ray import cloudpickle

    from orchestrator.tracking.writer import AsyncMlflowWriter
    from orchestrator.tracking.logger import MlflowTrialLogger

    client = MlflowClient(f"sqlite:///{tmp_path / 'm.db'}")
    exp = client.create_experiment("healsweep")
    calls: list[str] = []
    opened = threading.Event()

    def parent():
        calls.append("parent")
        return client.create_run(exp, tags={"healsweep.role": "sweep"}).info.run_id

    def open_client():
        calls.append("client")
        opened.set()
        return client

    writer = AsyncMlflowWriter(open_client)
    cb = MlflowTrialLogger(writer, "healsweep", "sw", parent, {"m": 0})
    copy = cloudpickle.loads(cloudpickle.dumps(cb))  # as Tune saves its callbacks: nothing opened for it
    assert calls == [] and not opened.is_set() and copy.parent is None and copy.writer._closed
    cb.on_trial_start(0, [], _trial("t1", "c-0"))
    cb.on_trial_start(0, [], _trial("t2", "c-1"))
    writer.close()
    assert calls == ["parent", "client"]  # each once, the parent first
    kids = client.search_runs([exp], "tags.`healsweep.role` = 'trial'")
    assert sorted(r.data.tags["trial_id"] for r in kids) == ["c-0", "c-1"]
    assert {r.data.tags["mlflow.parentRunId"] for r in kids} == {cb.parent} and cb.parent


def test_a_retry_says_one_line_and_a_node_fault_none_of_its_own(tmp_path, capsys):
    """A trial whose node died was said twice: trial_faults' "lost its actor ...; retrying it on another node" and
    the logger's "failed (...); retrying it (attempt 2)". The logger now says only a trial's own failures; both
    retries are tagged."""
    from types import SimpleNamespace

    from orchestrator.tracking.logger import MlflowTrialLogger
    from orchestrator.tracking.writer import AsyncMlflowWriter

    client = MlflowClient(f"sqlite:///{tmp_path / 'm.db'}")
    exp = client.create_experiment("healsweep")
    writer = AsyncMlflowWriter(client)
    cb = MlflowTrialLogger(writer, "healsweep", "sw", lambda: client.create_run(exp).info.run_id, {"m": 0})
    t = _trial("t1", "c-0")
    err = tmp_path / "error.txt"
    err.write_text("Traceback ...\nRuntimeError: out of memory\n")
    t.get_error, t.error_file, t.temporary_state = (lambda: None), str(err), SimpleNamespace()
    cb.on_trial_start(0, [], t)
    t.temporary_state.healsweep_node_faults = 1  # trial_faults counted a node fault and said its line
    cb.on_trial_recover(0, [], t)
    cb.on_trial_recover(0, [], t)  # then a failure of its own
    writer.close()
    lines = [ln for ln in capsys.readouterr().err.splitlines() if "retrying" in ln]
    assert lines == ["healsweep: trial c-0 failed (RuntimeError: out of memory); retrying it (attempt 3)"]
    tags = client.get_run(cb.runs["c-0"]).data.tags
    assert tags["retries"] == "2" and tags["node_faults"] == "1"


def test_trial_logger_raises_the_parent_stage_error_at_the_first_trial(tmp_path):
    """A parent stage that failed (its thread re-raises when joined) stops the sweep at the first trial callback,
    inside Tune (which ends fit with it), instead of logging trials under no parent."""
    from orchestrator.tracking.writer import AsyncMlflowWriter
    from orchestrator.tracking.logger import MlflowTrialLogger

    def parent():
        raise RuntimeError("tracking store is locked")

    writer = AsyncMlflowWriter(lambda: MlflowClient(f"sqlite:///{tmp_path / 'm.db'}"))
    cb = MlflowTrialLogger(writer, "healsweep", "sw", parent, {"m": 0})
    with pytest.raises(RuntimeError, match="tracking store is locked"):
        cb.on_trial_start(0, [], _trial("t1", "c-0"))
    writer.close()
    assert cb.runs == {} and writer.errors == 0


def test_tune_can_start_before_mlflow_is_imported():
    """What a sweep imports before Tune starts (healsweep run imports it while Ray starts) and the modules of the
    Tune stage import no MLflow (~1-2 s of imports): it is imported by the parent stage, beside Tune's start."""
    import subprocess
    import sys

    code = ("import sys\nfrom orchestrator.commands.run import _import_sweep_modules\n_import_sweep_modules()\n"
            "import orchestrator.sweep.run, orchestrator.raytune.tune_setup, orchestrator.raytune.tune_stop\n"
            "import orchestrator.raytune.node_guard\n"
            "import orchestrator.tracking.writer, orchestrator.tracking.logger, orchestrator.search, orchestrator.sweep.end\n"
            "print(sorted(m for m in sys.modules if m == 'mlflow' or m.startswith('mlflow.')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_mlflow_is_imported_aside_without_holding_up_the_caller():
    """healsweep run imports MLflow's client and SQL store in a thread of its own while Ray starts: the call
    returns at once, the modules are there once the thread ends, and the thread is not a daemon (the interpreter
    never exits in the middle of an import)."""
    import subprocess
    import sys

    code = ("import sys, time\nfrom orchestrator.commands.run import _import_mlflow_aside\n"
            "t0 = time.perf_counter()\nth = _import_mlflow_aside()\nback = time.perf_counter() - t0\n"
            "before = 'mlflow.store.tracking.sqlalchemy_store' in sys.modules\nth.join()\n"
            "print(back, time.perf_counter() - t0, th.daemon, th.name,\n"
            "      before, 'mlflow.store.tracking.sqlalchemy_store' in sys.modules, 'mlflow.tracking' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=300)
    assert out.returncode == 0, out.stderr
    back, done, daemon, name, before, store, client = out.stdout.split()
    assert float(back) < 0.1 * float(done), (back, done)  # the imports took the thread >= 10x the call's time
    assert (daemon, name, before, store, client) == ("False", "healsweep-mlflow-imports", "False", "True", "True")


# --- resources ---------------------------------------------------------------------------------------------

def _gpu_spec(**search):
    raw = {"name": "gpu", "models": ["vit_digits"], "sparsities": [0.9], "calib_sizes": [64],
           "pruners": ["magnitude"], "healers": ["starfish"],
           "resources": {"cpus_per_trial": 1, "gpus_per_trial": 0.25, "gpus_per_dense_task": 1},
           "search": {"trials_per_cell": 1, "lr": [1e-3, 3e-3], "epochs": [2, 2], **search}}
    return raw


def test_resource_override_turns_a_gpu_spec_into_a_cpu_run():
    spec = parse_spec(_gpu_spec())
    assert spec.resources.gpus_per_trial == 0.25 and spec.resources.gpus_per_dense_task == 1
    cpu = override_resources(spec, cpu_only=True)
    assert cpu.resources.gpus_per_trial == 0 and cpu.resources.gpus_per_dense_task == 0
    assert cpu.resources.cpus_per_trial == 1 and cpu.models == spec.models
    o = override_resources(spec, "cpu=2,gpu=0.5")
    assert (o.resources.cpus_per_trial, o.resources.gpus_per_trial) == (2.0, 0.5)
    assert parse_override("gpu=0") == {"gpus_per_trial": 0.0}
    cuda = parse_spec({**_gpu_spec(), "resources": {"gpus_per_trial": 1, "device": "cuda"}})
    cpu = override_resources(cuda, cpu_only=True)  # a device: cuda spec on a machine without one: every trial
    assert (cpu.resources.device, cpu.resources.gpus_per_trial) == ("cpu", 0)  # failed on cuda before
    assert trial_device(cpu.resources) == "cpu" and trial_device(cuda.resources) == "cuda"
    assert override_resources(spec, cpu_only=True).resources.device == "auto"  # auto with no GPU: the CPU
    with pytest.raises(SpecError, match="gpu=0 leaves the spec's resources.device cuda"):
        override_resources(cuda, "gpu=0")
    for bad in ("gpu", "tpu=1", "cpu=0", "gpu=1.5", "cpu=x"):
        with pytest.raises(SpecError, match="--resources"):
            parse_override(bad)
    with pytest.raises(SpecError, match="resources.gpus_per_trial"):
        parse_spec({**_gpu_spec(), "resources": {"gpus_per_trial": 1.5}})
    with pytest.raises(SpecError, match="search.scheduler"):
        parse_spec(_gpu_spec(scheduler="hyperband"))


def test_asha_scheduler_from_the_spec_stops_on_epochs_of_selection_acc():
    from orchestrator.raytune.cluster import present_concurrency
    from orchestrator.raytune.tune_setup import scheduler

    assert scheduler(parse_spec(_gpu_spec())) is None  # fifo by default
    spec = parse_spec(_gpu_spec(scheduler="asha", epochs=[2, 8], asha_grace_period=2, asha_reduction_factor=3))
    asha = scheduler(spec)
    assert (asha._time_attr, asha.metric, asha._mode, asha._max_t) == ("epoch", "selection_acc", "max", 8)
    assert [m for m, _ in asha._brackets[0]._rungs] == [6, 2]  # rungs: grace period 2, then x3
    # fractional GPUs pack trials: 0.25 GPU per trial on 2 GPUs -> 8, unless CPUs run out first
    assert present_concurrency(spec.resources, {"CPU": 16, "GPU": 2}) == 8
    assert present_concurrency(spec.resources, {"CPU": 5, "GPU": 2}) == 5
    assert present_concurrency(override_resources(spec, cpu_only=True).resources, {"CPU": 3}) == 3
