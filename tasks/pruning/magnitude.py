"""Magnitude pruners: layerwise (uniform) and global unstructured magnitude, and N:M semi-structured."""
from __future__ import annotations

import torch

from tasks.pruning.allocation_math import n_pruned
from tasks.pruning.base import PRUNERS, Pruner, _keep_all_but_smallest


@PRUNERS.register("magnitude")
class MagnitudePruner(Pruner):
    """Layerwise (uniform) unstructured magnitude: every prunable tensor reaches the sparsity."""


    def __call__(self, weights, sparsity, *, seed, ctx=None, **settings):
        return {k: _keep_all_but_smallest(w.detach().abs(), n_pruned(w.numel(), sparsity)) for k, w in weights.items()}


@PRUNERS.register("global_magnitude")
class GlobalMagnitudePruner(Pruner):
    """One magnitude threshold across all prunable tensors (exact global count)."""


    def __call__(self, weights, sparsity, *, seed, ctx=None, **settings):
        names = list(weights)
        flat = torch.cat([weights[k].detach().abs().flatten().float() for k in names])  # (P,)
        keep = _keep_all_but_smallest(flat, n_pruned(flat.numel(), sparsity))
        out, start = {}, 0
        for k in names:
            n = weights[k].numel()
            out[k] = keep[start : start + n].view_as(weights[k])
            start += n
        return out


def nm_mask(w: torch.Tensor, n: int, m: int) -> torch.Tensor:
    """Keep the n largest |w| in every group of m consecutive weights along the (flattened) input dim.

    w: (out, in) Linear or (out, in, kh, kw) Conv -> viewed as (out, in*kh*kw) -> groups (out, G, m).
    """
    w2 = w.detach().abs().reshape(w.shape[0], -1)  # (out, I)
    if w2.shape[1] % m:
        raise ValueError(f"input dimension {w2.shape[1]} is not divisible by M={m}")
    groups = w2.view(w2.shape[0], -1, m)  # (out, G, m)
    order = torch.argsort(groups, dim=-1, descending=True, stable=True)  # (out, G, m)
    keep = torch.zeros_like(groups, dtype=torch.bool)
    keep.scatter_(-1, order[..., :n], True)
    return keep.view_as(w)


@PRUNERS.register("nm")
class NMPruner(Pruner):
    """N:M semi-structured (2:4 default); sparsity is 1 - N/M by construction."""

    settings_schema = {"n": int, "m": int}

    def check(self, settings):
        super().check(settings)
        n, m = settings.get("n", 2), settings.get("m", 4)
        if not (0 < n < m):
            raise ValueError(f"pruner 'nm' needs 0 < n < m, got n={n}, m={m}")

    def fixed_sparsity(self, settings):
        return 1.0 - settings.get("n", 2) / settings.get("m", 4)

    def pattern(self, sparsity, settings):
        return f"{settings.get('n', 2)}:{settings.get('m', 4)}"

    def check_model(self, model, adapter, scope, settings):
        m = settings.get("m", 4)
        params = dict(model.named_parameters())
        for e in adapter.scope(model, scope):
            width = params[e.param][0].numel()
            if width % m:
                raise ValueError(f"M={m} does not divide the input width {width} of {e.param}")

    def __call__(self, weights, sparsity, *, seed, ctx=None, n: int = 2, m: int = 4):
        return {k: nm_mask(w, n, m) for k, w in weights.items()}
