"""CR+BN repair operator (docs/methods.md#relative-repairability-crbn-rr, the Relative Repairability paper appendix
A): label-free, forward passes only, no gradients.

For every pruned layer ℓ and output channel c (conv output channel, or Linear output feature):
    r_c = log(σ²_d,c + ε) − log(σ²_p,c + ε)      dense vs pruned activation variance on calibration images
    λ_c = σ²_p,c / (σ²_p,c + τ_ℓ)                 shrink the correction of collapsed channels
    γ_c = exp(½ λ_c r_c)                          the output filter (and its bias) is multiplied by γ_c
then every BatchNorm's running statistics are recalibrated on unlabeled batches: ``bn_batches`` (20) batches of
``bn_batch_size`` (128) images with the module's default momentum (0.1), starting from the current (dense)
statistics (``bn_reset`` false). With reset + cumulative averaging a following BN would undo γ exactly.

Decisions (the paper leaves them open):
- τ_ℓ = median of the layer's pruned channel variances (setting ``tau``: "median" | "mean"), floored at ε
  (``crbn_scales``: a median of 0 would give collapsed channels the full correction).
- Variances are population variances over every non-channel position (batch × H × W, or batch × tokens),
  accumulated in float64 in one pass; all pruned layers are measured in the same pass of the fully pruned
  model (simultaneous, not layer-by-layer sequential), then all scales are applied, then BN recalibration.
- Models without BatchNorm (ViTs): the analogous operator is the per-output-feature variance matching above on
  each pruned Linear, with no recalibration step (setting ``no_bn``: "variance_match" (default) | "reject").
- Only output channels inside the pruned region are scaled (the Q/K rows of a fused qkv, never V rows).

The stats hooks here are a minimal local mechanism (``channel_moments``); tasks/stats.py (another branch) is
meant to become the shared one.
"""
from __future__ import annotations

from typing import Iterable, Mapping

import torch
import torch.nn as nn

from tasks.models.params import module_of
from tasks.stats import Moments
from tasks.models.adapter import ScopeEntry

EPS = 1e-8
TAU_RULES = ("median", "mean")


def to_channels(y: torch.Tensor) -> torch.Tensor:
    """A layer output -> (N, C, L): conv (N, C, H, W) -> (N, C, HW); Linear (N, T, F) -> (N, F, T); (N, F) -> (N, F, 1)."""
    if y.dim() == 4:
        return y.flatten(2)
    if y.dim() == 3:
        return y.transpose(1, 2)
    return y.unsqueeze(-1)


def crbn_scales(var_dense: torch.Tensor, var_pruned: torch.Tensor, tau: float, eps: float = EPS) -> torch.Tensor:
    """γ (C,) from dense and pruned per-channel variances (C,) and the layer's shrinkage scale τ.

    τ is floored at ε: where more than half of a layer's channels collapse (σ²_p = 0: whole units or heads
    removed) the median is 0, and λ = σ²_p / σ²_p = 1 for every channel would give a collapsed channel the full
    correction sqrt(σ²_d / ε), ~10³–10⁴, which the shrinkage exists to prevent (the paper: collapsed channels
    "receive an attenuated correction"). A zeroed filter is unchanged by it, but its bias is not: an attention
    block whose heads are all removed outputs its projection's bias, which was multiplied by ~4·10³. With the
    floor a collapsed channel gets λ ≈ 0 (γ ≈ 1); every layer whose τ exceeds ε is unchanged."""
    r = torch.log(var_dense + eps) - torch.log(var_pruned + eps)  # (C,)
    tau = max(eps, float(tau))  # (a NaN τ gives ε, not NaN)
    lam = var_pruned / (var_pruned + tau) if tau > 0 else (var_pruned > 0).to(var_pruned.dtype)  # eps = 0: limit
    return torch.where(lam > 0, torch.exp(0.5 * lam * r), torch.ones_like(r))  # λ = 0: γ = 1 (r may be inf at ε = 0)


