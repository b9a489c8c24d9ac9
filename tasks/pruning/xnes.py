"""Exponential natural evolution strategies (xNES; Glasmachers et al., GECCO 2010), maximizing a black box.

Pure function of (fitness, start, seed): no model, no I/O. The search distribution is N(m, A A^T) with
A = sigma * B, det(B) = 1. Standard hyperparameters (the paper's defaults):

- population  lambda = 4 + floor(3 ln d)
- utilities   u_k = max(0, ln(lambda/2 + 1) - ln k) / sum_j max(...) - 1/lambda   (k = rank, 1 = best)
- rates       eta_m = 1, eta_sigma = eta_B = 3 (3 + ln d) / (5 d sqrt(d))

Update with s_k ~ N(0, I) and x_k = m + sigma B s_k (natural gradient in local coordinates):
  G_delta = sum u_k s_k,  G_M = sum u_k (s_k s_k^T - I),  G_sigma = tr(G_M) / d,  G_B = G_M - G_sigma I
  m <- m + eta_m sigma B G_delta,  sigma <- sigma exp(eta_sigma G_sigma / 2),  B <- B expm(eta_B G_B / 2)
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

import torch


@dataclass
class XnesResult:
    mean: torch.Tensor  # (d,) final search mean
    sigma: float
    B: torch.Tensor  # (d, d), det 1
    best_x: torch.Tensor  # (d,) best sample seen
    best_f: float
    history: list[float] = field(default_factory=list)  # best fitness of each generation
    evaluations: int = 0
    updates: int = 0  # distribution updates made

    @property
    def cov(self) -> torch.Tensor:
        a = self.sigma * self.B
        return a @ a.T  # (d, d)


def default_popsize(d: int) -> int:
    return 4 + int(math.floor(3 * math.log(max(d, 1))))


def utilities(n: int) -> torch.Tensor:
    """(n,) rank-based utilities for ranks 1..n (best first); they sum to 0."""
    k = torch.arange(1, n + 1, dtype=torch.float64)
    raw = torch.clamp(math.log(n / 2 + 1) - torch.log(k), min=0.0)
    return raw / raw.sum() - 1.0 / n


def xnes(fitness: Callable[[torch.Tensor], float], m0: torch.Tensor, sigma0: float = 1.0, iterations: int = 50,
         popsize: int = 0, seed: int = 0, eta_m: float = 1.0, eta_cov: float | None = None,
         evaluations: int | None = None) -> XnesResult:
    """Maximize ``fitness`` over R^d starting at N(m0, sigma0^2 I); ``popsize`` 0 = the default.

    ``evaluations`` (the authors' pypop7 budget, docs/methods.md#snapvit): stop after that many fitness
    evaluations instead of ``iterations`` generations; a last incomplete generation is evaluated (its samples
    can become the best) but does not update the distribution. ``history`` has one entry per generation."""
    m = m0.detach().to(torch.float64).clone()
    d = m.numel()
    lam = popsize or default_popsize(d)
    eta = eta_cov if eta_cov is not None else 3 * (3 + math.log(d)) / (5 * d * math.sqrt(d))
    sigma, B = float(sigma0), torch.eye(d, dtype=torch.float64)
    u = utilities(lam)  # (lam,)
    gen = torch.Generator().manual_seed(seed)
    eye = torch.eye(d, dtype=torch.float64)
    best_x, best_f, hist, evals, updates = m.clone(), -math.inf, [], 0, 0
    gens = iterations if evaluations is None else -(-evaluations // lam)
    for _ in range(gens):
        s = torch.randn(lam, d, generator=gen, dtype=torch.float64)  # (lam, d)
        x = m + sigma * s @ B.T  # (lam, d)
        n = lam if evaluations is None else min(lam, evaluations - evals)
        f = torch.tensor([float(fitness(xi)) for xi in x[:n]], dtype=torch.float64)  # (n,)
        evals += n
        order = torch.argsort(-f, stable=True)  # best first
        if f[order[0]] > best_f:
            best_f, best_x = float(f[order[0]]), x[order[0]].clone()
        hist.append(float(f[order[0]]))
        if n < lam:  # incomplete last generation: evaluated, no update
            break
        s_sorted = s[order]  # (lam, d)
        g_delta = u @ s_sorted  # (d,)
        g_m = torch.einsum("k,ki,kj->ij", u, s_sorted, s_sorted) - u.sum() * eye  # (d, d)
        g_sigma = torch.trace(g_m) / d
        g_b = g_m - g_sigma * eye
        m = m + eta_m * sigma * (B @ g_delta)
        sigma = sigma * math.exp(eta * float(g_sigma) / 2)
        B = B @ torch.linalg.matrix_exp(eta * g_b / 2)
        updates += 1
    return XnesResult(m, sigma, B, best_x, best_f, hist, evals, updates)
