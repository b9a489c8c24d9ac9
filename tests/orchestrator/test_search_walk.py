"""search.converge's walk past the declared lr box (orchestrator/search/converge.py rule 1, ``walk_offsets``): its
waves reach geometrically further out (``widen_growth`` 2), so a cell whose optimum lies far past the box brackets
it within the trial cap; ``widen_growth: 1`` keeps the earlier 1, 2, …, ``batch`` steps. Rule 1c (``bracket``): a
walk from a winner alone at its length also tries the box's middle at that length. No Ray: the Tune
``Searcher`` is driven by hand (tests/orchestrator/test_search_converge.py's driver)."""
from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest

from orchestrator.search import Budget
from orchestrator.search.converge import Converge, walk_offsets
from orchestrator.spec.checks import SpecError
from orchestrator.spec.parse import parse_converge
from orchestrator.sweep.parent import converge_param
from tests.orchestrator.test_search_contract import _cells
from tests.orchestrator.test_search_converge import BUDGET, CONV, drive, make, searched

pytestmark = pytest.mark.timeout(60)


def test_walk_offsets_hand_values():
    # (winner's distance past the box, batch, limit, growth) -> steps from the winner
    assert walk_offsets(0, 2, 6, 2) == [1, 2]  # reach 1, 2
    assert walk_offsets(2, 2, 6, 2) == [1, 4]  # reach 3, 6: the limit in two waves
    assert walk_offsets(1, 2, 6, 2) == [1, 3]  # reach 2, 4
    assert walk_offsets(3, 2, 6, 2) == [1, 3]  # reach 4, 8 -> clipped at the limit 6
    assert walk_offsets(0, 3, 6, 2) == [1, 2, 4]
    assert walk_offsets(5, 2, 6, 2) == [1] and walk_offsets(6, 2, 6, 2) == []  # at the limit: nothing further
    assert walk_offsets(0, 2, 6, 1) == [1, 2] and walk_offsets(2, 2, 6, 1) == [1, 2]  # linear: the earlier rule
    assert walk_offsets(5, 3, 6, 1) == [1]  # linear drops what lies past the limit
    assert walk_offsets(0, 1, 6, 2) == [1]


def _walk(tmp_path, growth: int) -> list[list[float]]:
    """lr asked per cell on a landscape better with every lr step (no optimum within 6 steps past the box)."""
    b = Budget(trials=7, lr=(1e-4, 1e-2), length=("steps", (4, 64)), reevaluate=2, explore=2, lattice=(5, 3),
               converge=Converge(widen_steps=6, widen_growth=growth, bracket=0))  # the walk alone (rule 1c off)
    cells = _cells(2)
    (tmp_path / str(growth)).mkdir()
    s = make(tmp_path / str(growth), cells, b)
    got = drive(s, lambda c: 0.2 + 0.05 * math.log10(c["lr"] / 1e-4) + 0.01 * math.log2(c["steps"] / 4))
    return [[g["lr"] for g in searched(got, c["cell_id"])] for c in cells]


def test_a_walk_past_the_box_reaches_the_widening_limit_within_the_cap(tmp_path):
    limit = 1e-2 * 10 ** (0.5 * 6)  # lattice step 10^0.5 (5 points over two decades), 6 steps past the cap: 10
    doubling, linear = _walk(tmp_path, 2), _walk(tmp_path, 1)
    assert any(max(lrs) == pytest.approx(limit, rel=1e-4) for lrs in doubling)  # 1, 2 then 3, 6 steps out
    assert all(max(lrs) < 0.99 * limit for lrs in linear)  # 1, 2 then 3, 4 then 5 steps: the cap comes first
    for lrs in doubling:
        assert max(lrs) <= limit * 1.0001 and len(lrs) <= 7


def test_widen_growth_is_parsed_and_checked():
    assert parse_converge({"widen_growth": 1}, "shared") == {"widen_growth": 1}
    assert Converge().widen_growth == 2
    with pytest.raises(SpecError, match="widen_growth"):
        parse_converge({"widen_growth": 0}, "shared")


def test_the_parent_run_logs_every_converge_setting_resolved():
    logged = json.loads(converge_param({"widen_growth": 1}))
    assert logged["widen_growth"] == 1 and logged["widen_steps"] == 6 and logged["batch"] == 2  # defaults spelled out
    assert json.loads(converge_param({}))["widen_growth"] == 2 and converge_param(None) == "null"


