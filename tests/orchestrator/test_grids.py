"""Extra grids (`grids:` in a spec, orchestrator/spec/grids.py): validation, cell union, per-grid search budgets."""
from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import yaml

from orchestrator.cli import main
from orchestrator.spec.plan import expand_cells, grid_searches
from orchestrator.search import PerCellOptunaSearch
from orchestrator.spec import SpecError, load_spec, parse_spec

REPO = Path(__file__).resolve().parents[2]
TINY = yaml.safe_load((REPO / "configs" / "tiny.yaml").read_text())  # vit_digits, magnitude x starfish, 2 trials
SCOPES = {"vit_digits": "qkv_out_mlp", "resnet_digits": "conv"}
HEALERS = {"name": "healers", "sparsities": [0.9], "calib_sizes": [64], "healers": ["starfish", "mse", "none"],
           "seeds": [0, 1], "search": {"trials_per_cell": 3, "lr": [5e-3, 1e-2], "epochs": [6, 7]}}


def with_grids(*grids, **top):
    return {**copy.deepcopy(TINY), **top, "grids": [copy.deepcopy(g) for g in grids]}


def test_grid_inherits_what_it_leaves_out_and_overrides_search_key_by_key():
    spec = parse_spec(with_grids(HEALERS))
    (g,) = spec.grids
    assert (g.name, g.models, g.pruners, g.sparsities, g.calib_sizes) == ("healers", None, None, (0.9,), (64,))
    assert [h.name for h in g.healers] == ["starfish", "mse", "none"] and g.seeds == (0, 1)
    searches = grid_searches(spec)
    assert searches["main"] == spec.search
    assert (searches["healers"].trials_per_cell, searches["healers"].lr, searches["healers"].epochs) == (3, (5e-3, 1e-2), (6, 7))
    assert searches["healers"].sampler_seed == spec.search.sampler_seed  # not overridden: inherited
    assert parse_spec(with_grids()) == parse_spec(copy.deepcopy(TINY))  # `grids: []` = no extra grid


def test_cells_are_the_union_main_grid_first_and_shared_cells_run_once():
    # main: magnitude x {0.5, 0.9} x calib {128, 256} x starfish x seed 0 = 4 cells
    # healers: magnitude x 0.9 x calib 64 x {starfish, mse, none} x seeds {0, 1} = 6 cells
    # overlap: a grid listing the main grid's (0.9, 128, starfish, seed 0) cell adds nothing for it
    overlap = {"name": "overlap", "sparsities": [0.9], "calib_sizes": [128], "seeds": [0, 1]}
    spec = parse_spec(with_grids(HEALERS, overlap))
    cells = expand_cells(spec, SCOPES)
    assert len(cells) == 4 + 6 + 1 and len({c.cell_id for c in cells}) == len(cells)
    assert [c.grid for c in cells] == ["main"] * 4 + ["healers"] * 6 + ["overlap"]
    assert {(c.calib_size, c.seed) for c in cells if c.grid == "overlap"} == {(128, 1)}
    assert {(c.healer, c.seed) for c in cells if c.grid == "healers"} == {
        (h, s) for h in ("starfish", "mse", "none") for s in (0, 1)}
    # the grid is not part of a cell's identity: the same cell in another grid keeps its id (journal, masks)
    main_only = {c.cell_id for c in expand_cells(parse_spec(copy.deepcopy(TINY)), SCOPES)}
    assert main_only == {c.cell_id for c in cells if c.grid == "main"}


def test_search_gives_each_grid_its_budget_and_space(tmp_path):
    healers = {**HEALERS, "search": {**HEALERS["search"], "reevaluate": 2}}
    spec = parse_spec(with_grids(healers))
    cells = [{**c.identity(), "cell_id": c.cell_id, "grid": c.grid} for c in expand_cells(spec, SCOPES)]
    s = PerCellOptunaSearch(cells, spec.search.trials_per_cell, spec.search.lr, spec.search.epochs, 0,
                            tmp_path / "j", grids=grid_searches(spec))
    # main 4 cells x 2 trials + healers: 4 training cells x 3 trials + 2 `none` cells x 1 trial; the healers
    # grid re-evaluates each training cell's winner on 2 fresh healing seeds (its search.reevaluate; the main
    # grid's, from tiny.yaml, is 0), `none` cells are not
    assert s.total == 8 + 12 + 2 + 2 * 4
    cfgs = []
    for i in range(s.total):  # told at once: a cell's TPE asks wait for its earlier trials
        cfgs.append(s.suggest(f"t{i}"))
        s.on_trial_complete(f"t{i}", {"selection_acc": 0.5, "final": True, "epoch": cfgs[-1]["epochs"]})
    assert s.suggest("extra") is PerCellOptunaSearch.FINISHED
    by_grid = {g: [c for c in cfgs if c["grid"] == g] for g in ("main", "healers")}
    assert all(1e-3 <= c["lr"] <= 3e-3 and 3 <= c["epochs"] <= 5 for c in by_grid["main"])
    again = [c for c in cfgs if c["stage"] == "reevaluate"]
    assert len(again) == 8 and all(c["heal_seed"] in (1000 + c["seed"], 2000 + c["seed"]) for c in again)
    trained = [c for c in by_grid["healers"] if c["healer"] != "none" and c["stage"] == "search"]
    assert len(trained) == 12 and all(5e-3 <= c["lr"] <= 1e-2 and c["epochs"] in (6, 7) for c in trained)
    assert all((c["lr"], c["epochs"]) == (0.0, 0) for c in by_grid["healers"] if c["healer"] == "none")
    spaces = {c["grid"]: s.study(c["cell_id"]).trials[0].distributions["lr"] for c in trained[:1] + by_grid["main"][:1]}
    assert (spaces["healers"].low, spaces["main"].low) == (5e-3, 1e-3)


