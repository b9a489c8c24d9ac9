"""orchestrator.lifecycle.refine: transition interval, fine grid, planning from MLflow, CLI dry run."""
from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import yaml

from orchestrator.lifecycle.refine import RefineError, fine_grid, plan_refinement, refine_interval, refine_spec
from orchestrator.spec import load_spec, parse_spec
from tests import transition_fixture as tf
from tests.orchestrator.run_cli import healsweep

REPO = Path(__file__).resolve().parents[2]


def _rec(pairs):
    return {"points": [{"sparsity": s, "label": lab} for s, lab in pairs]}


def test_refine_interval_extends_to_neighbours_and_unions():
    a = _rec([(0.5, "recoverable"), (0.7, "recoverable"), (0.8, "transition"), (0.9, "transition"),
              (0.95, "collapse")])
    assert refine_interval([a]) == (0.7, 0.95)
    # no transition point: between the last recoverable and the first collapse after it
    b = _rec([(0.5, "recoverable"), (0.9, "recoverable"), (0.95, "collapse"), (0.99, "collapse")])
    assert refine_interval([b]) == (0.9, 0.95)
    assert refine_interval([a, b]) == (0.7, 0.95)
    # transition at the grid edge: no neighbour above
    c = _rec([(0.5, "recoverable"), (0.9, "transition")])
    assert refine_interval([c]) == (0.5, 0.9)
    assert refine_interval([_rec([(0.5, "recoverable"), (0.9, "recoverable")])]) is None
    assert refine_interval([_rec([(0.5, "collapse"), (0.9, "recoverable")])]) is None


def test_fine_grid_excludes_ends_and_existing():
    assert fine_grid(0.9, 0.95, 0.01, {0.9, 0.92, 0.95}) == [0.91, 0.93, 0.94]
    assert fine_grid(0.90, 0.92, 0.005, ()) == [0.905, 0.91, 0.915]
    assert len(fine_grid(0.9, 0.95, 1e-6, ())) == 49_999  # the smallest step the 1e-6 rounding keeps apart
    for step in (0.0, 1e-300, float("nan"), 1.0, float("inf")):  # 1e-300 hung (a 4e299-point range); nan passed
        with pytest.raises(RefineError, match=r"--step must be in \[1e-06, 1\) \(a sparsity step"):  # `step <= 0`
            fine_grid(0.9, 0.95, step, ())


def test_refine_spec_drops_fixed_sparsity_pruners():
    spec = load_spec(REPO / "configs" / "default.yaml")
    fine = refine_spec(spec, [0.91, 0.92])
    assert fine.sparsities == (0.91, 0.92) and [p.name for p in fine.pruners] == ["magnitude"]
    assert fine.healers == spec.healers and fine.calib_sizes == spec.calib_sizes
    assert spec.grids and fine.grids == ()  # the healer-comparison grid is not refined


def test_extra_grid_records_do_not_widen_the_refinement(tmp_path):
    from mlflow import MlflowClient

    sweep = tf.build_store(tmp_path)
    client = MlflowClient(sweep["uri"])
    for cell, rid in sweep["ids"].items():  # `none` (transition at .7) ran in another grid: ignored
        client.log_param(rid, "grid", "healers" if cell.startswith("none-") else "main")
    run_dir = tmp_path / "run"
    tf.write_sweep_json(run_dir, sweep["uri"])
    assert plan_refinement(run_dir, 0.025)["interval"] == (0.7, 0.95)  # starfish's band alone


def _tiny_sweep(tmp_path):
    sweep = tf.build_store(tmp_path)
    run_dir = tmp_path / "run"
    tf.write_sweep_json(run_dir, sweep["uri"])
    meta = json.loads((run_dir / "sweep.json").read_text())
    meta["spec"] = load_spec(REPO / "configs" / "tiny.yaml").to_dict()
    (run_dir / "sweep.json").write_text(json.dumps(meta, default=list))
    return sweep, run_dir


