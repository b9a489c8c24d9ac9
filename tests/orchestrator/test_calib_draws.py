"""search.calib_draws: re-evaluations heal on other calibration draws (orchestrator/sweep/draws.py). The spec key,
the draws' seeds, what the searcher hands a re-evaluation (its draw's targets, mask and images; search trials keep
the sweep's own) and the trial config built from a prepared draw."""
from __future__ import annotations

import copy
import json
from pathlib import Path

import yaml

from orchestrator.search.records import draw_of_reevaluation, reevaluation_draws
from orchestrator.spec import parse_spec
from orchestrator.spec.plan import expand_cells
from orchestrator.sweep.draws import Draw, draw_specs, store_keys, trial_overrides
from orchestrator.sweep.model_facts import ModelInfo
from tests.orchestrator.test_search_spec import refused

REPO = Path(__file__).resolve().parents[2]
BASE = yaml.safe_load((REPO / "configs" / "tiny.yaml").read_text())


def spec(search: dict | None = None, **top) -> dict:
    d = copy.deepcopy(BASE)
    d["search"] = {**d["search"], "reevaluate": 2, **(search or {})}
    d.update(top)
    return d


def test_calib_draws_default_off_and_bounded_by_the_reevaluations():
    assert parse_spec(spec()).search.calib_draws == 0  # every trial on the sweep's own draw, as before
    assert parse_spec(spec({"calib_draws": 2})).search.calib_draws == 2
    assert parse_spec(spec({"calib_draws": 1})).search.calib_draws == 1
    text = refused(spec({"calib_draws": 3}))
    assert text.startswith("search.calib_draws: 3 draws, but the winners are re-evaluated at most 2") and "\n" not in text
    assert refused(spec({"calib_draws": 1, "reevaluate": 0})).startswith("search.calib_draws: 1 draws, but")
    assert refused(spec({"calib_draws": -1})).startswith("search.calib_draws: must be")
    assert refused(spec({"calib_draws": "2"})).startswith("search.calib_draws: must be")
    # search.converge: up to reevaluate_max re-evaluations, so up to that many draws
    conv = {"design": "shared", "trials_per_cell": 3, "converge": {"reevaluate_max": 5}, "calib_draws": 5}
    assert parse_spec(spec(conv)).search.calib_draws == 5
    assert refused(spec({**conv, "calib_draws": 6})).startswith("search.calib_draws: 6 draws, but the winners are "
                                                                 "re-evaluated at most 5")


def test_the_key_survives_the_sweep_record():
    s = parse_spec(spec({"calib_draws": 2}))
    again = parse_spec(json.loads(json.dumps(s.to_dict(), default=list)))  # what resume and refine read back
    assert again.search.calib_draws == 2


def test_draw_seeds_are_never_the_sweeps_own_nor_those_of_the_next_calib_seed():
    assert reevaluation_draws(0, 3) == [1000, 2000, 3000]
    assert reevaluation_draws(4, 2) == [1004, 2004]
    for k in range(5):  # a retest on calib_seed + 1 (bench_retest run D) shares no draw with the sweep it retests
        mine, nxt = {k, *reevaluation_draws(k, 8)}, {k + 1, *reevaluation_draws(k + 1, 8)}
        assert not mine & nxt
    assert [draw_of_reevaluation(n, 2) for n in range(5)] == [0, 1, 0, 1, 0]
    assert draw_of_reevaluation(3, 0) is None
    from orchestrator.search.records import reevaluation_index, reevaluation_seeds

    for seed in (0, 7, 999, 1001):  # the draw of a re-evaluation follows its rank among its configuration's
        assert [reevaluation_index(seed, h) for h in reevaluation_seeds(seed, 4)] == [0, 1, 2, 3]


def test_draw_specs_are_the_sweep_at_each_draws_calib_seed():
    s = parse_spec(spec({"calib_draws": 2}, calib_seed=3))
    ds = draw_specs(s)
    assert [d.calib_seed for d in ds] == [1003, 2003]
    assert all(d.search == s.search and d.models == s.models and d.data_seed == s.data_seed for d in ds)
    assert [d.load_kwargs("vit_digits") for d in ds] == [{"calib_seed": 1003}, {"calib_seed": 2003}]
    assert draw_specs(parse_spec(spec())) == []


