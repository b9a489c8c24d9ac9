"""Physical shrink of a CORP-structured timm ViT and its efficiency figures (SPEC §4, issue 3 item 2).

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
    """Multi-head self-attention with d' <= dh query/key dims per head and full dh value dims."""

    def __init__(self, qk: nn.Linear, v: nn.Linear, proj: nn.Linear, num_heads: int, qk_dim: int, head_dim: int,
                 scale: float) -> None:
        super().__init__()
        self.qk, self.v, self.proj = qk, v, proj  # (D -> 2*H*d'), (D -> H*dh), (H*dh -> D)
        self.num_heads, self.qk_dim, self.head_dim, self.scale = num_heads, qk_dim, head_dim, scale

    def forward(self, x: torch.Tensor, attn_mask: torch.Tensor | None = None, is_causal: bool = False) -> torch.Tensor:
        b, n, _ = x.shape
        v = self.v(x).reshape(b, n, self.num_heads, self.head_dim).transpose(1, 2)  # (B, H, N, dh)
        if self.qk_dim == 0:  # every Q/K dim removed: all logits 0, uniform attention
            out = v.mean(dim=2, keepdim=True).expand(-1, -1, n, -1)
        else:
            qk = self.qk(x).reshape(b, n, 2, self.num_heads, self.qk_dim).permute(2, 0, 3, 1, 4)
            q, k = qk.unbind(0)  # (B, H, N, d') each
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=is_causal,
                                                 scale=self.scale)  # (B, H, N, dh)
        return self.proj(out.transpose(1, 2).reshape(b, n, self.num_heads * self.head_dim))


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
            rows = torch.cat([keep, keep, torch.zeros(d, dtype=torch.bool, device=keep.device)])
            w, b = a.qkv.weight, a.qkv.bias
            qk = _linear(w[rows], None if b is None else b[rows])
            v = _linear(w[2 * d :], None if b is None else b[2 * d :])
            blk.attn = QKPrunedAttention(qk, v, a.proj, a.num_heads, int(per_head[0]), a.head_dim, a.scale)
    return out.eval()


def n_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def flops(model: nn.Module, example: torch.Tensor) -> int:
    """Forward FLOPs of one batch (torch.utils.flop_counter: matmuls, convs, attention)."""
    with torch.no_grad(), FlopCounterMode(display=False) as fc:
        model(example)
    return int(fc.get_total_flops())


@torch.no_grad()
def latency_ms(model: nn.Module, example: torch.Tensor, repeats: int = 20, warmup: int = 3) -> float:
    """p50 wall-clock milliseconds of one forward pass of the batch (synchronizing CUDA)."""
    sync = torch.cuda.synchronize if example.is_cuda else (lambda: None)
    for _ in range(warmup):
        model(example)
    times = []
    for _ in range(repeats):
        sync()
        t0 = time.perf_counter()
        model(example)
        sync()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def measure(model: nn.Module, example: torch.Tensor, repeats: int = 20) -> dict[str, float]:
    lat = latency_ms(model, example, repeats)
    return {"params": n_params(model), "flops": flops(model, example), "latency_ms": lat,
            "throughput": example.shape[0] / (lat / 1e3)}


@torch.no_grad()
def efficiency_metrics(model: nn.Module, masks: Mapping[str, torch.Tensor], example: torch.Tensor,
                       repeats: int = 20) -> dict[str, float]:
    """Dense-shape (masked) vs shrunk: params, flops, p50 latency, throughput (images/s), speedup, and the
    largest |output difference| between the two (the shrink is exact up to float rounding)."""
    from timm.models.vision_transformer import VisionTransformer

    if not isinstance(model, VisionTransformer):
        return {}
    model.eval()
    small = shrink_vit(model, masks)
    diff = float((model(example) - small(example)).abs().max())
    d, s = measure(model, example, repeats), measure(small, example, repeats)
    out = {f"dense_{k}": float(v) for k, v in d.items()}
    out.update({f"shrunk_{k}": float(v) for k, v in s.items()})
    out.update(speedup=s["throughput"] / d["throughput"], shrink_max_abs_diff=diff)
    return out
