"""search.objective, search.steps, search.widen and the cells filter: accepted, refused in one line naming the
field, and what the searcher makes of them (docs/methods.md#search)."""
from __future__ import annotations

import copy
import json
import math
from pathlib import Path

import pytest
import yaml

from orchestrator.spec import SpecError, parse_spec
from orchestrator.spec.checks import OBJECTIVES

REPO = Path(__file__).resolve().parents[2]
BASE = yaml.safe_load((REPO / "configs" / "tiny.yaml").read_text())


def spec(search=None, **top):
    d = copy.deepcopy(BASE)
    if search is not None:
        d["search"] = search
    d.update(top)
    return d


def refused(d) -> str:
    with pytest.raises(SpecError) as e:
        parse_spec(d)
    return str(e.value)


def test_objectives_and_their_directions_are_the_ones_analysis_ranks_by():
    """analysis may not import orchestrator, so it keeps its own copy of the spec's objectives: the two agree."""
    from analysis.runs import OBJECTIVE_MODES

    assert OBJECTIVES == OBJECTIVE_MODES


def test_heldout_align_objective_accepted_and_refused_where_it_cannot_be_measured():
    s = parse_spec(spec({"objective": "heldout_align", "lr": [1e-3, 3e-3], "epochs": [1, 2]}))
    assert s.search.objective == "heldout_align"
    assert refused(spec({"objective": "eval_acc"})) == \
        "search.objective: must be selection_acc or heldout_align, got 'eval_acc'"
    assert refused(spec({"objective": "heldout_align", "scheduler": "asha"})).startswith(
        "search.objective: heldout_align is measured once, after healing; scheduler 'asha'")
    # digits: 320 calibration images, the last 64 held out -> a calibration size above 256 leaves none
    msg = refused(spec({"objective": "heldout_align"}, calib_sizes=[64, 300]))
    assert msg.startswith("calib_sizes[1]: 300 leaves no held-out calibration images") and "\n" not in msg
    assert parse_spec(spec({}, calib_sizes=[300])).calib_sizes == (300,)  # selection_acc needs no held-out slice
    grid = {"name": "big", "calib_sizes": [320]}
    assert refused(spec({"objective": "heldout_align"}, grids=[grid])).startswith("grids[0].calib_sizes[0]: 320")


def test_steps_replace_epochs_and_are_validated():
    s = parse_spec(spec({"steps": [4, 32]}))
    assert s.search.steps == (4, 32) and s.search.epochs is None and s.search.length == ("steps", (4, 32))
    # a search without a length: the default sweep's design, steps 4..64 (epochs 1..8 with scheduler asha)
    default = parse_spec(spec({})).search
    assert (default.length, default.lr, default.trials_per_cell) == (("steps", (4, 64)), (1e-4, 1e-2), 3)
    assert parse_spec(spec({"epochs": [2, 5]})).search.length == ("epochs", (2, 5))  # epochs given: no default steps
    assert parse_spec(spec({"scheduler": "asha"})).search.length == ("epochs", (1, 8))
    for s_ in (default, parse_spec(spec({"epochs": [2, 5]})).search):  # what sweep.json holds reads back the same
        assert parse_spec(json.loads(json.dumps(spec({}) | {"search": {k: getattr(s_, k) for k in (
            "trials_per_cell", "lr", "epochs", "steps")}}, default=list))).search.length == s_.length
    assert refused(spec({"steps": [4, 32], "epochs": [1, 8]})) == \
        "search.steps: give either search.steps (optimizer steps) or search.epochs, not both"
    assert refused(spec({"steps": [0, 4]})) == "search.steps[0]: must be >= 1, got 0"
    assert refused(spec({"steps": [8, 4]})) == "search.steps[1]: must be >= 8, got 4"
    assert refused(spec({"steps": [4, 8], "scheduler": "asha"})).startswith("search.steps: scheduler 'asha' stops")
    again = parse_spec(json.loads(json.dumps(s.to_dict(), default=list)))  # what sweep.json holds
    assert again.search == s.search


def test_a_grid_may_switch_between_steps_and_epochs():
    grids = [{"name": "g", "calib_sizes": [64], "search": {"steps": [2, 6]}}]
    s = parse_spec(spec({"epochs": [1, 3]}, grids=grids))
    from orchestrator.spec.plan import grid_searches

    searches = grid_searches(s)
    assert searches["main"].length == ("epochs", (1, 3)) and searches["g"].length == ("steps", (2, 6))
    s2 = parse_spec(spec({"steps": [2, 6]}, grids=[{"name": "g", "search": {"epochs": [1, 3]}}]))
    assert grid_searches(s2)["g"].length == ("epochs", (1, 3))
    again = parse_spec(json.loads(json.dumps(s.to_dict(), default=list)))
    assert grid_searches(again)["g"].length == ("steps", (2, 6))


