"""CORP closed-form math (docs/methods.md#corp, the CORP paper §3.3-3.4, App. B), as pure float64 functions with shape comments.

MLP (fold into fc2): x = [x_S; x_P] hidden activations, W = [W_S W_P] fc2 weight, b fc2 bias.
    B = Sigma_PS (Sigma_SS + lam I)^-1,  c = mu_P - B mu_S,  W~_S = W_S + W_P B,  b~ = b + W_P c
  with Sigma the *centered* covariance (App. B.1: centering first, so the intercept c absorbs the means).
  lam (docs/methods.md#corp, setting ``lambda``):
  - ``authors`` (default, the authors' code): lam = max(1e-3, rho * tr(Sigma_SS) / p), rho the Chen et al.
    (2010) OAS intensity of Sigma_SS (kept units only, p = |S|, n = tokens) -- ``authors_lambda``;
  - ``oas`` (the project's earlier rule): scikit-learn's OAS of the *full* covariance expressed as a ridge:
    OAS shrinks Sigma to (1-rho) Sigma + rho mu I (mu = tr Sigma / p); regressing x_P on x_S under it gives
    B = Sigma_PS (Sigma_SS + rho/(1-rho) mu I)^-1, i.e. lam = rho mu / (1 - rho) (rho = 1: B = 0);
  - a float: a fixed absolute lam (the authors' ``auto_shrinkage: false``).

Q/K (per head, tokens as rows): Q = [Q_S Q_P], K = [K_S K_P]; the missing logits Q_P K_P^T ~ Q_S M K_S^T:
    (Q_S^T Q_S) M (K_S^T K_S) + lam M = (Q_S^T Q_P)(K_P^T K_S)
  built from per-head Grams only (never the n x n logits); solved exactly by eigendecomposition of the two
  symmetric PSD Grams. I + M = R Sigma S^T (SVD), U = R Sigma^1/2, V = S Sigma^1/2, U V^T = I + M.
  Folding with timm's row layout (q = W_q x + b_q, W_q rows = dims): W_q,S <- U^T W_q,S, b_q,S <- U^T b_q,S
  (and K with V): then q~ = U^T q_S, k~ = V^T k_S and q~ . k~ = q_S^T U V^T k_S = q_S^T (I + M) k_S exactly,
  biases included (Q = X W + 1 b^T  ->  Q U = X (W U) + 1 (U^T b)^T).
"""
from __future__ import annotations

import torch


def oas_shrinkage(cov: torch.Tensor, n_samples: int) -> float:
    """Oracle-Approximating Shrinkage coefficient rho in [0, 1] of a (p, p) empirical covariance
    (the formula of scikit-learn's ``OAS``)."""
    p = cov.shape[0]
    alpha = float((cov**2).mean())
    mu = float(torch.trace(cov)) / p
    num = alpha + mu**2
    den = (n_samples + 1) * (alpha - mu**2 / p)
    return 1.0 if den == 0 else min(num / den, 1.0)


def chen_oas_rho(cov_ss: torch.Tensor, n_samples: int) -> float:
    """The authors' shrinkage intensity on Sigma_SS (p, p): the Chen et al. (2010) OAS formula
    rho = min(1, ((1 - 2/p) tr(S^2) + tr(S)^2) / ((n + 1 - 2/p) (tr(S^2) - tr(S)^2 / p))); a zero or undefined
    denominator (p = 1, S = c I) gives rho = 1, as the authors' torch code does (min(1, nan/inf) = 1)."""
    s = cov_ss.double()
    p = s.shape[0]
    tr, tr2 = float(torch.trace(s)), float((s * s.T).sum())  # tr(S S) = sum_ij S_ij S_ji: O(p^2), not a matmul
    den = (n_samples + 1 - 2 / p) * (tr2 - tr * tr / p)
    num = (1 - 2 / p) * tr2 + tr * tr
    if den == 0 or not den == den:
        return 1.0
    rho = num / den
    return 1.0 if not rho == rho or rho == float("inf") else min(1.0, rho)


def authors_lambda(cov_ss: torch.Tensor, n_samples: int, floor: float = 1e-3) -> float:
    """lam = max(floor, rho tr(Sigma_SS)/p) (the authors' ``_compute_lambda``); floor alone when n <= 1 or p = 0.
    cov_ss: (p, p) centred covariance of the kept units; n_samples = feature vectors (tokens)."""
    p = cov_ss.shape[0]
    if n_samples <= 1 or p == 0:
        return floor
    return max(floor, chen_oas_rho(cov_ss, n_samples) * float(torch.trace(cov_ss.double())) / p)


def oas_ridge(cov: torch.Tensor, n_samples: int) -> float:
    """The ridge lam that OAS shrinkage of the full covariance amounts to for the regression (inf: B = 0)."""
    rho = oas_shrinkage(cov, n_samples)
    mu = float(torch.trace(cov)) / cov.shape[0]
    return float("inf") if rho >= 1.0 else rho * mu / (1.0 - rho)


