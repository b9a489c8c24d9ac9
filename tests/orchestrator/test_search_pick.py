"""search.converge's ``pick`` (orchestrator/search/pick.py): the configuration a converged cell quotes is the
centre of its best plateau of ties, not the luckiest draw on it."""
import json
import math
from dataclasses import replace

import pytest

from orchestrator.search.converge import Converge
from orchestrator.search.lattice import draw_sd, plateau_centre, plateau_pick, resolved_worse
from orchestrator.spec.checks import SpecError
from orchestrator.spec.parse import parse_converge
from orchestrator.sweep.parent import converge_param
from tests.orchestrator.test_search_contract import _cells
from tests.orchestrator.test_search_converge import BUDGET, CONV, drive, make, searched

pytestmark = pytest.mark.timeout(60)


def test_plateau_centre_hand_values():
    assert plateau_centre([False, True, True, True, True], 4) == (3, 4)  # run 1..4, centre 2.5 -> 3 (nearer 4)
    assert plateau_centre([True, True, True, True, True], 0) == (2, 5)
    assert plateau_centre([True, True], 1) == (1, 2)  # a run of two keeps the best
    assert plateau_centre([True, True], 0) == (0, 2)
    assert plateau_centre([True, False, True, True, True, False], 2) == (3, 3)  # the run stops at a distinct point
    assert plateau_centre([True] * 6, 5) == (3, 6) and plateau_centre([True] * 6, 0) == (2, 6)
    assert plateau_centre([True], 0) == (0, 1)


def test_resolved_worse_hand_values():
    # 90 % over 180 images: sqrt(0.9 * 0.1 / 180) = 2.236 pp; the floor takes over near 0 and 1
    assert draw_sd(0.9, 180, 0.005) == pytest.approx(0.02236, abs=1e-5) and draw_sd(1.0, 180, 0.005) == 0.005
    unit = math.hypot(draw_sd(0.9, 180, 0.005), draw_sd(0.85, 180, 0.005))  # 3.48 pp (2.24 and 2.66 pp) for a 5 pp gap
    assert resolved_worse(0.9, 0.85, 180, 0.005, z=1.0) and not resolved_worse(0.9, 0.85, 180, 0.005, z=2.0)
    assert 0.05 / unit == pytest.approx(1.438, abs=1e-3)
    assert not resolved_worse(0.85, 0.9, 180, 0.005, z=0.0)  # better is never worse


def test_plateau_pick_hand_values():
    tied = lambda top, v: top - v <= 0.02  # noqa: E731 (ties within 2 pp, for the hand values)
    # one length: lr keys 1..5; best 0.91 at lr 5 ends the plateau 2..5 (0.90, 0.895, 0.90, 0.91): centre 3.5 -> 4
    means = {(1, 64): 0.70, (2, 64): 0.90, (3, 64): 0.895, (4, 64): 0.90, (5, 64): 0.91, (3, 16): 0.60}
    first = {k: i for i, k in enumerate(means)}
    assert plateau_pick(means, first, tied) == (4, 64)
    # the same best at 16 steps with a plateau of one: the longer plateau (64 steps) wins the exact tie
    assert plateau_pick({**means, (3, 16): 0.91}, first, tied) == (4, 64)
    # equal plateaus at two lengths: the cheaper length
    two = {(1, 16): 0.91, (1, 64): 0.91}
    assert plateau_pick(two, {(1, 16): 1, (1, 64): 0}, tied) == (1, 16)
    # lr keys may be the lr values themselves: only their order counts
    assert plateau_pick({(1e-3, 8): 0.5, (3e-3, 8): 0.8, (1e-2, 8): 0.79, (3e-2, 8): 0.2},
                        dict.fromkeys([(1e-3, 8), (3e-3, 8), (1e-2, 8), (3e-2, 8)], 0), tied) == (3e-3, 8)


# selection accuracy (of 180 images) per lr lattice index at the budget length (64 steps): a plateau from index 1 to
# the declared cap (index 4), its best draw on the cap by 0.5 pp (one noise unit at 90 %: 3.2 pp), then a drop past
# the cap that the walk of rule 1 resolves; below the floor and at every shorter length far worse
PLATEAU = {0: 0.70, 1: 0.895, 2: 0.90, 3: 0.898, 4: 0.905, 5: 0.80, 6: 0.70, 7: 0.60}


def _plateau(c):
    u = round(math.log10(c["lr"] / 1e-4) * 2)  # the lattice index (5 points over two decades)
    return (PLATEAU.get(u, 0.5) if c["steps"] == 64 else 0.3) + 0.0001 * int(c["cell_id"][-1])


@pytest.mark.parametrize("pick", [1, 0])
def test_a_cell_quotes_the_centre_of_its_plateau_of_ties_not_its_luckiest_draw(tmp_path, pick):
    cells = _cells(4)
    s = make(tmp_path, cells, replace(BUDGET, converge=replace(CONV, pick=pick)))
    got = drive(s, _plateau, dense=lambda c: 0.99)
    for c in cells:
        mine = searched(got, c["cell_id"])
        again = {(g["lr"], g["steps"]) for g in got if g["cell_id"] == c["cell_id"] and g["stage"] == "reevaluate"}
        assert len(again) == 1  # every re-evaluation heals the one configuration the cell quotes
        (lr, steps), = again
        best = max(mine, key=_plateau)
        assert best["lr"] == pytest.approx(1e-2) and best["steps"] == 64  # the search's winner: the cap
        if not pick:
            assert (lr, steps) == (best["lr"], 64)
            continue
        plateau = sorted(g["lr"] for g in mine if g["steps"] == 64 and 1.5e-4 < g["lr"] < 1.01e-2)  # indices 1..4
        assert steps == 64 and lr < 0.99e-2  # off the cap, on the plateau: every tie there is as good as the cap
        assert len(plateau) >= 3 and plateau[0] < lr  # a tried tie on either side of it
        assert s.design.pick(c["cell_id"]).number != s.design.winner(c["cell_id"]).number


def test_pick_is_parsed_checked_and_logged():
    assert parse_converge({"pick": 0}, "shared") == {"pick": 0} and Converge().pick == 1
    with pytest.raises(SpecError, match="pick"):
        parse_converge({"pick": 2}, "shared")
    assert json.loads(converge_param({}))["pick"] == 1