def _info(key: str) -> ModelInfo:
    return ModelInfo("vit_digits", "d" * 64, 0.9, "all", ("block0",), key, "c" * 16)


def test_trial_overrides_move_a_reevaluation_onto_the_draw():
    s = parse_spec(spec({"calib_draws": 1}))
    cells = expand_cells(s, {"vit_digits": "all"})
    d = Draw(draw_specs(s)[0], {"vit_digits": _info("k" * 32)}, {c.cell_id: f"m{i}" for i, c in enumerate(cells)})
    over = trial_overrides(d, cells, 0)
    assert set(over) == {c.cell_id for c in cells}
    for i, c in enumerate(cells):
        assert over[c.cell_id] == {"store_key": "k" * 32, "mask_key": f"m{i}", "load_kw": {"calib_seed": 1000},
                                   "calib_draw": 0}
    assert store_keys([d]) == {"vit_digits@1000": "k" * 32}
    # a cell the draw has no mask for (a closed-form cell no draw changes: never re-evaluated) gets no override
    part = Draw(d.spec, d.models, {cells[0].cell_id: "m0"})
    assert set(trial_overrides(part, cells, 1)) == {cells[0].cell_id}


CELL = {"cell_id": "a" * 12, "healer": "starfish", "healer_settings": {}, "calib_size": 64, "batch_size": 32,
        "seed": 0, "store_key": "own", "mask_key": "own-mask", "load_kw": {}}


def test_searcher_hands_each_reevaluation_its_draw_and_search_trials_the_sweeps_own(tmp_path):
    from orchestrator.search import PerCellOptunaSearch

    draws = [{"a" * 12: {"store_key": f"k{j}", "mask_key": f"m{j}", "load_kw": {"calib_seed": 1000 * (j + 1)},
                         "calib_draw": j}} for j in range(2)]
    se = PerCellOptunaSearch([CELL], 2, (1e-3, 1e-2), (1, 1), 0, tmp_path / "j.journal", steps=(4, 16),
                             design="tpe", reevaluate=3, draws=draws)
    seen = []
    for i in range(5):  # 2 search trials, then 3 re-evaluations of the winner
        c = se.suggest(str(i))
        seen.append(c)
        se.on_trial_complete(str(i), {"selection_acc": 0.5 + 0.01 * i, "epoch": 1, "final": True})
    search, again = seen[:2], seen[2:]
    assert [c["stage"] for c in search] == ["search"] * 2 and [c["stage"] for c in again] == ["reevaluate"] * 3
    assert all((c["store_key"], c["mask_key"], c["load_kw"]) == ("own", "own-mask", {}) and "calib_draw" not in c
               for c in search)
    assert [(c["calib_draw"], c["store_key"], c["mask_key"], c["load_kw"]) for c in again] == [
        (0, "k0", "m0", {"calib_seed": 1000}), (1, "k1", "m1", {"calib_seed": 2000}),
        (0, "k0", "m0", {"calib_seed": 1000})]  # cycling: re-evaluation n on draw n mod 2
    assert [c["heal_seed"] for c in again] == [1000, 2000, 3000]  # healing seeds as without draws
    assert len({(c["lr"], c["steps"]) for c in again}) == 1  # the winner's configuration on every draw


