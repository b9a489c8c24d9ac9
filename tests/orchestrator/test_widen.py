"""orchestrator/lifecycle/widen.py planning on real MLflow runs: which cells sit on the boundary, the shifted box, the
restricted spec that continues their studies; the CLI's one-line refusals."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from orchestrator.lifecycle.continuation import RefineError
from orchestrator.spec import load_spec
from orchestrator.lifecycle.widen import plan_widening, widen_spec
from tests import transition_fixture as tf
from tests.orchestrator.run_cli import healsweep

REPO = Path(__file__).resolve().parents[2]


def _sweep(tmp_path, lr=(1e-3, 3e-3)):
    sweep = tf.build_store(tmp_path)  # every trial: lr 1e-3, 2 epochs, calib 64
    run_dir = tmp_path / "run"
    tf.write_sweep_json(run_dir, sweep["uri"])
    meta = json.loads((run_dir / "sweep.json").read_text())
    spec = load_spec(REPO / "configs" / "tiny.yaml").to_dict()
    spec["search"]["lr"] = list(lr)
    meta["spec"] = spec
    (run_dir / "sweep.json").write_text(json.dumps(meta, default=list))
    return sweep, run_dir


def test_plan_shifts_the_box_below_the_floor_every_winner_sits_on(tmp_path):
    sweep, run_dir = _sweep(tmp_path)  # lr 1e-3 is the floor of [1e-3, 3e-3]; 2 of epochs 3-5 is no cap
    plan = plan_widening(run_dir, 4.0)
    assert set(plan["cells"]) == set(sweep["ids"]) and set(plan["cells"].values()) == {"main"}
    assert plan["boxes"] == {"main": {"lr": [pytest.approx(2.5e-4), pytest.approx(7.5e-4)], "epochs": [3, 5]}}
    assert plan["round"] == 1 and plan["parent_run_id"] == sweep["parent"]
    spec = widen_spec(load_spec(REPO / "configs" / "tiny.yaml"), plan, {c: 2 for c in plan["cells"]})
    assert spec.cells == tuple(plan["cells"]) and spec.search.lr == (pytest.approx(2.5e-4), pytest.approx(7.5e-4))
    assert spec.search.trials_per_cell == 2 + 2  # each study brought to 2 more trials


def test_plan_is_empty_when_no_winner_is_on_the_boundary(tmp_path):
    _, run_dir = _sweep(tmp_path, lr=(1e-4, 1e-2))  # 1e-3: the middle of the log range
    assert plan_widening(run_dir, 4.0)["cells"] == {}
    for factor in (1.0, 1e300, float("nan")):  # 1e300 ran a round of lr ~1e297, every trial failed
        with pytest.raises(RefineError, match=r"widen factor must be > 1 and <= 1e\+06"):
            plan_widening(run_dir, factor)


def test_refine_widen_cli_refusals(tmp_path):
    r = healsweep("refine", tmp_path / "nope", "--widen")
    assert r.returncode == 2 and r.stderr.strip().endswith("not a run directory (no sweep.json)")
    _, run_dir = _sweep(tmp_path, lr=(1e-4, 1e-2))
    before = json.loads((run_dir / "sweep.json").read_text())
    r = healsweep("refine", run_dir, "--widen")
    assert r.returncode == 0 and "no winner sits on the search boundary, or only on the spec's own limits" in r.stdout
    for rounds in ("0", "11"):
        r = healsweep("refine", run_dir, "--widen", "--widen-rounds", rounds)
        assert r.returncode == 2 and "--widen-rounds must be in [1, 10] (as search.widen.rounds)" in r.stderr
    # an option of the other mode is refused, not ignored (--widen --dry-run ran a real widening round)
    for args, words in ((["--widen", "--dry-run"], "--dry-run does not apply to --widen"),
                        (["--widen", "--step", "0.01"], "--step does not apply to --widen"),
                        (["--widen", "--max-trials", "9"], "--max-trials does not apply to --widen"),
                        (["--widen-rounds", "2"], "--widen-rounds applies only with --widen"),
                        (["--dry-run", "--widen-factor", "2"], "--widen-factor applies only with --widen"),
                        # nan and inf parse as floats: one line each (--step nan was a traceback, --widen-factor inf
                        # an OverflowError)
                        (["--dry-run", "--step", "nan"], "--step must be in [1e-06, 1) (a sparsity step; fine "
                                                         "sparsities are rounded to 1e-6), got nan"),
                        (["--widen", "--widen-factor", "inf"], "widen factor must be > 1 and <= 1e+06, got inf")):
        r = healsweep("refine", run_dir, *args)
        assert r.returncode == 2 and words in r.stderr and not r.stdout, (args, r.stderr)
    assert json.loads((run_dir / "sweep.json").read_text()) == before  # nothing ran


def test_a_refined_cell_on_the_boundary_is_in_the_rounds_spec():
    """A cell a refinement round added (a sparsity the sweep's spec does not list) is widened too: the round's
    spec holds it (it was named widened, in sweep.json and the report, and never ran: the spec had no such cell)."""
    from collections import defaultdict

    from orchestrator.lifecycle.refine import refine_spec
    from orchestrator.lifecycle.widen import round_spec
    from orchestrator.spec.plan import expand_cells

    spec = load_spec(REPO / "configs" / "tiny.yaml")  # sparsities 0.5, 0.9
    scopes = defaultdict(str)
    refined = expand_cells(refine_spec(spec, [0.7]), scopes)  # the refinement round's cells
    coarse = expand_cells(spec, scopes)
    meta = {"spec": json.loads(json.dumps(spec.to_dict(), default=list)), "refinements": [{"sparsities": [0.7]}]}
    cells = {refined[0].cell_id: "main", coarse[0].cell_id: "main"}
    plan = {"cells": cells, "boxes": {"main": {"lr": [1e-3, 1e-2], "epochs": [3, 5]}}, "round": 1}
    got = expand_cells(round_spec(meta, plan, {c: 2 for c in cells}), scopes)
    assert {c.cell_id for c in got} == set(cells) and {c.sparsity for c in got} == {0.7, coarse[0].sparsity}
    assert expand_cells(widen_spec(spec, plan, {c: 2 for c in cells}), scopes) == [coarse[0]]  # the old spec's
