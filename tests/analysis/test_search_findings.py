"""The report under the new search options (docs/methods.md#search): winners picked by heldout_align, boundary
flags of a steps-based search, no budget warning for it, widened cells named; orchestrator/lifecycle/widen.py's boxes."""
from __future__ import annotations

import pandas as pd
import pytest

from analysis.findings import _budget_warning, boundary, edges, findings
from analysis.search_space import search_bounds, widened_cells
from analysis.runs import best_per_cell
from orchestrator.lifecycle.widen import union_box, widened_box


def _trials():
    # cell a: selection picks trial 0, heldout_align (lower is better) picks trial 2; cell b: no heldout value
    rows = [("a", 0, 0.90, 0.30), ("a", 1, 0.80, 0.20), ("a", 2, 0.70, 0.10), ("b", 0, 0.5, None)]
    return pd.DataFrame([dict(run_id=f"{c}{n}", status="FINISHED", cell_id=c, optuna_trial=n, epochs=2,
                              selection_acc=s, heldout_align=h) for c, n, s, h in rows]).astype(
        {"epochs": "Int64", "optuna_trial": "Int64"})


def test_best_per_cell_follows_the_objective():
    t = _trials()
    assert list(best_per_cell(t)["run_id"]) == ["a0", "b0"]
    assert list(best_per_cell(t, "heldout_align")["run_id"]) == ["a2", "b0"]  # b: no value ranks last, still kept
    with pytest.raises(ValueError, match="objective must be one of"):
        best_per_cell(t, "healed_acc")


def test_steps_boundary_and_bounds_from_the_spec():
    b = {"lr": [1e-4, 1e-2], "steps": [4, 64]}
    assert boundary({"lr": 1e-3, "steps": 64, "epochs": 32}, b) == "64 of 64 steps"
    assert edges({"lr": 9e-3, "steps": 10}, b) == {"lr_cap": "lr 0.009 at the 0.01 cap"}
    spec = {"search": {"lr": [1e-4, 1e-2], "steps": [4, 64], "epochs": None},
            "grids": [{"name": "e", "search": {"epochs": [1, 8], "steps": None}}, {"name": "plain"}]}
    assert search_bounds(spec) == {"main": b, "e": {"lr": [1e-4, 1e-2], "epochs": [1, 8]}, "plain": b}


def _best(steps):
    return pd.DataFrame([dict(cell_id=f"c{n}", pruner="magnitude", healer="starfish", pattern="0.9", calib_size=n,
                              seed=0, lr=1e-3, batch_size=32, steps=steps, epochs=2, sparsity=0.9, healed_acc=0.8,
                              search_boundary="") for n in (64, 256)])


def test_budget_warning_only_for_an_epochs_search():
    assert "64 images: 2 steps/epoch (batch 32), 256 images: 8 steps/epoch" in _budget_warning(_best(None))
    assert _budget_warning(_best(16)) == ""


def test_findings_say_label_free_and_name_widened_cells():
    (f,) = findings(_best(16), "m", [], None, {}, None, objective="heldout_align",
                    widened={"c64": "round 1: lr 0.0004–0.04, steps 4–64"})
    assert f.notes[0].startswith("Winners were picked label-free")
    assert f.notes[-1] == ("Widened search: 1 cell(s) whose winner sat on the search boundary were searched past "
                           "it (search.widen): magnitude/starfish 0.9 n=64 seed 0 (round 1: lr 0.0004–0.04, "
                           "steps 4–64).")
    (g,) = findings(_best(16), "m", [], None, {})
    assert f.notes[1] == g.notes[0] and len(g.notes) == 1  # what is quoted and how sure, on every grid
    assert g.notes[0].startswith("Quoted numbers are each cell's best search trial (no re-evaluation: noise not "
                                 "measured)")


