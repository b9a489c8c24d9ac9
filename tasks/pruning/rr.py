"""Relative Repairability diagnostics (docs/methods.md#relative-repairability-crbn-rr, the Relative Repairability
paper §3.2): D_raw, D_repair and R per layer and sparsity.

Diagnostic model: only layer ℓ is pruned to s (magnitude, exact count, inside its prunable region), all else
dense. Because everything upstream of ℓ is dense, ℓ's input is the dense input: it is captured once and the
pruned layer is re-applied functionally for every candidate sparsity (no full forward per sparsity).

Where distortion is measured (setting ``at``, docs/methods.md#relative-repairability-crbn-rr):
- ``conv`` (default, the paper's "post-convolution activation"): a = the layer's own output.
  raw: conv(x, W_pruned); repair: γ ⊙ conv(x, W_pruned) (CR, ``tasks.pruning.repair.crbn_scales``), so γ
  enters D_repair directly.
- ``bn`` (the project's earlier choice): on the output of the BatchNorm that directly follows the layer when
  there is one (ResNet convs: conv1->bn1, conv2->bn2, downsample.0->downsample.1), else on the layer's own
  output. raw: BN with the dense running statistics; repair: the γ-scaled output through the BN with exact
  population statistics of the repaired output (γ then cancels up to BN eps).
The BN that follows a layer is the next BatchNorm in module registration order with as many features as the
layer has output channels, found inside the same parent module.
"""
from __future__ import annotations

import json
from typing import Any, Mapping, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

from tasks.models.adapter import ScopeEntry
from tasks.models.params import module_of
from tasks.pruning.allocation_math import n_pruned
from tasks.pruning.repair import EPS, channel_moments, crbn_scales, tau_of, to_channels
from tasks.stats import Moments

COLUMNS = ("model", "layer", "n_weights", "shape", "sparsity", "D_raw", "D_repair", "R")
DIAG_DEFAULTS = {"diag_images": 128, "tau": "median", "at": "conv"}
MEASURE_AT = ("conv", "bn")


def distortion(a: torch.Tensor, b: torch.Tensor, eps: float = EPS) -> torch.Tensor:
    """d(a, b) = (1/C) Σ_c ‖a_c − b_c‖² / (‖a_c‖² + ε) per example.

    a, b: (N, C, L) (see ``tasks.pruning.repair.to_channels``) -> (N,) float64.
    """
    a, b = a.double(), b.double()
    num = ((a - b) ** 2).sum(-1)  # (N, C)
    den = (a * a).sum(-1) + eps  # (N, C)
    return (num / den).mean(-1)


def following_bn(model: nn.Module, param: str) -> nn.Module | None:
    """The BatchNorm applied right after the layer owning ``param`` (see module docstring), or None."""
    layer_name = param.rsplit(".", 1)[0]
    parent_name, _, _ = layer_name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    layer = model.get_submodule(layer_name)
    out_ch = getattr(layer, "out_channels", getattr(layer, "out_features", None))
    seen = False
    for _, child in parent.named_children():
        if child is layer:
            seen = True
        elif seen and isinstance(child, nn.modules.batchnorm._BatchNorm):
            return child if child.num_features == out_ch else None
        elif seen and isinstance(child, (nn.Conv2d, nn.Linear)):
            return None
    return None


