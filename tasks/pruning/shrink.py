"""Physical shrink of a CORP-structured timm ViT and its efficiency figures (docs/methods.md#corp, issue 3 item 2).

A masked model keeps its dense shapes; ``shrink_vit`` rebuilds it with fewer fc1 rows / fc2 columns and fewer
Q/K dims per head. timm's ``Attention`` assumes equal q/k/v head dims, so a pruned attention is replaced by
``QKPrunedAttention``: one Linear for the kept q/k rows (2*H*d'), one for the untouched V rows (H*dh), the same
proj, and the *original* softmax scale dh^-1/2 (the masked model still divides by sqrt(dh)), so outputs equal
the masked model's up to float rounding. torchvision ViTs are not shrunk (their fused MultiheadAttention has no
such seam); ``efficiency_metrics`` returns {} for them.
"""
from __future__ import annotations

import copy
import statistics
import time
from typing import Mapping

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode


class QKPrunedAttention(nn.Module):
    """Multi-head self-attention with d' <= dh query/key dims per head and full dh value dims. One fused
    projection, rows [q (H*d') | k (H*d') | v (H*dh)], like timm's qkv (one matmul)."""

    def __init__(self, qkv: nn.Linear, proj: nn.Linear, num_heads: int, qk_dim: int, head_dim: int,
                 scale: float) -> None:
        super().__init__()
        self.qkv, self.proj = qkv, proj  # (D -> H*(2d' + dh)), (H*dh -> D)
        self.num_heads, self.qk_dim, self.head_dim, self.scale = num_heads, qk_dim, head_dim, scale

    def forward(self, x: torch.Tensor, attn_mask: torch.Tensor | None = None, is_causal: bool = False) -> torch.Tensor:
        b, n, _ = x.shape
        h, e = self.num_heads, self.num_heads * self.qk_dim
        y = self.qkv(x)  # (B, N, H*(2d' + dh))
        v = y[..., 2 * e :].reshape(b, n, h, self.head_dim).transpose(1, 2)  # (B, H, N, dh)
        if self.qk_dim == 0:  # every Q/K dim removed: all logits 0, uniform attention
            out = v.mean(dim=2, keepdim=True).expand(-1, -1, n, -1)
        else:
            qk = y[..., : 2 * e].reshape(b, n, 2, h, self.qk_dim).permute(2, 0, 3, 1, 4)
            q, k = qk.unbind(0)  # (B, H, N, d') each
            if x.is_cuda or attn_mask is not None or is_causal:
                out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=is_causal,
                                                     scale=self.scale)  # (B, H, N, dh)
            else:  # CPU: SDPA with d' != dh takes a slow path on strided inputs; the plain math is ~2x faster
                out = ((q * self.scale) @ k.transpose(-2, -1)).softmax(dim=-1) @ v  # (B, H, N, dh)
        return self.proj(out.transpose(1, 2).reshape(b, n, h * self.head_dim))


def _linear(w: torch.Tensor, b: torch.Tensor | None) -> nn.Linear:
    lin = nn.Linear(w.shape[1], w.shape[0], bias=b is not None, device=w.device, dtype=w.dtype)
    with torch.no_grad():
        lin.weight.copy_(w)
        if b is not None:
            lin.bias.copy_(b)
    return lin


@torch.no_grad()
def shrink_vit(model: nn.Module, masks: Mapping[str, torch.Tensor]) -> nn.Module:
    """A smaller copy of a CORP-masked timm VisionTransformer (the input model is not modified)."""
    from timm.models.vision_transformer import VisionTransformer

    if not isinstance(model, VisionTransformer):
        raise ValueError(f"physical shrink supports timm VisionTransformer only, not {type(model).__name__}")
    out = copy.deepcopy(model)
    for i, blk in enumerate(out.blocks):
        fc1 = f"blocks.{i}.mlp.fc1.weight"
        if fc1 in masks:
            keep = masks[fc1].any(dim=1).to(blk.mlp.fc1.weight.device)  # (H,) kept hidden units
            f1, f2 = blk.mlp.fc1, blk.mlp.fc2
            blk.mlp.fc1 = _linear(f1.weight[keep], None if f1.bias is None else f1.bias[keep])
            blk.mlp.fc2 = _linear(f2.weight[:, keep], f2.bias)
        qkv = f"blocks.{i}.attn.qkv.weight"
        if qkv in masks:
            a = blk.attn
            d = a.num_heads * a.head_dim
            keep = masks[qkv][:d].any(dim=1).to(a.qkv.weight.device)  # (D,) kept q (= k) dims
            per_head = keep.view(a.num_heads, a.head_dim).sum(1)
            if len(set(per_head.tolist())) != 1:
                raise ValueError(f"blocks.{i}: heads keep different numbers of Q/K dims: {per_head.tolist()}")
            rows = torch.cat([keep, keep, torch.ones(d, dtype=torch.bool, device=keep.device)])  # [q_S|k_S|v]
            w, b = a.qkv.weight, a.qkv.bias
            qkv = _linear(w[rows], None if b is None else b[rows])
            blk.attn = QKPrunedAttention(qkv, a.proj, a.num_heads, int(per_head[0]), a.head_dim, a.scale)
    return out.eval()