@pytest.mark.parametrize("grid, field, words", [
    ({"sparsities": [0.9]}, "grids[0].name", "required key is missing"),
    ({"name": "main"}, "grids[0].name", "used twice"),
    ({"name": "a b"}, "grids[0].name", "letters, digits"),
    ({"name": "g", "dataset": "digits"}, "grids[0].dataset", "unknown key"),
    ({"name": "g", "models": ["resnet_digits"]}, "grids[0].models[0]", "not a model of this sweep"),
    ({"name": "g", "sparsities": [1.5]}, "grids[0].sparsities[0]", "must be < 1.0"),
    ({"name": "g", "calib_sizes": [999]}, "grids[0].calib_sizes[0]", "must be <= 320"),
    ({"name": "g", "healers": ["magic"]}, "grids[0].healers[0].name", "unknown healer 'magic'"),
    ({"name": "g", "healers": ["corp"]}, "grids[0].healers[0].name",
     "healer 'corp' with pruner 'magnitude' on model 'vit_digits'"),  # names both sides, as at the top level
    ({"name": "g", "search": {"lr": [1e-2, 1e-3]}}, "grids[0].search.lr[1]", "must be >= 0.01"),
    ({"name": "g", "search": {"scheduler": "asha"}}, "grids[0].search.scheduler", "unknown key"),
    ({"name": "g", "seeds": [-1]}, "grids[0].seeds[0]", "must be >= 0"),
])
def test_bad_grids_name_the_field(grid, field, words):
    with pytest.raises(SpecError) as e:
        parse_spec(with_grids(grid))
    assert e.value.path == field and words in str(e.value) and "\n" not in str(e.value)


def test_two_grids_with_one_name_and_asha_epochs_are_rejected():
    with pytest.raises(SpecError) as e:
        parse_spec(with_grids({"name": "g"}, {"name": "g"}))
    assert e.value.path == "grids[1].name"
    with pytest.raises(SpecError) as e:
        parse_spec(with_grids({"name": "g", "search": {"epochs": [2, 4]}}, search={**TINY["search"], "scheduler": "asha"}))
    assert e.value.path == "grids[0].search.epochs" and "asha" in str(e.value)


def test_default_spec_round_trips_through_sweep_json():
    spec = load_spec(REPO / "configs" / "default.yaml")
    again = parse_spec(json.loads(json.dumps(spec.to_dict(), default=list)))  # what refine reads back
    assert again == spec
    assert [c.cell_id for c in expand_cells(again, SCOPES)] == [c.cell_id for c in expand_cells(spec, SCOPES)]


def test_default_sweep_holds_the_healer_comparison(capsys):
    spec = load_spec(REPO / "configs" / "default.yaml")
    cells = [c for c in expand_cells(spec, SCOPES) if c.grid == "healers"]
    want = {(s, h, seed) for s in (0.85, 0.9, 0.95) for h in ("starfish", "mse", "kl", "ce", "starfish_kl", "none")
            for seed in (0, 1, 2)}
    assert {(c.sparsity, c.healer, c.seed) for c in cells} == want
    assert {(c.model, c.pruner, c.calib_size) for c in cells} == {("vit_digits", "magnitude", 128)}
    assert main(["validate", str(REPO / "configs" / "default.yaml")]) == 0
    out = capsys.readouterr().out
    # main: 50 starfish cells x (3 search + 2 re-evaluations) + 50 crbn cells x (1 + 1 on each of the 2 other
    # calibration draws: CR+BN reads the images); healers: 45 training cells x (3 + 2) + 9 `none` cells (magnitude
    # masks: no draw changes them, 1 trial each)
    assert "154 cells, 634 trials (59 cells whose healer does not train run 1 trial, 50 of them also once on each of their " in out
    assert "grid main: 100 cells, 400 trials; grid healers: 54 cells, 234 trials" in out


def test_a_grid_on_fewer_models_narrows_inherited_entries_and_scopes():
    two = {"models": ["vit_digits", "resnet_digits"], "scope": {"resnet_digits": "conv"},
           "pruners": ["magnitude", {"name": "erk", "models": ["resnet_digits"]},
                       {"name": "corp", "models": ["vit_digits"], "scope": "mlp_qk"}],
           "healers": ["starfish", {"name": "crbn", "models": ["resnet_digits"]},
                       {"name": "none", "models": ["vit_digits", "resnet_digits"]}]}
    spec = parse_spec(with_grids({"name": "vit", "models": ["vit_digits"], "sparsities": [0.7]}, **two))
    cells = [c for c in expand_cells(spec, SCOPES) if c.grid == "vit"]
    # erk and crbn are restricted to the ResNet: not inherited by a ViT-only grid; corp keeps its ViT entry,
    # none its ViT half
    assert {(c.model, c.pruner, c.healer) for c in cells} == {
        ("vit_digits", p, h) for p in ("magnitude", "corp") for h in ("starfish", "none")}
    (g,) = spec.grids
    assert g.pruners is None and g.healers is None  # inherited, narrowed only in the view
    with pytest.raises(SpecError) as e:
        parse_spec(with_grids({"name": "r", "models": ["resnet_digits"]},
                              **{**two, "pruners": [{"name": "corp", "models": ["vit_digits"], "scope": "mlp_qk"}]}))
    assert e.value.path == "grids[0].pruners" and "no top-level pruner entry applies" in str(e.value)