def test_plan_counts_trials_and_estimates_time_from_measured_trials(tmp_path):
    from mlflow import MlflowClient
    from mlflow.entities import Metric

    from orchestrator.lifecycle.refine import count_trials, trial_wall

    sweep, run_dir = _tiny_sweep(tmp_path)
    plan = plan_refinement(run_dir, 0.025)
    # starfish: transition .8-.9 -> (.7, .95); none: transition at .7 -> (.5, .8): union (.5, .95)
    assert plan["interval"] == (0.5, 0.95)
    assert plan["sparsities"] == [0.525, 0.55, 0.575, 0.6, 0.625, 0.65, 0.675, 0.725, 0.75, 0.775, 0.825, 0.85,
                                  0.875, 0.925]
    assert plan["parent_run_id"] == sweep["parent"] and plan["round"] == 1
    # no Tune timing on the parent: the mean heal_seconds of the 20 finished trials (2 healers x 5 sparsities x 2
    # seeds, 1.0 s each)
    assert trial_wall(plan) == (1.0, "mean heal_seconds of 20 finished trials, one at a time")
    # tiny.yaml: 1 model x 14 sparsities x 2 calibration sizes x 1 healer x 2 trials per cell
    assert count_trials(refine_spec(load_spec(REPO / "configs" / "tiny.yaml"), plan["sparsities"])) == {"main": 56}
    crbn = parse_spec({**yaml.safe_load((REPO / "configs" / "tiny.yaml").read_text()), "models": ["resnet_digits"],
                       "healers": ["starfish", "crbn"]})
    assert count_trials(crbn) == {"main": 2 * 2 * (2 + 1)}  # a closed-form healer runs one trial per cell
    # with re-evaluation (the default spec's 2 per searched cell), counted as validate counts them: the plan said
    # 16 new trials and the round ran 24
    reev = parse_spec({**yaml.safe_load((REPO / "configs" / "tiny.yaml").read_text()),
                       "search": {"trials_per_cell": 2, "reevaluate": 2}})
    assert count_trials(reev) == {"main": 2 * 2 * (2 + 2)}
    # search.calib_draws 2: CR+BN reads the calibration images, so it heals once more on each draw (1 + 2); the
    # searched cells' re-evaluations move onto the draws (no trial added)
    draws = parse_spec({**yaml.safe_load((REPO / "configs" / "tiny.yaml").read_text()), "models": ["resnet_digits"],
                        "healers": ["starfish", "crbn"], "search": {"trials_per_cell": 2, "reevaluate": 2,
                                                                    "calib_draws": 2}})
    assert count_trials(draws) == {"main": 2 * 2 * ((2 + 2) + (1 + 2))}
    client = MlflowClient(sweep["uri"])  # Tune wall of three sessions; the last ran no trial
    client.log_batch(sweep["parent"], metrics=[Metric(k, v, 0, step) for step, (t, n) in enumerate(
        [(60.0, 10), (30.0, 5), (5.0, 0)]) for k, v in (("tune_seconds", t), ("trials_run", n))])
    assert trial_wall(plan) == (6.0, "the sweep's Tune wall per trial, 90 s / 15 trials")


def test_cli_dry_run_prints_trials_and_estimate_and_max_trials_refuses(tmp_path):
    from mlflow import MlflowClient
    from mlflow.entities import Metric

    sweep, run_dir = _tiny_sweep(tmp_path)
    MlflowClient(sweep["uri"]).log_batch(sweep["parent"], metrics=[Metric("tune_seconds", 90.0, 0, 0),
                                                                   Metric("trials_run", 15, 0, 0)])
    r = healsweep("refine", run_dir, "--step", "0.1", "--dry-run")
    assert r.returncode == 0, r.stderr
    # 0.6 only (0.7, 0.8, 0.9 already ran): 2 calibration sizes x 2 trials per cell, 6 s each
    plan = ["transition band 0.5–0.95: 1 new sparsity (0.6)",
            "4 new trials, about 24 s (6.0 s per trial: the sweep's Tune wall per trial, 90 s / 15 trials)"]
    assert r.stdout.splitlines() == plan
    r = healsweep("refine", run_dir, "--step", "0.1", "--max-trials", "3")  # refused before Ray starts
    assert r.stdout.splitlines() == plan  # a real round prints its plan before it runs (or is refused)
    assert r.returncode == 2 and r.stderr.splitlines() == [
        "healsweep: error: 4 new trials (1 sparsity x 4, about 24 s) exceed --max-trials 3; raise it, or use a "
        "coarser --step (see --dry-run)"]
    assert json.loads((run_dir / "sweep.json").read_text()).get("refinements") is None  # nothing ran
    t0 = time.monotonic()  # the finest step: 449,996 new sparsities, counted on one (listing each took ~75 s)
    r = healsweep("refine", run_dir, "--step", "1e-6", "--max-trials", "3")
    assert r.returncode == 2 and r.stderr.startswith("healsweep: error: 1799984 new trials (449996 sparsities x 4, "
                                                     "about "), r.stderr
    assert time.monotonic() - t0 < 40, time.monotonic() - t0  # 8-10 s here, with the CLI's start-up
    r = healsweep("refine", tmp_path / "nope")
    assert r.returncode == 2 and "not a run directory" in r.stderr
