"""search.converge's ``pick`` (orchestrator/search/pick.py): the configuration a converged cell quotes is the
centre of its best plateau of ties, not the luckiest draw on it."""
import pytest

from orchestrator.search.lattice import plateau_centre

pytestmark = pytest.mark.timeout(60)


def test_plateau_centre_hand_values():
    assert plateau_centre([False, True, True, True, True], 4) == (3, 4)  # run 1..4, centre 2.5 -> 3 (nearer 4)
    assert plateau_centre([True, True, True, True, True], 0) == (2, 5)
    assert plateau_centre([True, True], 1) == (1, 2)  # a run of two keeps the best
    assert plateau_centre([True, True], 0) == (0, 2)
    assert plateau_centre([True, False, True, True, True, False], 2) == (3, 3)  # the run stops at a distinct point
    assert plateau_centre([True] * 6, 5) == (3, 6) and plateau_centre([True] * 6, 0) == (2, 6)
    assert plateau_centre([True], 0) == (0, 1)