def test_widen_and_cells():
    assert parse_spec(spec({"widen": {"rounds": 2, "factor": 3}})).search.widen == {"rounds": 2, "factor": 3.0}
    assert parse_spec(spec({"widen": {}})).search.widen == {"rounds": 1, "factor": 4.0}
    assert refused(spec({"widen": {"rounds": 0}})) == "search.widen.rounds: must be >= 1, got 0"
    assert refused(spec({"widen": {"factor": 1}})) == "search.widen.factor: must be > 1.0, got 1"
    assert refused(spec({"widen": {"factr": 2}})).startswith("search.widen.factr: unknown key")
    assert refused(spec({}, cells=["xyz"])) == "cells[0]: must be a cell id (12 hex digits), got 'xyz'"
    from orchestrator.spec.plan import expand_cells

    full = parse_spec(spec({}))
    every = expand_cells(full, {"vit_digits": "mlp"})
    assert len(every) == 4
    only = parse_spec(spec({}, cells=[every[2].cell_id]))
    assert [c.cell_id for c in expand_cells(only, {"vit_digits": "mlp"})] == [every[2].cell_id]


def _searcher(tmp_path, search, cells):
    from orchestrator.search import PerCellOptunaSearch, search_kwargs

    s = parse_spec(spec(search))
    return PerCellOptunaSearch(cells, s.search.trials_per_cell, s.search.lr, s.search.epochs or (1, 1),
                               s.search.sampler_seed, tmp_path / "j.journal", **search_kwargs(s.search))


def test_searcher_minimises_heldout_align_and_searches_steps(tmp_path):
    cells = [{"cell_id": "a" * 12, "healer": "starfish", "healer_settings": {}, "calib_size": 64, "batch_size": 32},
             {"cell_id": "b" * 12, "healer": "starfish", "healer_settings": {}, "calib_size": 256, "batch_size": 32},
             {"cell_id": "c" * 12, "healer": "none", "healer_settings": {}, "calib_size": 64, "batch_size": 32}]
    se = _searcher(tmp_path, {"objective": "heldout_align", "steps": [3, 40], "trials_per_cell": 2, "design": "tpe",
                              "reevaluate": 0}, cells)
    assert se.metric == "heldout_align" and se.mode == "min" and se.total == 5  # `none`: one trial
    assert se.study("a" * 12).direction.name == "MINIMIZE"
    configs = [se.suggest(str(i)) for i in range(3)]  # trial 0 of every cell; trial 1s wait for their cell's tell
    assert se.suggest("x") is None
    for i, c in enumerate(configs[:2]):
        se.on_trial_complete(str(i), {"heldout_align": 0.25 + i, "epoch": c["epochs"], "final": True})
    configs += [se.suggest(str(i)) for i in (3, 4)]
    for c in configs:
        if c["healer"] == "none":
            assert (c["lr"], c["epochs"]) == (0.0, 0) and "steps" not in c
            continue
        assert 3 <= c["steps"] <= 40 and c["epochs"] == math.ceil(c["steps"] / math.ceil(c["calib_size"] / 32))
    assert configs[0]["cell_id"] == "a" * 12
    (t,) = [t for t in se.study("a" * 12).trials if t.value is not None]
    assert t.value == 0.25 and se.study("a" * 12).best_value == 0.25


@pytest.mark.parametrize("search, msg", [
    ({"reevaluate": 9}, "search.reevaluate: must be"),
    ({"reevaluate": -1}, "search.reevaluate: must be"),
    ({"design": "random"}, "search.design: must be"),
    ({"trials_per_cell": 46, "epochs": [1, 8]}, "search.trials_per_cell: the box has 45 distinct lattice point(s); "
                                                "design 'shared'"),
    # a box with fewer distinct points than trials: validate passed it and `run` died in the searcher's first wave
    # (ValueError: no free lattice point left)
    ({"trials_per_cell": 3, "lr": [2e-3, 2e-3], "epochs": [3, 3]},
     "search.trials_per_cell: the box has 1 distinct lattice point(s) (1 lr x 1 length values"),
    ({"trials_per_cell": 11, "lr": [1e-3, 3e-3], "epochs": [3, 4], "lattice": [5, 5]},
     "search.trials_per_cell: the box has 10 distinct lattice point(s) (5 lr x 2 length values"),
    ({"trials_per_cell": 3, "explore": 4}, "search.explore: first-wave points (4) cannot exceed"),
    ({"design": "shared", "scheduler": "asha"}, "search.design: scheduler 'asha' stops trials by timing"),
    ({"lattice": [9]}, "search.lattice: must be [lr points, length points]"),
    ({"lattice": [9, 65]}, "search.lattice[1]: must be"),
])
def test_search_designs_refuse_what_they_cannot_do_in_one_line(search, msg):
    text = refused(spec({**BASE["search"], **search}))
    assert text.startswith(msg) and "\n" not in text


def test_design_defaults_and_one_design_per_sweep():
    s = parse_spec(spec({**BASE["search"], "reevaluate": 2, "trials_per_cell": 1}))
    assert (s.search.design, s.search.reevaluate, s.search.explore, s.search.lattice) == ("shared", 2, 1, (9, 5))
    assert parse_spec(spec({**BASE["search"], "scheduler": "asha"})).search.design == "tpe"  # ASHA needs tpe
    grid = {"name": "g", "search": {"design": "tpe"}}
    assert refused(spec(None, grids=[grid])).startswith("grids[0].search.design")
