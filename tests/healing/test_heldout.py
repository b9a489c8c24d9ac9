"""tasks/healing/heldout.py: the held-out slice never overlaps the trial's calibration rows, and the score is the
cosine alignment loss against the dense model's block outputs (exact values on a model whose outputs are known)."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from tasks.healing.heldout import heldout_align, heldout_reference, heldout_score, heldout_slice


def test_heldout_slice_is_the_tail_the_trial_never_trains_on():
    assert heldout_slice(320, 256) == slice(256, 320)  # digits: every default calibration size fits
    assert heldout_slice(320, 64) == slice(256, 320)
    assert heldout_slice(320, 257) is None  # rows 256.. would be training rows: no held-out slice
    assert heldout_slice(100, 10, n=0) is None


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 3, bias=False), nn.Linear(3, 2, bias=False))


def test_heldout_align_exact_values():
    dense = _model()
    x = torch.randn(10, 4)  # (N, F)
    same = copy.deepcopy(dense)
    blocks = lambda m: [("0", m[0]), ("1", m[1])]  # noqa: E731
    ref = heldout_reference(dense, blocks(dense), x)  # [(10, 3), (10, 2)]
    assert [tuple(r.shape) for r in ref] == [(10, 3), (10, 2)] and torch.equal(ref[1], dense(x))
    assert heldout_align(same, blocks(same), ref, x, "example") == pytest.approx(0.0, abs=1e-6)
    flipped = copy.deepcopy(dense)
    with torch.no_grad():
        flipped[0].weight.neg_()  # block 0 output negated (cos -1 -> loss 2); block 1 too (linear, no bias)
    assert heldout_align(flipped, blocks(flipped), ref, x, "example") == pytest.approx(2.0)
    with torch.no_grad():
        flipped[1].weight.neg_()  # block 0 still negated (2), block 1 back to the dense output (0): mean 1
    assert heldout_align(flipped, blocks(flipped), ref, x, "example") == pytest.approx(1.0)


def test_heldout_score_uses_only_the_tail():
    dense = _model()
    calib = torch.randn(20, 4)
    calib[:12] = float("nan")  # rows a trial of calib size 12 trains on: must never be read
    healed = copy.deepcopy(dense)
    asked = []

    def reference_of(rows):
        asked.append(rows)
        return heldout_reference(dense, [("0", dense[0]), ("1", dense[1])], calib[rows])

    args = (healed, [("0", healed[0]), ("1", healed[1])], reference_of, calib)
    assert heldout_score(*args, 12, "example", n=8) == {"heldout_align": pytest.approx(0.0, abs=1e-6)}  # rows 12..19
    assert heldout_score(*args, 13, "example", n=8) == {}  # row 12 is a training row: no held-out slice
    assert asked == [slice(12, 20)]  # the reference is asked for the tail only, and not when there is none
