"""Label-free trial score: the STARFISH alignment loss on held-out calibration images (docs/methods.md#search).

The held-out slice is the LAST ``HELDOUT`` images of the calibration split. A trial trains on the first
calib_size images, so the slice is unseen whenever calib_size ≤ len(calibration) − HELDOUT (digits: 320
calibration images, so every calibration size up to 256); otherwise there is no held-out slice and the score is
None. The same slice for every trial of a sweep makes scores comparable across a cell's trials. Lower is better.
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from tasks.healing.losses import cosine_align_loss
from tasks.healing.targets import dense_targets

__all__ = ["HELDOUT", "heldout_slice", "heldout_reference", "heldout_align", "heldout_score"]

HELDOUT = 64


def heldout_slice(n_calibration: int, calib_size: int, n: int = HELDOUT) -> slice | None:
    """Rows [N − n, N) of the calibration split, or None when the trial's first calib_size rows reach them."""
    if n <= 0 or calib_size > n_calibration - n:
        return None
    return slice(n_calibration - n, n_calibration)


@torch.no_grad()
def heldout_reference(dense: nn.Module, dense_blocks: list[tuple[str, nn.Module]], images: torch.Tensor,
                      batch_size: int = 64) -> list[torch.Tensor]:
    """The dense blocks' outputs on the (N, C, H, W) held-out ``images``, float32, in block order: [(N, ...)]."""
    ref = dense_targets(dense, dense_blocks, images, batch_size, dtype=torch.float32)
    return [ref[n] for n, _ in dense_blocks]


@torch.no_grad()
def heldout_align(healed: nn.Module, healed_blocks: list[tuple[str, nn.Module]], reference: list[torch.Tensor],
                  images: torch.Tensor, granularity: str, batch_size: int = 64) -> float:
    """(1/L) Σ_l mean_rows (1 − cos(f_l(x), r_l(x))) over the (N, C, H, W) held-out ``images``, in float32:
    f = healed block outputs, r = ``reference`` (``heldout_reference``: the dense ones, the same blocks by position)."""
    out = dense_targets(healed, healed_blocks, images, batch_size, dtype=torch.float32)  # {block: (N, ...)}
    return float(cosine_align_loss([out[n] for n, _ in healed_blocks], reference, granularity))


def heldout_score(healed: nn.Module, blocks, reference_of: Callable[[slice], list[torch.Tensor]],
                  calibration: torch.Tensor, calib_size: int, granularity: str, n: int = HELDOUT) -> dict[str, float]:
    """``{"heldout_align": score}`` for a trial (``reference_of(rows)``: the dense model's ``heldout_reference`` on
    ``calibration[rows]``; the same for every trial of a model, so a trial process may compute it once), or ``{}``
    when the calibration split has no slice the trial did not train on."""
    rows = heldout_slice(len(calibration), calib_size, n)
    if rows is None:
        return {}
    return {"heldout_align": heldout_align(healed, blocks, reference_of(rows), calibration[rows], granularity)}
