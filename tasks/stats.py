"""The shared "accumulate statistics, then decide" mechanism.

Methods that need calibration statistics (CORP, RR, SnapViT, ...) do not write their own forward loops: they
name the tensors they want to observe as ``Tap`` s (a module, its input or output, and an optional map applied
to the captured tensor), hand an ``Accumulator`` to ``collect``, and read ``acc.result()`` afterwards.
``collect`` streams calibration images in batches under ``torch.no_grad`` in eval mode, and the accumulators
keep running sums (float64 by default), so memory does not grow with the number of images.

Accumulator protocol: ``update(name, tensor)`` once per tap per batch, ``result()`` when the pass is over.
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Mapping, Protocol

import torch
import torch.nn as nn


class Accumulator(Protocol):
    def update(self, name: str, x: torch.Tensor) -> None: ...

    def result(self) -> Any: ...


@dataclass(frozen=True)
class Tap:
    """What to observe: ``module``'s first positional input (``where="input"``) or its output, optionally
    mapped by ``fn`` (e.g. a projection computed from the input) before it reaches the accumulator."""

    module: nn.Module
    where: str = "output"
    fn: Callable[[torch.Tensor], torch.Tensor] | None = None


@contextmanager
def tapped(taps: Mapping[str, Tap], acc: Accumulator) -> Iterator[Accumulator]:
    """Forward hooks feeding every tap into ``acc`` for as long as the context is open."""
    handles = []
    for name, tap in taps.items():
        if tap.where not in ("input", "output"):
            raise ValueError(f"tap {name!r}: where must be 'input' or 'output', got {tap.where!r}")

        def hook(_mod, inp, out, name=name, tap=tap):
            x = inp[0] if tap.where == "input" else out
            acc.update(name, tap.fn(x) if tap.fn is not None else x)

        handles.append(tap.module.register_forward_hook(hook))
    try:
        yield acc
    finally:
        for h in handles:
            h.remove()


@torch.no_grad()
def collect(model: nn.Module, images: torch.Tensor, taps: Mapping[str, Tap], acc: Accumulator,
            batch_size: int = 64) -> Accumulator:
    """Stream (N, C, H, W) images through ``model`` (eval mode, no grad), feeding ``taps`` into ``acc``."""
    was_training = model.training
    model.eval()
    dev = next(model.parameters()).device
    try:
        with tapped(taps, acc):
            for i in range(0, len(images), batch_size):
                model(images[i : i + batch_size].to(dev))
    finally:
        model.train(was_training)
    return acc


@dataclass
class MomentStats:
    count: int  # number of feature vectors seen
    mean: torch.Tensor  # (F,)
    second: torch.Tensor  # (F, F) E[x x^T] (or (F,) E[x^2] when only the diagonal was kept)

    @property
    def energy(self) -> torch.Tensor:
        """E[x_j^2] per feature, (F,)."""
        return self.second.diagonal() if self.second.dim() == 2 else self.second

    @property
    def var(self) -> torch.Tensor:
        """Population (1/count) variance per feature, E[x_j^2] - mu_j^2 clamped at 0, (F,)."""
        return (self.energy - self.mean * self.mean).clamp_min(0.0)

    @property
    def cov(self) -> torch.Tensor:
        """Centered (biased, 1/count) covariance E[x x^T] - mu mu^T, (F, F)."""
        if self.second.dim() != 2:
            raise ValueError("covariance needs full second moments (Moments(full=True))")
        return self.second - torch.outer(self.mean, self.mean)


class Moments:
    """Running mean and second moments of the last dimension; leading dims are samples ((B, T, F) -> B*T).

    full=True keeps E[x x^T] (F, F); full=False only E[x^2] (F,). Sums are kept in ``dtype`` (float64)."""

    def __init__(self, full: bool = True, dtype: torch.dtype = torch.float64) -> None:
        self.full, self.dtype = full, dtype
        self._n: dict[str, int] = {}
        self._s1: dict[str, torch.Tensor] = {}
        self._s2: dict[str, torch.Tensor] = {}

    def update(self, name: str, x: torch.Tensor) -> None:
        x = x.detach().reshape(-1, x.shape[-1]).to(self.dtype)  # (n, F)
        s2 = x.T @ x if self.full else (x * x).sum(0)  # (F, F) or (F,)
        if name not in self._n:
            self._n[name], self._s1[name], self._s2[name] = 0, torch.zeros_like(x[0]), torch.zeros_like(s2)
        self._n[name] += x.shape[0]
        self._s1[name] += x.sum(0)
        self._s2[name] += s2

    def result(self) -> dict[str, MomentStats]:
        return {k: MomentStats(n, (self._s1[k] / n).cpu(), (self._s2[k] / n).cpu()) for k, n in self._n.items()}


@dataclass
class HeadQKStats:
    images: int  # number of sequences (images) seen
    tokens: int  # number of token rows seen (images * T)
    gram_q: torch.Tensor  # (H, dh, dh) E_token[q q^T] per head
    gram_k: torch.Tensor  # (H, dh, dh) E_token[k k^T] per head
    energy: torch.Tensor  # (H, dh) E_image[ ||q_j||^2 ||k_j||^2 ], norms over the tokens of one image


class HeadQK:
    """Per-head query/key statistics from a fused projection output (B, T, >= 2*H*dh): q = [..., :H*dh],
    k = [..., H*dh : 2*H*dh], head h owns dims [h*dh, (h+1)*dh). Running float64 sums."""

    def __init__(self, num_heads: int, head_dim: int, dtype: torch.dtype = torch.float64) -> None:
        self.h, self.dh, self.dtype = num_heads, head_dim, dtype
        self._acc: dict[str, list] = {}

    def update(self, name: str, x: torch.Tensor) -> None:
        b, t, _ = x.shape
        hd = self.h * self.dh
        x = x.detach().to(self.dtype)
        q = x[..., :hd].reshape(b, t, self.h, self.dh).transpose(1, 2)  # (B, H, T, dh)
        k = x[..., hd : 2 * hd].reshape(b, t, self.h, self.dh).transpose(1, 2)  # (B, H, T, dh)
        gq = torch.einsum("bhti,bhtj->hij", q, q)  # (H, dh, dh)
        gk = torch.einsum("bhti,bhtj->hij", k, k)  # (H, dh, dh)
        en = ((q * q).sum(2) * (k * k).sum(2)).sum(0)  # (H, dh): sum over images of ||q_j||^2 ||k_j||^2
        if name not in self._acc:
            self._acc[name] = [0, 0, torch.zeros_like(gq), torch.zeros_like(gk), torch.zeros_like(en)]
        a = self._acc[name]
        a[0] += b
        a[1] += b * t
        a[2] += gq
        a[3] += gk
        a[4] += en

    def result(self) -> dict[str, HeadQKStats]:
        return {k: HeadQKStats(b, n, (gq / n).cpu(), (gk / n).cpu(), (en / b).cpu())
                for k, (b, n, gq, gk, en) in self._acc.items()}


class Several:
    """Route taps to different accumulators: ``Several({tap_name: accumulator})``; result() maps names."""

    def __init__(self, routes: Mapping[str, Accumulator]) -> None:
        self.routes = dict(routes)

    def update(self, name: str, x: torch.Tensor) -> None:
        self.routes[name].update(name, x)

    def result(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for acc in {id(a): a for a in self.routes.values()}.values():
            out.update(acc.result())
        return out