def test_a_closed_form_cell_heals_once_on_each_draw_that_can_change_it(tmp_path):
    """CR+BN reads the calibration images: one search trial on the sweep's draw, then one re-evaluation on each other
    draw (2, not the budget's 3: nothing is searched, so a draw twice says nothing new); ``none`` on a magnitude mask
    reads none: one trial, no draw (prepare_draw gives the draws no mask for it)."""
    from orchestrator.search import PerCellOptunaSearch

    crbn = {**CELL, "cell_id": "c" * 12, "healer": "crbn"}
    inert = {**CELL, "cell_id": "n" * 12, "healer": "none"}
    draws = [{"c" * 12: {"store_key": f"k{j}", "mask_key": f"m{j}", "load_kw": {"calib_seed": 1000 * (j + 1)},
                         "calib_draw": j}} for j in range(2)]
    se = PerCellOptunaSearch([crbn, inert], 2, (1e-3, 1e-2), (1, 1), 0, tmp_path / "j.journal", steps=(4, 16),
                             design="tpe", reevaluate=3, draws=draws)
    assert se.design.planned == 4  # crbn: 1 + 2, none: 1
    seen = []
    for i in range(5):
        c = se.suggest(str(i))
        if c is None or c == se.FINISHED:
            break
        seen.append(c)
        se.on_trial_complete(str(i), {"selection_acc": 0.5, "epoch": 0, "final": True})
    got = sorted((c["cell_id"][0], c["stage"], c.get("calib_draw"), c.get("heal_seed"), c["store_key"]) for c in seen)
    assert got == [("c", "reevaluate", 0, 1000, "k0"), ("c", "reevaluate", 1, 2000, "k1"), ("c", "search", None, None, "own"),
                   ("n", "search", None, None, "own")]
    assert all((c["lr"], c["epochs"]) == (0.0, 0) for c in seen)  # closed form: no lr, no epochs
    noise = se.design.noise()  # search_noise.json: the closed-form cell's own trial counts as one more draw
    assert noise["c" * 12]["reevaluate_n"] == 3 and noise["n" * 12]["reevaluate_n"] == 0


def test_which_cells_the_draws_reevaluate():
    """records.redrawn_cell: a searched cell always; a closed-form one where its healer (CR+BN, CORP) or its mask
    (RR, SnapViT, CORP) reads the calibration images; never ``none`` on magnitude or N:M."""
    from orchestrator.search.records import redrawn_cell

    def cell(healer, pruner):
        return {"healer": healer, "healer_settings": {}, "pruner": pruner}
    assert redrawn_cell(cell("starfish", "magnitude")) and redrawn_cell(cell("ce", "magnitude"))
    assert redrawn_cell(cell("crbn", "magnitude")) and redrawn_cell(cell("corp", "corp"))
    assert redrawn_cell(cell("none", "rr")) and redrawn_cell(cell("none", "snapvit")) and redrawn_cell(cell("none", "corp"))
    assert not redrawn_cell(cell("none", "magnitude")) and not redrawn_cell(cell("none", "nm"))
    assert not redrawn_cell({"pruner": "rr"})  # not a healing cell


def test_without_draws_a_reevaluation_keeps_the_sweeps_own_targets(tmp_path):
    from orchestrator.search import PerCellOptunaSearch

    se = PerCellOptunaSearch([CELL], 1, (1e-3, 1e-2), (1, 1), 0, tmp_path / "j.journal", steps=(4, 16),
                             design="tpe", reevaluate=1)
    c = se.suggest("0")
    se.on_trial_complete("0", {"selection_acc": 0.5, "epoch": 1, "final": True})
    r = se.suggest("1")
    assert r["stage"] == "reevaluate" and (r["store_key"], r["load_kw"]) == (c["store_key"], {}) and "calib_draw" not in r


def test_the_bound_counts_every_grids_reevaluations_and_a_grid_may_reevaluate_less():
    """A grid whose own search re-evaluates less (or not at all) takes what it has of the sweep's draws; the bound
    is the most re-evaluations of any grid, and the refusal names the top-level key a person can change."""
    grid = {"name": "g", "search": {"reevaluate": 0}}
    s = parse_spec(spec({"calib_draws": 2}, grids=[grid]))
    assert s.search.calib_draws == 2 and dict(s.grids[0].search)["reevaluate"] == 0
    only_grid = parse_spec(spec({"reevaluate": 0, "calib_draws": 1}, grids=[{"name": "g", "search": {"reevaluate": 1}}]))
    assert only_grid.search.calib_draws == 1  # only grid g re-evaluates: its re-evaluation heals on the draw
    text = refused(spec({"reevaluate": 0, "calib_draws": 2}, grids=[{"name": "g", "search": {"reevaluate": 1}}]))
    assert text.startswith("search.calib_draws: 2 draws, but the winners are re-evaluated at most 1 time(s)")
