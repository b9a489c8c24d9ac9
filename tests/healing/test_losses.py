"""Alignment objectives (tasks.healing.losses) against hand-computed values, both granularities."""
import math

import numpy as np
import pytest
import torch

from tasks.healing.losses import GRANULARITIES, as_rows, cosine_align_loss, mse_align_loss

# ViT-style block output (B=2, T=2, D=2). Hand values:
#   example 0 tokens: cos([1,0],[2,0]) = 1, cos([0,1],[1,0]) = 0          -> 1-cos: 0, 1
#   example 1 tokens: cos([3,4],[4,3]) = 24/25, cos([4,3],[4,3]) = 1       -> 1-cos: 0.04, 0
#   token  = mean(0, 1, 0.04, 0) = 0.26
#   example 0 flattened: [1,0,0,1].[2,0,1,0] = 2, norms sqrt2, sqrt5       -> 1 - 2/sqrt10
#   example 1 flattened: [3,4,4,3].[4,3,4,3] = 49, norms sqrt50, sqrt50    -> 1 - 49/50 = 0.02
O_VIT = torch.tensor([[[1.0, 0.0], [0.0, 1.0]], [[3.0, 4.0], [4.0, 3.0]]])
T_VIT = torch.tensor([[[2.0, 0.0], [1.0, 0.0]], [[4.0, 3.0], [4.0, 3.0]]])
TOKEN_VIT = 0.26
EXAMPLE_VIT = ((1 - 2 / math.sqrt(10)) + 0.02) / 2

# CNN block output (B=1, C=2, H=1, W=3): spatial positions are the tokens (C features each).
#   positions: o = [1,0], [0,3], [1,0]; t = [1,0], [1,0], [1,0] -> 1-cos: 0, 1, 0
#   example: o flat (channel-major) [1,0,1, 0,3,0], t flat [1,1,1, 0,0,0]: dot 2, norms sqrt11, sqrt3
#   (taking channels as rows instead would give ((1 - 2/sqrt6) + 1) / 2 = 0.59)
O_CNN = torch.tensor([[[[1.0, 0.0, 1.0]], [[0.0, 3.0, 0.0]]]])
T_CNN = torch.tensor([[[[1.0, 1.0, 1.0]], [[0.0, 0.0, 0.0]]]])
TOKEN_CNN = 1 / 3
EXAMPLE_CNN = 1 - 2 / math.sqrt(33)


def _np_reference(o, t, granularity):
    """Independent loop implementation: tokens are the last axis (ViT) or the channel axis (CNN)."""
    o, t = o.double().numpy(), t.double().numpy()
    rows = []
    for b in range(o.shape[0]):
        if granularity == "example":
            pairs = [(o[b].ravel(), t[b].ravel())]
        elif o.ndim == 4:
            pairs = [(o[b, :, i, j], t[b, :, i, j]) for i in range(o.shape[2]) for j in range(o.shape[3])]
        else:
            pairs = [(o[b, i], t[b, i]) for i in range(o.shape[1])]
        rows += [1 - np.dot(x, y) / (np.linalg.norm(x) * np.linalg.norm(y)) for x, y in pairs]
    return float(np.mean(rows))


@pytest.mark.parametrize("o,t,g,expected", [
    (O_VIT, T_VIT, "token", TOKEN_VIT), (O_VIT, T_VIT, "example", EXAMPLE_VIT),
    (O_CNN, T_CNN, "token", TOKEN_CNN), (O_CNN, T_CNN, "example", EXAMPLE_CNN),
])
def test_cosine_hand_values(o, t, g, expected):
    assert cosine_align_loss([o], [t], g).item() == pytest.approx(expected, abs=1e-6)
    assert _np_reference(o, t, g) == pytest.approx(expected, abs=1e-12)


def test_granularities_differ_on_the_hand_cases():
    assert abs(TOKEN_VIT - EXAMPLE_VIT) > 0.05 and abs(TOKEN_CNN - EXAMPLE_CNN) > 0.05