@pytest.mark.parametrize("bracket", [1, 0])
def test_a_winner_alone_on_the_box_floor_brackets_the_gap_behind_it(tmp_path, bracket):
    """Rule 1c (grid healers' CE cell at 0.85, run A 2026-11-28: its first-wave winner sat alone at its length on
    the box's floor; the walk went 4 trials below the floor and never tried the box's interior, where another
    sampler seed found 3.3 pp more). Every cell peaks inside the box at the budget length: a cell whose first-wave
    winner sits alone on the floor at that length tries the midpoint of the box next, beside the walk's first step,
    and has its optimum by its fourth trial; without the rule (``bracket: 0``) that wave lies below the floor."""
    def obj(c):
        u = math.log10(c["lr"] / 1e-4) * 2  # lattice index: 0 (floor) .. 4 (cap)
        return (0.3 if c["steps"] < 64 else 0.85 - 0.04 * (u - 2) ** 2) + 0.001 * int(c["cell_id"][-1])
    cells = _cells(6)
    s = make(tmp_path, cells, replace(BUDGET, converge=replace(CONV, bracket=bracket)))
    got = drive(s, obj)
    mine = [searched(got, c["cell_id"]) for c in cells]
    floor = [m for m in mine if (max(m[:2], key=obj)["lr"], max(m[:2], key=obj)["steps"]) == (1e-4, 64)
             and sum(g["steps"] == 64 for g in m[:2]) == 1]  # the first-wave winner: alone at 64, on the floor
    assert len(floor) >= 2  # the family's Sobol draws (seed 0) put two cells' first-wave winners there
    for m in floor:
        wave = sorted(g["lr"] for g in m[2:4])
        if bracket:
            assert wave == [pytest.approx(10 ** -4.5, rel=1e-4), 1e-3], wave  # one step below the floor, and the box's midpoint
            assert max(obj(g) for g in m[:4]) == max(obj(g) for g in m) >= 0.85  # the optimum, in 2 waves
        else:
            assert max(wave) < 1e-4, wave  # the walk alone: both below the floor


def test_bisect_inward_hand_values():
    from orchestrator.search.converge import bisect_inward
    # (winner, walking direction, lr indices tried at its length, lattice points) -> the lr index to try behind it
    assert bisect_inward(0, -1, [0], 9) == 4  # alone on the floor of a 9-point box: its middle
    assert bisect_inward(8, 1, [8], 9) == 4
    assert bisect_inward(9, 1, [9], 9) == 4  # alone past the cap: halfway back to the floor (rounded outward)
    assert bisect_inward(6, 1, [3, 6], 9) is None  # a point tried behind it: the walk alone (bracket expansion)
    assert bisect_inward(1, -1, [1], 9) == 5
    assert bisect_inward(0, -1, [0], 2) is None  # one step to the far end: nothing untried between
    assert bisect_inward(0, -1, [0], 3) == 1


@pytest.mark.parametrize("bracket", [0, 1])
def test_an_edge_winner_gets_a_wave_of_points_further_out(tmp_path, bracket):
    b = Budget(trials=8, lr=(1e-4, 1e-2), length=("steps", (4, 64)), reevaluate=2, explore=2, lattice=(5, 3),
               converge=Converge(batch=3, widen_steps=3, bracket=bracket))
    cells = _cells(6)
    s = make(tmp_path, cells, b)
    got = drive(s, lambda c: 0.2 + 0.1 * math.log10(c["lr"] / 1e-4) + 0.001 * int(c["cell_id"][-1]))
    waves = []
    for c in cells:
        mine = searched(got, c["cell_id"])
        past = sorted({g["lr"] for g in mine if g["lr"] > 1.01e-2})
        assert past and past[-1] >= 1e-2 * 10 ** 1.0 * 0.999  # at least 2 of the 3 steps the box may widen
        if not bracket:
            assert past[-1] == pytest.approx(1e-2 * 10 ** 1.5, rel=1e-4)  # up to the widening limit
        waves.append([round(g["lr"], 6) for g in mine[2:5]])
    # a cell whose first-wave winner sat alone at its length on the cap: its next wave is 1, 2 and 3 lattice steps
    # past it, same length; with rule 1c the last slot is the gap behind it (2 steps into the 5-point box)
    assert ([0.031623, 0.1, 0.001] if bracket else [0.031623, 0.1, 0.316228]) in waves