def tau_of(var_pruned: torch.Tensor, rule: str = "median") -> float:
    if rule not in TAU_RULES:
        raise ValueError(f"tau must be one of {TAU_RULES}, got {rule!r}")
    v = var_pruned.double()
    return float(v.median() if rule == "median" else v.mean())  # torch median: lower middle for even C


def channel_moments(name: str, y: torch.Tensor, acc: Moments) -> None:
    """Add a layer output's channels to ``acc``: conv (N, C, H, W), tokens (N, T, C) or (N, C) -> rows of C."""
    acc.update(name, to_channels(y.detach()).transpose(1, 2))  # (N, L, C)


@torch.no_grad()
def channel_variances(model: nn.Module, params: Iterable[str], images: torch.Tensor, batch_size: int = 128
                      ) -> dict[str, torch.Tensor]:
    """{param: (C,) float64 population variance of its module's output channels} over ``images``."""
    params = list(params)
    acc = Moments(full=False)  # float64 sums per channel
    hooks = [module_of(model, p).register_forward_hook(lambda _m, _i, out, p=p: channel_moments(p, out, acc))
             for p in params]
    was = model.training
    model.eval()
    dev = next(model.parameters()).device
    try:
        for i in range(0, len(images), batch_size):
            model(images[i : i + batch_size].to(dev))
    finally:
        for h in hooks:
            h.remove()
        model.train(was)
    stats = acc.result()
    return {p: stats[p].var for p in params}


def unrepairable_reason(model: nn.Module, param: str) -> str | None:
    """Why CR+BN / RR diagnostics cannot observe the layer of ``param`` (None when they can): the operator needs
    a Conv2d or Linear weight whose module forward runs (torchvision's fused MultiheadAttention projections
    are read directly by F.multi_head_attention_forward, so no forward hook sees their outputs)."""
    layer_name = param.rsplit(".", 1)[0]
    mod = model.get_submodule(layer_name)
    parent = model.get_submodule(layer_name.rpartition(".")[0]) if "." in layer_name else model
    if isinstance(mod, nn.MultiheadAttention) or isinstance(parent, nn.MultiheadAttention):
        return f"{param} is a fused nn.MultiheadAttention projection (its output is not observable by hooks)"
    if not isinstance(mod, (nn.Conv2d, nn.Linear)) or not param.endswith(".weight"):
        return f"{param} is not a Conv2d/Linear weight"
    return None


def has_batchnorm(model: nn.Module) -> bool:
    return any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules())


BN_SOURCES = ("calib", "calib_once", "train")


def recal_batches(n: int, batches: int, batch_size: int, source: str, seed: int = 0) -> list[torch.Tensor]:
    """Row indices of each recalibration batch (docs/methods.md#relative-repairability-crbn-rr).
    ``calib`` / ``train``: ``batches`` batches of ``batch_size`` rows drawn with replacement from the n source
    images by a seeded generator (20 × 128 images even from 128). ``calib_once``: consecutive batches, each
    image at most once (fewer batches when n < batches·batch_size; a last batch of one is dropped)."""
    if source == "calib_once":
        out = [torch.arange(i, min(i + batch_size, n)) for i in range(0, min(n, batches * batch_size), batch_size)]
        return [b for b in out if len(b) >= 2]  # a batch of one has no variance
    if source not in BN_SOURCES:
        raise ValueError(f"bn_source must be one of {BN_SOURCES}, got {source!r}")
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(n, (batch_size,), generator=g) for _ in range(batches)] if n >= 1 else []


