"""Alignment objectives on block outputs (SPEC §3). Pure functions on tensors.

Granularity:
- ``token``:   cosine per token row. ViT (B, T, D) -> (B*T, D); CNN (B, C, H, W) -> (B*H*W, C), i.e. every
               spatial position is a token with C features (the CNN analogue; documented choice).
- ``example``: cosine of the whole block output flattened per example (paper Eq. 1): (B, ...) -> (B, F).
"""
from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F

GRANULARITIES = ("token", "example")


def as_rows(x: torch.Tensor, granularity: str) -> torch.Tensor:
    """Block output -> (rows, features) for the given granularity."""
    if granularity == "example":
        return x.reshape(x.shape[0], -1)  # (B, F)
    if granularity != "token":
        raise ValueError(f"granularity must be one of {GRANULARITIES}, got {granularity!r}")
    if x.dim() == 4:
        return x.permute(0, 2, 3, 1).reshape(-1, x.shape[1])  # (B*H*W, C)
    if x.dim() == 3:
        return x.reshape(-1, x.shape[-1])  # (B*T, D)
    return x.reshape(x.shape[0], -1)  # (B, D): a single token per example


def cosine_align_loss(outputs: Sequence[torch.Tensor], targets: Sequence[torch.Tensor],
                      granularity: str = "token", eps: float = 1e-8) -> torch.Tensor:
    """L_align = (1/L) sum_l mean_rows (1 - cos(f_l(x), r_l(x))). Scalar."""
    if len(outputs) != len(targets) or not outputs:
        raise ValueError(f"need matching non-empty block lists, got {len(outputs)} outputs and {len(targets)} targets")
    per_block = []
    for o, t in zip(outputs, targets):
        o_rows = as_rows(o, granularity)  # (R, F)
        t_rows = as_rows(t.to(o.dtype), granularity)  # (R, F)
        per_block.append((1.0 - F.cosine_similarity(o_rows, t_rows, dim=-1, eps=eps)).mean())
    return torch.stack(per_block).mean()


def mse_align_loss(outputs: Sequence[torch.Tensor], targets: Sequence[torch.Tensor],
                   granularity: str = "token") -> torch.Tensor:
    """(1/L) sum_l mean((f_l(x) - r_l(x))^2) over all elements (granularity does not change MSE)."""
    if len(outputs) != len(targets) or not outputs:
        raise ValueError("need matching non-empty block lists")
    return torch.stack([F.mse_loss(o, t.to(o.dtype)) for o, t in zip(outputs, targets)]).mean()