def test_widened_box_shifts_past_the_edges_hit():
    b = {"lr": [1e-4, 3e-3], "epochs": [1, 8]}
    assert widened_box(b, {"lr_cap"}, 4, 100) == {"lr": [pytest.approx(4e-4), pytest.approx(1.2e-2)],
                                                  "epochs": [1, 8]}
    assert widened_box(b, {"lr_floor", "length_cap"}, 4, 100) == {"lr": [pytest.approx(2.5e-5),
                                                                         pytest.approx(7.5e-4)], "epochs": [4, 32]}
    assert widened_box(b, {"lr_floor", "lr_cap"}, 2, 100)["lr"] == [pytest.approx(5e-5), pytest.approx(6e-3)]
    assert widened_box({"lr": [1e-3, 1e-2], "steps": [8, 64]}, {"length_cap"}, 4, 100)["steps"] == [32, 100]
    # the spec's lr bound (orchestrator/spec/checks.py MAX_LR = 10): rounds compounding past it asked for lr 80
    assert widened_box({"lr": [1.0, 5.0], "epochs": [1, 4]}, {"lr_cap"}, 4, 100)["lr"] == [2.0, 10.0]
    at_bound = {"lr": [2.0, 10.0], "epochs": [1, 4]}
    assert widened_box(at_bound, {"lr_cap"}, 4, 100) == at_bound  # nothing left to widen: plan_widening drops it
    assert widened_box(at_bound, {"lr_cap", "lr_floor"}, 4, 100)["lr"] == [0.5, 10.0]
    assert union_box([b, {"lr": [2e-4, 1e-2], "epochs": [2, 16]}]) == {"lr": [1e-4, 1e-2], "epochs": [1, 16]}
    meta = {"widenings": [{"round": 1, "cells": {"c1": b}}, {"round": 2, "cells": {"c1": {"lr": [1, 2], "epochs": [1, 2]}}}]}
    assert widened_cells(meta) == {"c1": {"round": 2, "lr": [1, 2], "epochs": [1, 2]}}


def test_a_boundary_tag_left_on_a_former_winner_is_cleared(tmp_path):
    """A resume, refine round or widening finds a better trial: the old winner's ``search_boundary`` "true" tag
    stayed on a run that no longer wins (the report listed no boundary winner, MLflow one)."""
    from mlflow import MlflowClient

    from analysis.runs import ROLE_TAG, load_trials
    from analysis.search_space import flag_boundary

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(uri)
    exp = client.create_experiment("healsweep")
    ids = {}
    for name, lr in (("old", 1e-2), ("new", 1e-3)):  # old: at the 0.01 cap, a winner once; new: inside the box
        run = client.create_run(exp, tags={"sweep_id": "s", ROLE_TAG: "trial", "cell_id": "c", "trial_id": name})
        client.log_param(run.info.run_id, "lr", lr)
        client.set_terminated(run.info.run_id)
        ids[name] = run.info.run_id
    client.set_tag(ids["old"], "search_boundary", "true")
    client.set_tag(ids["old"], "search_boundary_reason", "lr 0.01 at the 0.01 cap")
    trials = load_trials(uri, "s", "healsweep")
    tagged = trials.loc[trials["boundary_tag"] == "true", "run_id"]
    assert list(tagged) == [ids["old"]]
    best = pd.DataFrame([dict(run_id=ids["new"], cell_id="c", lr=1e-3, steps=16, epochs=2, grid="main")])
    out = flag_boundary(best, {"main": {"lr": [1e-4, 1e-2], "steps": [4, 64]}}, uri, tagged=tagged)
    assert list(out["search_boundary"]) == [""]
    old, new = (client.get_run(ids[k]).data.tags for k in ("old", "new"))
    assert old["search_boundary"] == new["search_boundary"] == "false" and "search_boundary_reason" not in old
    client.set_tag(ids["new"], "search_boundary", "true")  # a report with no search box to hold them to (early
    client.set_tag(ids["new"], "search_boundary_reason", "x")  # return) left every earlier "true" in place
    flag_boundary(best, None, uri, tagged=[ids["new"]])
    new = client.get_run(ids["new"]).data.tags
    assert new["search_boundary"] == "false" and "search_boundary_reason" not in new
