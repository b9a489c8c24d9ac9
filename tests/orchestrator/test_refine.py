"""orchestrator.refine: transition interval, fine grid, planning from MLflow, CLI dry run."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from orchestrator.cli import main as cli_main
from orchestrator.refine import RefineError, fine_grid, plan_refinement, refine_interval, refine_spec
from orchestrator.spec import load_spec
from tests import transition_fixture as tf

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
    with pytest.raises(RefineError, match="step"):
        fine_grid(0.9, 0.95, 0.0, ())


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


def test_plan_and_cli_dry_run(tmp_path, capsys):
    sweep = tf.build_store(tmp_path)
    run_dir = tmp_path / "run"
    tf.write_sweep_json(run_dir, sweep["uri"])
    meta = json.loads((run_dir / "sweep.json").read_text())
    meta["spec"] = load_spec(REPO / "configs" / "tiny.yaml").to_dict()
    (run_dir / "sweep.json").write_text(json.dumps(meta, default=list))
    plan = plan_refinement(run_dir, 0.025)
    # starfish: transition .8-.9 -> (.7, .95); none: transition at .7 -> (.5, .8): union (.5, .95)
    assert plan["interval"] == (0.5, 0.95)
    assert plan["sparsities"] == [0.525, 0.55, 0.575, 0.6, 0.625, 0.65, 0.675, 0.725, 0.75, 0.775, 0.825, 0.85,
                                  0.875, 0.925]
    assert plan["parent_run_id"] == sweep["parent"] and plan["round"] == 1
    assert cli_main(["refine", str(run_dir), "--step", "0.1", "--dry-run"]) == 0
    # 0.6 only: 0.7, 0.8, 0.9 already ran
    assert "transition band 0.5–0.95: 1 new sparsity (0.6)" in capsys.readouterr().out
    assert cli_main(["refine", str(tmp_path / "nope")]) == 2
    assert "not a run directory" in capsys.readouterr().err
