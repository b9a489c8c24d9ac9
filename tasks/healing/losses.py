"""Alignment objectives on block outputs (docs/methods.md#starfish). Pure functions on tensors.

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


def kl_logit_loss(logits: torch.Tensor, dense_logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """KL(dense || pruned) on class logits, reduction = batchmean (sum over classes, mean over examples).

    logits (B, K) of the pruned model, dense_logits (B, K) cached from the dense model (any float dtype).
    (1/B) sum_b sum_k p_d[b,k] (log p_d[b,k] - log p_p[b,k]) with p = softmax(z / T); T = 1 by default (the
    Hinton T^2 factor is not applied: it is 1 at T = 1). Scalar, >= 0, 0 iff the softmaxes agree."""
    if logits.shape != dense_logits.shape or logits.dim() != 2:
        raise ValueError(f"need matching (B, K) logits, got {tuple(logits.shape)} and {tuple(dense_logits.shape)}")
    log_p = F.log_softmax(logits / temperature, dim=-1)  # (B, K) pruned
    log_q = F.log_softmax(dense_logits.to(logits.dtype) / temperature, dim=-1)  # (B, K) dense (target)
    return F.kl_div(log_p, log_q, reduction="batchmean", log_target=True)


def ce_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Cross-entropy fine-tuning objective: mean over the batch of -log softmax(logits)[label].
    logits (B, K), labels (B,) int64. Scalar."""
    return F.cross_entropy(logits, labels)


def weighted_sum(terms: Sequence[tuple[float, torch.Tensor]]) -> torch.Tensor:
    """sum_i w_i * L_i over (weight, scalar loss) pairs; terms with weight 0 are dropped (0 * NaN would be NaN).
    Scalar."""
    kept = [w * loss for w, loss in terms if w != 0]
    if not kept:
        raise ValueError("at least one loss term needs a nonzero weight")
    return torch.stack(kept).sum()