@torch.no_grad()
def recalibrate_bn(model: nn.Module, images: torch.Tensor, batches: int = 20, batch_size: int = 128,
                   modules: list[nn.Module] | None = None, *, momentum: float | str | None = "module",
                   reset: bool = False, source: str = "calib_once", seed: int = 0) -> int:
    """Re-estimate every BatchNorm's running stats (or only ``modules``') with forward passes in train mode;
    labels and gradients unused; every other module stays in eval mode (standard practice: all BNs in train
    mode together, so a BN sees inputs normalized by upstream batch statistics).

    momentum: ``"module"`` = each BN's own momentum (PyTorch 0.1, the paper's "default running-statistics
    momentum"), a float, or None = cumulative average. reset: start from (0, 1) instead of the current
    (dense) statistics. Reset + cumulative = the exact mean of the batch statistics (the earlier behaviour).
    Returns the number of batches used."""
    bns = [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    if modules is not None:
        bns = [m for m in bns if any(m is x for x in modules)]
    if not bns:
        return 0
    was = model.training
    model.eval()
    moms = [m.momentum for m in bns]
    for m in bns:
        if reset:
            m.reset_running_stats()
        if momentum != "module":
            m.momentum = momentum
        m.train()
    dev = next(model.parameters()).device
    rows = recal_batches(len(images), batches, batch_size, source, seed)
    try:
        for r in rows:
            model(images[r].to(dev))
    finally:
        for m, mom in zip(bns, moms):
            m.momentum = mom
        model.train(was)
    return len(rows)


@torch.no_grad()
def scale_output_channels(model: nn.Module, entry: ScopeEntry, gamma: torch.Tensor) -> None:
    """Multiply the output filters (dim 0) of a pruned layer, and its bias, by γ, inside the region only."""
    mod = module_of(model, entry.param)
    w = mod.get_parameter(entry.param.rsplit(".", 1)[1])
    lo, hi = entry.rows if entry.rows is not None else (0, w.shape[0])
    g = gamma[lo:hi].to(w.device, w.dtype)
    w[lo:hi].mul_(g.view(-1, *([1] * (w.dim() - 1))))
    if getattr(mod, "bias", None) is not None and entry.param.endswith("weight"):
        mod.bias[lo:hi].mul_(g)


def crbn_repair(model: nn.Module, dense: nn.Module, entries: list[ScopeEntry], images: torch.Tensor, *,
                tau: str = "median", bn_batches: int = 20, bn_batch_size: int = 128, eps: float = EPS,
                bn_momentum: float | str | None = "module", bn_reset: bool = False, bn_source: str = "calib",
                bn_images: torch.Tensor | None = None, seed: int = 0) -> dict[str, torch.Tensor]:
    """Apply CR+BN in place to a pruned ``model`` (``dense`` is its unpruned twin). γ is measured on
    ``images``; BN recalibration draws from ``bn_images`` (default: ``images``). Returns {param: γ}."""
    params = [e.param for e in entries]
    var_d = channel_variances(dense, params, images, bn_batch_size)
    var_p = channel_variances(model, params, images, bn_batch_size)
    gammas = {}
    for e in entries:
        vd, vp = var_d[e.param], var_p[e.param]
        lo, hi = e.rows if e.rows is not None else (0, vp.numel())
        g = torch.ones_like(vp)
        g[lo:hi] = crbn_scales(vd[lo:hi], vp[lo:hi], tau_of(vp[lo:hi], tau), eps)
        scale_output_channels(model, e, g)
        gammas[e.param] = g
    recalibrate_bn(model, images if bn_images is None else bn_images, bn_batches, bn_batch_size,
                   momentum=bn_momentum, reset=bn_reset, source=bn_source, seed=seed)
    return gammas


def bn_state_names(model: nn.Module) -> set[str]:
    out = set()
    for name, m in model.named_modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm):
            out.update(f"{name}.{b}" for b in ("running_mean", "running_var", "num_batches_tracked"))
    return out


def scaled_bias_names(model: nn.Module, entries: list[ScopeEntry]) -> set[str]:
    out = set()
    for e in entries:
        mod = module_of(model, e.param)
        if getattr(mod, "bias", None) is not None:
            out.add(e.param.rsplit(".", 1)[0] + ".bias")
    return out


def check_finite(gammas: Mapping[str, torch.Tensor]) -> None:
    for k, g in gammas.items():
        if not bool(torch.isfinite(g).all()):
            raise FloatingPointError(f"CR+BN produced a non-finite channel scale for {k}")