def n_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def flops(model: nn.Module, example: torch.Tensor) -> int:
    """Forward FLOPs of one batch (torch.utils.flop_counter: matmuls, convs, attention), counted on meta tensors:
    the formulas need shapes only, so no arithmetic runs (a DeiT-B pass over 64 images costs seconds on a CPU and a
    GPU's time on a GPU). A model whose forward does not run on meta tensors is counted on the real ones."""
    meta = {k: torch.empty_like(v, device="meta") for k, v in (*model.named_parameters(), *model.named_buffers())}
    try:
        with torch.no_grad(), FlopCounterMode(display=False) as fc:
            torch.func.functional_call(model, meta, (example.to("meta"),))
    except (RuntimeError, NotImplementedError, TypeError, ValueError):  # e.g. a tensor made on the CPU in forward
        with torch.no_grad(), FlopCounterMode(display=False) as fc:
            model(example)
    return int(fc.get_total_flops())


@torch.no_grad()
def latencies_ms(models: list[nn.Module], example: torch.Tensor, repeats: int = 20, warmup: int = 3,
                 budget_s: float = 5.0, min_repeats: int = 3) -> list[float]:
    """p50 wall-clock milliseconds of one forward pass of the batch for each model (synchronizing CUDA). The
    models are timed interleaved (a, b, a, b, ...) so that they see the same background load. Rounds stop early
    once ``budget_s`` seconds of timed passes are spent and ``min_repeats`` rounds are done: a DeiT-B on a CPU
    (seconds per pass) would spend a minute of its trial here; on a GPU 20 rounds take well under a second."""
    return timed_passes(models, example, repeats, warmup, budget_s, min_repeats)[0]


@torch.no_grad()
def timed_passes(models: list[nn.Module], example: torch.Tensor, repeats: int = 20, warmup: int = 3,
                 budget_s: float = 5.0, min_repeats: int = 3) -> tuple[list[float], list[torch.Tensor]]:
    """(``latencies_ms``' figures, each model's output of its last timed pass)."""
    sync = torch.cuda.synchronize if example.is_cuda else (lambda: None)
    for m in models:
        for _ in range(warmup):
            m(example)
    times: list[list[float]] = [[] for _ in models]
    outs: list[torch.Tensor] = [example] * len(models)
    for r in range(max(1, repeats)):
        if r >= min_repeats and sum(map(sum, times)) > budget_s * 1e3:
            break
        for i, m in enumerate(models):
            sync()
            t0 = time.perf_counter()
            outs[i] = m(example)
            sync()
            times[i].append((time.perf_counter() - t0) * 1e3)
    return [statistics.median(t) for t in times], outs


@torch.no_grad()
def efficiency_metrics(model: nn.Module, masks: Mapping[str, torch.Tensor], example: torch.Tensor,
                       repeats: int = 20) -> dict[str, float]:
    """Dense-shape (masked) vs shrunk: params, flops, p50 latency, throughput (images/s), speedup, and the
    largest |output difference| between the two (the shrink is exact up to float rounding). ``repeats``: timed
    rounds at most, after min(3, repeats - 1) warm-up passes of each model (``heal.latency_rounds``; a dry run
    times one round without warm-up: its figures only show that the stage runs)."""
    from timm.models.vision_transformer import VisionTransformer

    if not isinstance(model, VisionTransformer):
        return {}
    model.eval()
    small = shrink_vit(model, masks)
    lat, (y_dense, y_small) = timed_passes([model, small], example, repeats, warmup=min(3, repeats - 1))
    diff = float((y_dense - y_small).abs().max())  # the shrink's exactness, from the timed passes' outputs
    out: dict[str, float] = {}
    for tag, m, ms in (("dense", model, lat[0]), ("shrunk", small, lat[1])):
        out.update({f"{tag}_params": float(n_params(m)), f"{tag}_flops": float(flops(m, example)),
                    f"{tag}_latency_ms": ms, f"{tag}_throughput": example.shape[0] / (ms / 1e3)})
    out.update(speedup=out["shrunk_throughput"] / out["dense_throughput"], shrink_max_abs_diff=diff)
    return out
