"""End to end: a tiny sweep through Ray Tune + Optuna + MLflow + report, then the same sweep again."""
from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest
from mlflow import MlflowClient

from orchestrator.spec import load_spec
from orchestrator.sweep.run import run_sweep
from orchestrator.tracking.logger import FINAL_METRICS, TRIAL_PARAMS

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.e2e
TUNE_WARNINGS: list[str] = []  # warnings Tune's experiment-state logger gave during the two sweeps


@pytest.fixture(scope="module")
def model_cache() -> Path:
    # Content-addressed, so sharing the project's cache is safe: trained once per machine, never retrained.
    return Path(os.environ.get("HEALSWEEP_TEST_CACHE", REPO / ".healsweep" / "models"))


@pytest.fixture(scope="module")
def two_sweeps(tmp_path_factory, model_cache):
    root = tmp_path_factory.mktemp("e2e")
    spec = load_spec(REPO / "configs" / "tiny.yaml")
    tune_log = logging.getLogger("ray.tune.execution.experiment_state")  # the driver's snapshot warnings
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda rec: TUNE_WARNINGS.append(rec.getMessage())
    tune_log.addHandler(handler)
    try:
        # verbose: Tune's own warnings reach the handler above (the quiet default silences them)
        first = run_sweep(spec, root / "run1", root / "store", model_cache, progress=False, num_cpus=2,
                          verbose=True)
        second = run_sweep(spec, root / "run2", root / "store", model_cache, progress=False, num_cpus=2)
    finally:
        tune_log.removeHandler(handler)
    return spec, first, second


def test_no_snapshot_warning_per_checkpoint(two_sweeps):
    # num_to_keep=1 makes Tune snapshot after each trial checkpoint and warn each time (23 warnings for this
    # sweep, 1649 for the default one, before run_sweep turned the warning off).
    assert two_sweeps[1].trials_finished == 8
    assert not [m for m in TUNE_WARNINGS if "snapshotting has been triggered" in m]


def test_parent_run_holds_every_stage_time(two_sweeps):
    from orchestrator.sweep.console import STAGES

    for res in two_sweeps[1:]:
        m = MlflowClient(res.tracking_uri).get_run(res.parent_run_id).data.metrics
        # imports, spec: the CLI's (tests/e2e/test_cli_output.py); draws: only with search.calib_draws
        expected = set(STAGES) - {"imports", "spec", "draws"}
        assert {f"stage_{s}_seconds" for s in expected} <= set(m), sorted(m)
        assert all(m[f"stage_{s}_seconds"] >= 0 for s in expected)
        # Σ trial compute cannot exceed what `concurrency` trials running side by side fit in the trials' wall time
        assert 0 < m["trial_compute_seconds"] <= m["concurrency"] * m["stage_trials_seconds"] + 1
        assert m["stage_trials_seconds"] <= m["sweep_seconds"]
    # the second sweep finds every dense target in the store: its dense stage computes nothing
    assert two_sweeps[2].dense_forward_images == 0


def child_runs(res):
    client = MlflowClient(res.tracking_uri)
    exp = client.get_experiment_by_name("healsweep")
    runs = client.search_runs([exp.experiment_id], f"tags.sweep_id = '{res.sweep_id}' and tags.`healsweep.role` = 'trial'")
    return client, runs


def test_every_trial_is_a_child_run_with_its_params_and_metrics(two_sweeps):
    spec, first, _ = two_sweeps
    client, runs = child_runs(first)
    # 1 model x 2 sparsities x 2 calibration sizes x 2 trials per cell
    assert len(runs) == 8 and first.trials_finished == 8 and first.trials_failed == 0
    cells = {}
    for r in runs:
        assert r.info.status == "FINISHED"
        assert r.data.tags["mlflow.parentRunId"] == first.parent_run_id
        for t in ("sweep_id", "cell_id", "trial_id", "store_key"):
            assert r.data.tags[t]
        assert set(TRIAL_PARAMS) <= set(r.data.params)
        assert set(FINAL_METRICS) <= set(r.data.metrics)
        p, m = r.data.params, r.data.metrics
        assert p["healer"] == "starfish" and p["granularity"] == "token" and p["pruner"] == "magnitude"
        assert spec.search.lr[0] <= float(p["lr"]) <= spec.search.lr[1]
        epochs = int(p["epochs"])
        assert spec.search.epochs[0] <= epochs <= spec.search.epochs[1]
        hist = client.get_metric_history(r.info.run_id, "train_loss")  # one value per epoch
        assert sorted(h.step for h in hist) == list(range(1, epochs + 1))
        # selection accuracy after the last epoch only: no scheduler (FIFO) reads it per epoch
        assert [h.step for h in client.get_metric_history(r.info.run_id, "selection_acc")] == [epochs]
        assert m["mask_violations"] == 0
        assert m["achieved_sparsity"] == pytest.approx(float(p["sparsity"]), abs=1e-3)
        assert m["retention"] == pytest.approx(m["healed_acc"] / m["dense_acc"])
        assert m["dense_acc"] >= 0.95
        cells.setdefault(r.data.tags["cell_id"], []).append(r)
    assert len(cells) == 4 and all(len(v) == 2 for v in cells.values())


def test_healing_beats_pruning_at_high_sparsity(two_sweeps):
    _, first, _ = two_sweeps
    _, runs = child_runs(first)
    best = {}
    for r in runs:
        if float(r.data.params["sparsity"]) == 0.9:
            cid = r.data.tags["cell_id"]
            if cid not in best or r.data.metrics["selection_acc"] > best[cid].data.metrics["selection_acc"]:
                best[cid] = r
    assert len(best) == 2
    for r in best.values():
        assert r.data.metrics["healed_acc"] > r.data.metrics["pruned_acc"] + 0.05


def test_second_sweep_runs_no_dense_forward_pass(two_sweeps):
    _, first, second = two_sweeps
    # calibration sizes 128 and 256 share one key: the dense stage computed 256 images once.
    assert first.dense_forward_images == 256
    assert second.dense_forward_images == 0
    _, runs = child_runs(second)
    assert len(runs) == 8 and all(r.data.metrics["dense_forward_images"] == 0 for r in runs)
    client = MlflowClient(second.tracking_uri)
    assert client.get_run(second.parent_run_id).data.metrics["dense_forward_images"] == 0


def test_same_spec_and_seed_give_the_same_masks_and_numbers(two_sweeps):
    _, first, second = two_sweeps
    _, r1 = child_runs(first)
    _, r2 = child_runs(second)
    key = lambda r: (r.data.tags["cell_id"], r.data.params["lr"], r.data.params["epochs"])  # noqa: E731
    a, b = {key(r): r for r in r1}, {key(r): r for r in r2}
    shared = set(a) & set(b)
    assert len(shared) >= 4  # every cell's first (seeded random) Optuna suggestion is identical
    for k in shared:
        assert a[k].data.tags["mask_key"] == b[k].data.tags["mask_key"]
        for m in ("pruned_acc", "healed_acc", "selection_acc", "train_loss"):
            assert a[k].data.metrics[m] == b[k].data.metrics[m], m


def test_report_is_written_from_mlflow(two_sweeps):
    _, first, _ = two_sweeps
    html = (first.out_dir / "report.html").read_text()
    md = (first.out_dir / "report.md").read_text()
    assert html.count('<img src="data:image/png;base64,') >= 1  # accuracy vs sparsity (+ bands when computable)
    assert "## vit_digits" in md
    rows = [line for line in md.split("## Details", 1)[1].splitlines() if line.startswith("| magnitude |")]
    assert len(rows) == 4  # one row per cell