def _apply(layer: nn.Module, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    if isinstance(layer, nn.Conv2d):
        return layer._conv_forward(x, w, layer.bias)
    if isinstance(layer, nn.Linear):
        return F.linear(x, w, layer.bias)
    raise TypeError(f"RR diagnostics support Conv2d and Linear layers, got {type(layer).__name__}")


def _bn(bn: nn.Module | None, y: torch.Tensor, mean=None, var=None) -> torch.Tensor:
    if bn is None:
        return y
    mean = bn.running_mean if mean is None else mean
    var = bn.running_var if var is None else var
    return F.batch_norm(y, mean.to(y.dtype), var.to(y.dtype), bn.weight, bn.bias, False, 0.0, bn.eps)


def _layer_input(model: nn.Module, layer: nn.Module, images: torch.Tensor, batch_size: int) -> torch.Tensor:
    xs = []
    h = layer.register_forward_hook(lambda _m, inp, _o: xs.append(inp[0].detach().clone()))  # clone: later in-place ops
    try:
        for i in range(0, len(images), batch_size):
            model(images[i : i + batch_size])
    finally:
        h.remove()
    return torch.cat(xs)


@torch.no_grad()
def layer_diagnostics(model: nn.Module, entry: ScopeEntry, images: torch.Tensor, grid: Sequence[float], *,
                      tau: str = "median", eps: float = EPS, batch_size: int = 128, at: str = "conv"
                      ) -> list[dict[str, Any]]:
    """Rows {layer, n_weights, shape, sparsity, D_raw, D_repair, R} of one layer over the candidate grid,
    distortion measured ``at`` the layer output (``conv``) or after its following BatchNorm (``bn``)."""

    model.eval()
    layer = module_of(model, entry.param)
    if not isinstance(layer, (nn.Conv2d, nn.Linear)) or not entry.param.endswith(".weight"):
        raise TypeError(f"RR diagnostics support Conv2d/Linear weights, got {entry.param}")
    if at not in MEASURE_AT:
        raise ValueError(f"RR diagnostics setting 'at' must be one of {MEASURE_AT}, got {at!r}")
    bn = following_bn(model, entry.param) if at == "bn" else None
    x = _layer_input(model, layer, images, batch_size)  # dense input of the layer
    w = layer.weight.detach()
    lo, hi = entry.rows if entry.rows is not None else (0, w.shape[0])
    reg = w[lo:hi]
    y_d = _apply(layer, x, w)
    a = to_channels(_bn(bn, y_d))  # (N, C, L) dense reference activation
    var_d = _var(y_d)
    rows = []
    order = torch.argsort(reg.abs().flatten(), stable=True)
    for s in grid:
        k = n_pruned(reg.numel(), float(s))
        keep = torch.ones(reg.numel(), dtype=torch.bool)
        keep[order[:k]] = False
        wp = w.clone()
        wp[lo:hi] = reg * keep.view_as(reg).to(reg.dtype)
        y_p = _apply(layer, x, wp)
        d_raw = float(distortion(a, to_channels(_bn(bn, y_p)), eps).mean())
        var_p = _var(y_p)
        g = torch.ones_like(var_p)
        g[lo:hi] = crbn_scales(var_d[lo:hi], var_p[lo:hi], tau_of(var_p[lo:hi], tau), eps)
        y_r = y_p * _channel_view(g.to(y_p.dtype), y_p)
        if bn is not None:  # recalibrated statistics of the repaired output
            yc = to_channels(y_r).transpose(0, 1).reshape(y_r.shape[1], -1).double()  # (C, N*L)
            z = _bn(bn, y_r, yc.mean(1), yc.var(1, unbiased=True))
        else:
            z = y_r
        d_rep = float(distortion(a, to_channels(z), eps).mean())
        rows.append({"layer": entry.param, "n_weights": int(reg.numel()), "shape": json.dumps(list(reg.shape)),
                     "sparsity": float(s), "D_raw": d_raw, "D_repair": d_rep, "R": (d_rep + eps) / (d_raw + eps)})
    return rows


def _var(y: torch.Tensor) -> torch.Tensor:
    acc = Moments(full=False)
    channel_moments("y", y, acc)
    return acc.result()["y"].var  # (C,)


def _channel_view(g: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """γ (C,) broadcast over a layer output: conv (1, C, 1, 1); Linear (..., C)."""
    return g.view(1, -1, 1, 1) if y.dim() == 4 else g


def model_diagnostics(model: nn.Module, entries: list[ScopeEntry], images: torch.Tensor, grid: Sequence[float],
                      *, model_name: str = "", tau: str = "median", at: str = "conv") -> dict[str, list]:
    """Columnar table (``COLUMNS``) of every entry's diagnostics, in entry order then grid order."""
    cols: dict[str, list] = {c: [] for c in COLUMNS}
    for e in entries:
        for r in layer_diagnostics(model, e, images, grid, tau=tau, at=at):
            r["model"] = model_name
            for c in COLUMNS:
                cols[c].append(r[c])
    return cols


def cost_table(table: Mapping[str, Sequence], column: str, layers: Sequence[str], grid: Sequence[float]
               ) -> tuple[dict[str, list[float]], dict[str, int]]:
    """From a diagnostics table: ({layer: [g(layer, s) for s in grid]}, {layer: n_weights}).
    Raises ValueError naming what is missing when the table does not cover every layer × grid point."""
    vals: dict[tuple[str, float], float] = {}
    sizes: dict[str, int] = {}
    for layer, s, v, n in zip(table["layer"], table["sparsity"], table[column], table["n_weights"]):
        vals[(layer, round(float(s), 9))] = float(v)
        sizes[layer] = int(n)
    cost = {}
    for layer in layers:
        try:
            cost[layer] = [vals[(layer, round(float(s), 9))] for s in grid]
        except KeyError:
            raise ValueError(f"diagnostics table lacks layer {layer} at some candidate of {list(grid)}") from None
    return cost, {layer: sizes[layer] for layer in layers}
