"""CORP (the CORP paper, docs/methods.md#corp): structured ViT masks (pruner ``corp``); the closed-form compensation (healer
``corp``) lives in tasks.healing.corp.

Units: MLP hidden channels (row j of fc1 and its bias entry, column j of fc2) and, per attention head, Q/K
dimension pairs (row j of the head's query and key weights and their bias entries; V untouched). Sparsity =
fraction of channels / dims removed in the pruned modules, rounded per layer (MLP) or per head (Q/K), so the
fraction of removed prunable weights equals it up to that rounding. Scopes: ``mlp``, ``qk``, ``qk_mlp`` and its
alias ``mlp_qk``. Calibration statistics come from the shared hook mechanism (tasks.stats), in float64.

Masks include companion bias masks (``fc1.bias``, the q/k entries of the qkv bias): a removed unit's bias
must be 0 too, or it would still contribute (GELU(b_j) W_2[:, j], b_q,j k_j).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import torch
import torch.nn as nn
import torch.nn.functional as F

from tasks.models.params import bias_name, module_of
from tasks.models.adapter import ModelAdapter, ScopeEntry, get_adapter
from tasks.pruning.allocation_math import n_pruned
from tasks.pruning.base import PRUNERS, Pruner, _keep_all_but_smallest
from tasks.pruning.shrink import efficiency_metrics
from tasks.stats import HeadQK, Moments, Several, Tap, collect

CORP_SCOPES = ("mlp", "qk", "qk_mlp", "mlp_qk")
RANKS = ("activation", "magnitude")


@dataclass(frozen=True)
class VitBlock:
    """Parameter names and sizes of one transformer block, for timm and torchvision ViTs alike."""

    name: str
    fc1: str  # weight (H, D)
    fc2: str  # weight (D, H)
    qkv: str  # fused weight (3D, D)
    num_heads: int
    dim: int

    @property
    def head_dim(self) -> int:
        return self.dim // self.num_heads

    def taps(self, model: nn.Module, mlp: bool, qk: bool) -> dict[str, Tap]:
        """Hidden activations = input of fc2; q/k = the fused projection of the attention input."""
        out = {}
        if mlp:
            out[f"{self.name}/hidden"] = Tap(module_of(model, self.fc2), "input")
        if qk:
            params = dict(model.named_parameters())
            w, b = params[self.qkv], params.get(bias_name(self.qkv))
            out[f"{self.name}/qkv"] = Tap(module_of(model, self.qkv), "input", fn=lambda x, w=w, b=b: F.linear(x, w, b))
        return out


def vit_blocks(model: nn.Module, adapter: ModelAdapter) -> list[VitBlock]:
    parts = getattr(adapter, "parts", {})
    out = []
    for name, block in adapter.blocks(model):
        heads = next(m.num_heads for m in block.modules() if hasattr(m, "num_heads"))
        out.append(VitBlock(name, f"{name}.{parts['fc1']}", f"{name}.{parts['fc2']}", f"{name}.{parts['qkv']}",
                            heads, adapter.embed_dim(block)))
    return out


def scope_parts(entries: list[ScopeEntry], blk: VitBlock) -> tuple[bool, bool]:
    """(MLP in scope, Q/K in scope) for one block."""
    names = {e.param for e in entries}
    return blk.fc1 in names, blk.qkv in names


def unit_stats(model: nn.Module, blocks: list[VitBlock], entries: list[ScopeEntry], images: torch.Tensor,
               full: bool) -> dict[str, Any]:
    """One streamed pass: {"<block>/hidden": MomentStats of fc2's input (full=True: covariance, else energy
    only), "<block>/qkv": HeadQKStats} for the parts of every block that are in scope."""
    taps, routes = {}, {}
    for blk in blocks:
        mlp, qk = scope_parts(entries, blk)
        for k, t in blk.taps(model, mlp, qk).items():
            taps[k] = t
            routes[k] = Moments(full=full) if k.endswith("/hidden") else HeadQK(blk.num_heads, blk.head_dim)
        if qk and full:  # mean of the attention input: the Q means (W_q E[x] + b_q) that centre CORP's Q-side λ
            taps[f"{blk.name}/qkv_in"] = Tap(module_of(model, blk.qkv), "input")
            routes[f"{blk.name}/qkv_in"] = Moments(full=False)
    return collect(model, images, taps, Several(routes)).result()


def check_vit(model: nn.Module, adapter: ModelAdapter, scope: str, who: str) -> None:
    parts = getattr(adapter, "parts", {})
    if not {"fc1", "fc2", "qkv"} <= set(parts):
        raise ValueError(f"{who} prunes ViT MLP hidden units and attention Q/K dims; a {adapter.family} has "
                         f"neither (CORP supports timm and torchvision ViTs only)")
    if scope not in CORP_SCOPES:
        raise ValueError(f"{who} supports scopes {', '.join(CORP_SCOPES)}, not {scope!r}")
    for blk in vit_blocks(model, adapter):
        attn = module_of(model, blk.qkv)
        if not isinstance(getattr(attn, "q_norm", nn.Identity()), nn.Identity):
            raise ValueError(f"{who}: {blk.name} normalizes q/k per head (qk_norm), so a Q/K dim cannot be removed")
        if blk.dim % blk.num_heads or getattr(attn, "head_dim", blk.head_dim) != blk.head_dim:
            raise ValueError(f"{who}: {blk.name} has head dims that do not split the embedding evenly")


def head_keep(scores: torch.Tensor, sparsity: float) -> torch.Tensor:
    """(H, dh) scores -> (H, dh) bool keep, dropping the n_pruned(dh, s) lowest dims of every head."""
    k = n_pruned(scores.shape[1], sparsity)
    return torch.stack([_keep_all_but_smallest(row, k) for row in scores])


@PRUNERS.register("corp")
class CORPPruner(Pruner):
    """Structured CORP masks: rank by activation energy (calibration images) or weight magnitude."""

    settings_schema = {"rank": str}
    uses_calibration = True

    def check(self, settings):
        super().check(settings)
        if settings.get("rank", "activation") not in RANKS:
            raise ValueError(f"pruner 'corp' setting 'rank' must be one of {RANKS}, got {settings['rank']!r}")

    def check_model(self, model, adapter, scope, settings):
        check_vit(model, adapter, scope, "pruner 'corp'")

    def pattern(self, sparsity, settings):
        return f"{sparsity:g}-structured"

    def tolerance(self, model: nn.Module, entries: list[ScopeEntry]) -> float:
        """Largest |removed weights - s * prunable weights| from rounding: half a unit per rounding group
        (one group per MLP layer, unit = fc1 row + fc2 column; one per head, unit = q row + k row)."""
        adapter = get_adapter(model)
        tol = 0.0
        for blk in vit_blocks(model, adapter):
            mlp, qk = scope_parts(entries, blk)
            tol += 0.5 * 2 * blk.dim * (mlp + qk * blk.num_heads)
        return tol

    def structured_metrics(self, model: nn.Module, masks: Mapping[str, torch.Tensor], example: torch.Tensor,
                           rounds: int = 20) -> dict[str, float]:
        return efficiency_metrics(model, masks, example, repeats=rounds)

    def __call__(self, weights, sparsity, *, seed, ctx=None, rank: str = "activation"):
        if ctx is None:
            raise ValueError("pruner 'corp' needs a PruneContext (model, adapter, scope)")
        blocks = vit_blocks(ctx.model, ctx.adapter)
        stats: dict[str, Any] = {}
        if rank == "activation":
            if ctx.calib_images is None:
                raise ValueError("pruner 'corp' with rank='activation' needs calibration images")
            stats = unit_stats(ctx.model, blocks, ctx.entries, ctx.calib_images, full=False)
        params = dict(ctx.model.named_parameters())
        out: dict[str, torch.Tensor] = {}
        for blk in blocks:
            mlp, qk = scope_parts(ctx.entries, blk)
            if mlp:
                w1, w2 = weights[blk.fc1].detach().double(), weights[blk.fc2].detach().double()  # (H, D), (D, H)
                score = (stats[f"{blk.name}/hidden"].energy if rank == "activation"
                         else w1.norm(dim=1) * w2.norm(dim=0))  # (H,)
                keep = _keep_all_but_smallest(score, n_pruned(score.numel(), sparsity))  # (H,)
                out[blk.fc1] = keep[:, None].expand_as(w1).clone()
                out[blk.fc2] = keep[None, :].expand_as(w2).clone()
                if bias_name(blk.fc1) in params:
                    out[bias_name(blk.fc1)] = keep.clone()
            if qk:
                d, h, dh = blk.dim, blk.num_heads, blk.head_dim
                wqk = weights[blk.qkv].detach().double()  # (2D, D) region: q rows then k rows
                score = (stats[f"{blk.name}/qkv"].energy if rank == "activation"
                         else (wqk[:d].norm(dim=1) ** 2 * wqk[d:].norm(dim=1) ** 2).view(h, dh))  # (H, dh)
                keep = head_keep(score, sparsity).flatten()  # (D,)
                out[blk.qkv] = torch.cat([keep, keep])[:, None].expand_as(wqk).clone()
                bname = bias_name(blk.qkv)
                if bname in params:
                    out[bname] = torch.cat([keep, keep, torch.ones(d, dtype=torch.bool)])
        return out