def test_cnn_token_rows_are_spatial_positions():
    x = torch.arange(2 * 3 * 2 * 2, dtype=torch.float32).view(2, 3, 2, 2)  # (B, C, H, W)
    rows = as_rows(x, "token")
    assert rows.shape == (8, 3)
    assert rows[0].tolist() == x[0, :, 0, 0].tolist() and rows[5].tolist() == x[1, :, 0, 1].tolist()
    assert as_rows(x, "example").shape == (2, 12)
    assert as_rows(torch.zeros(2, 17, 32), "token").shape == (34, 32)


@pytest.mark.parametrize("shape", [(3, 5, 8), (2, 4, 3, 3)])
@pytest.mark.parametrize("g", GRANULARITIES)
def test_cosine_random_matches_numpy(shape, g):
    gen = torch.Generator().manual_seed(0)
    o, t = torch.randn(*shape, generator=gen), torch.randn(*shape, generator=gen)
    assert cosine_align_loss([o], [t], g).item() == pytest.approx(_np_reference(o, t, g), abs=1e-6)


@pytest.mark.parametrize("g", GRANULARITIES)
def test_identical_zero_opposite_two_scale_invariant(g):
    o = torch.randn(2, 5, 8, generator=torch.Generator().manual_seed(1))
    assert cosine_align_loss([o], [o.clone()], g).item() == pytest.approx(0.0, abs=1e-6)
    assert cosine_align_loss([o], [3.0 * o], g).item() == pytest.approx(0.0, abs=1e-6)
    assert cosine_align_loss([o], [-o], g).item() == pytest.approx(2.0, abs=1e-6)


def test_average_over_blocks():
    loss = cosine_align_loss([O_VIT, O_CNN, O_VIT], [T_VIT, T_CNN, -O_VIT], "token")
    assert loss.item() == pytest.approx((TOKEN_VIT + TOKEN_CNN + 2.0) / 3, abs=1e-6)


def test_float16_targets_are_upcast():
    o = torch.randn(2, 5, 8, generator=torch.Generator().manual_seed(2))
    t = torch.randn(2, 5, 8, generator=torch.Generator().manual_seed(3)).half()
    assert cosine_align_loss([o], [t]).item() == pytest.approx(cosine_align_loss([o], [t.float()]).item(), abs=1e-7)


def test_cosine_gradient_flows_to_outputs_only():
    o = O_VIT.clone().requires_grad_(True)
    cosine_align_loss([o], [T_VIT], "example").backward()
    assert o.grad is not None and torch.isfinite(o.grad).all() and o.grad.abs().sum() > 0


def test_mse_hand_values():
    o = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    t = torch.tensor([[1.0, 0.0], [0.0, 4.0]])  # squared errors 0, 4, 9, 0 -> 3.25
    assert mse_align_loss([o], [t]).item() == 3.25
    assert mse_align_loss([o, o], [t, o]).item() == 1.625
    assert mse_align_loss([o], [t], "example").item() == 3.25  # granularity does not change MSE
    assert mse_align_loss([O_CNN], [T_CNN.half()]).item() == pytest.approx(10 / 6)  # diffs 0,1,0 / 0,3,0


def test_errors():
    with pytest.raises(ValueError, match="matching"):
        cosine_align_loss([O_VIT, O_VIT], [T_VIT])
    with pytest.raises(ValueError, match="matching"):
        cosine_align_loss([], [])
    with pytest.raises(ValueError, match="granularity must be one of"):
        cosine_align_loss([O_VIT], [T_VIT], "channel")
    with pytest.raises(ValueError, match="granularity"):
        as_rows(O_CNN, "Token")
    with pytest.raises(ValueError):
        mse_align_loss([O_VIT], [])
    with pytest.raises(ValueError):
        mse_align_loss([], [])