def solve_spd_right(rhs: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
    """X with X a = rhs for symmetric PSD a (Cholesky; least squares when a is singular).

    rhs: (m, k), a: (k, k) -> (m, k)."""
    chol, info = torch.linalg.cholesky_ex(a)
    if int(info) == 0:
        return torch.cholesky_solve(rhs.T, chol).T  # a symmetric: X^T = a^-1 rhs^T
    return torch.linalg.lstsq(a, rhs.T).solution.T


def affine_predictor(mean: torch.Tensor, cov: torch.Tensor, keep: torch.Tensor, lam: float
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """Ridge fit x_P ~ B x_S + c from centered statistics.

    mean: (F,), cov: (F, F) centered, keep: (F,) bool (S = keep, P = ~keep) -> B (|P|, |S|), c (|P|,)."""
    mean, cov = mean.double(), cov.double()
    s, p = keep.nonzero().flatten(), (~keep).nonzero().flatten()
    if len(s) == 0 or lam == float("inf"):
        b = torch.zeros(len(p), len(s), dtype=torch.float64)
    else:
        a = cov[s][:, s] + lam * torch.eye(len(s), dtype=torch.float64)  # (|S|, |S|)
        b = solve_spd_right(cov[p][:, s], a)  # (|P|, |S|)
    c = mean[p] - b @ mean[s]  # (|P|,)
    return b, c


def fold_mlp(w: torch.Tensor, bias: torch.Tensor, keep: torch.Tensor, b: torch.Tensor, c: torch.Tensor
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """W~_S = W_S + W_P B, b~ = bias + W_P c.  w: (D, F) dense fc2 weight, bias: (D,), keep: (F,) bool,
    b: (|P|, |S|), c: (|P|,) -> (W~_S (D, |S|), b~ (D,)), float64."""
    w, bias = w.double(), bias.double()
    ws, wp = w[:, keep], w[:, ~keep]  # (D, |S|), (D, |P|)
    return ws + wp @ b, bias + wp @ c


def sylvester_ridge(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, lam: float) -> torch.Tensor:
    """Solve a M b + lam M = c for symmetric PSD a (k, k), b (k, k); c (k, k) -> M (k, k).

    a = Ua diag(ea) Ua^T, b = Ub diag(eb) Ub^T  =>  (ea_i eb_j + lam) (Ua^T M Ub)_ij = (Ua^T c Ub)_ij."""
    ea, ua = torch.linalg.eigh(a.double())
    eb, ub = torch.linalg.eigh(b.double())
    ct = ua.T @ c.double() @ ub  # (k, k)
    den = torch.outer(ea, eb) + lam  # (k, k)
    mt = torch.where(den.abs() > 1e-300, ct / den, torch.zeros_like(ct))
    return ua @ mt @ ub.T


def qk_compensation(gram_q: torch.Tensor, gram_k: torch.Tensor, keep: torch.Tensor, ridge: float | None = None, *,
                    lam: float | None = None, symmetrize: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """One head: Grams gram_q = E[q q^T], gram_k = E[k k^T] (dh, dh) over tokens, keep (dh,) bool.

    lam (mean-Gram units) is given, or lam = ridge * mean(diag G_Q,SS) * mean(diag G_K,SS) (the earlier relative
    rule). symmetrize: I + M <- sym(I + M) and singular values clamped at 1e-6 before the split (the authors).
    Returns U, V (|S|, |S|), U V^T = I + M (or its symmetric part)."""
    s, p = keep.nonzero().flatten(), (~keep).nonzero().flatten()
    k = len(s)
    eye = torch.eye(k, dtype=torch.float64)
    if k == 0 or len(p) == 0:
        return eye, eye
    gq, gk = gram_q.double(), gram_k.double()
    a, bb = gq[s][:, s], gk[s][:, s]  # (k, k) Q_S^T Q_S, K_S^T K_S
    rhs = gq[s][:, p] @ gk[p][:, s]  # (k, k) (Q_S^T Q_P)(K_P^T K_S)
    if lam is None:
        lam = float(ridge if ridge is not None else 1e-3) * float(a.diagonal().mean()) * float(bb.diagonal().mean())
    m = sylvester_ridge(a, bb, rhs, lam)
    t = eye + m
    if symmetrize:
        t = (t + t.T) / 2
    r, sig, sh = torch.linalg.svd(t)  # I + M = R diag(sig) S^T  (sh = S^T)
    root = sig.clamp_min(1e-6).sqrt() if symmetrize else sig.sqrt()
    return r * root, sh.T * root  # U = R Sigma^1/2, V = S Sigma^1/2
