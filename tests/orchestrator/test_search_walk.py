"""search.converge's walk past the declared lr box (orchestrator/search/converge.py rule 1, ``walk_offsets``): its
waves reach geometrically further out (``widen_growth`` 2), so a cell whose optimum lies far past the box brackets
it within the trial cap; ``widen_growth: 1`` keeps the earlier 1, 2, …, ``batch`` steps. No Ray: the Tune
``Searcher`` is driven by hand (tests/orchestrator/test_search_converge.py's driver)."""
from __future__ import annotations

import json
import math

import pytest

from orchestrator.search import Budget
from orchestrator.search.converge import Converge, walk_offsets
from orchestrator.spec.checks import SpecError
from orchestrator.spec.parse import parse_converge
from orchestrator.sweep.parent import converge_param
from tests.orchestrator.test_search_contract import _cells
from tests.orchestrator.test_search_converge import drive, make, searched

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
