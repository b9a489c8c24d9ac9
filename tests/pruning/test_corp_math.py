"""CORP's closed-form math (tasks.healing.corp_math, the λ of tasks.healing.corp) and the shared statistics hooks
(tasks.stats) against references: streamed moments and head Q/K Grams equal direct float64 computations; the MLP
compensation equals scikit-learn's Ridge, the OAS shrinkage scikit-learn's OAS, the Sylvester solve a Kronecker
solve, the Q/K compensation the ridge fit of the missing logits; the authors' automatic λ against hand values.
CORP's masks, healer and shrink: tests/pruning/test_corp.py."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn as nn

from tasks.healing import HEALERS, corp_math
from tasks.stats import HeadQK, Moments, Several, Tap, collect

CORP_H = HEALERS.get("corp")

# --- shared statistics hooks ---------------------------------------------------------------------------------

def test_moments_stream_equals_direct_float64():
    torch.manual_seed(0)
    lin = nn.Sequential(nn.Linear(5, 7), nn.GELU(), nn.Linear(7, 3))
    x = torch.randn(50, 4, 5)  # 50 "images" of 4 tokens
    acc = collect(lin, x, {"h": Tap(lin[2], "input"), "o": Tap(lin[2])},
                  Several({"h": Moments(full=True), "o": Moments(full=False)}), batch_size=7).result()
    with torch.no_grad():
        h = lin[1](lin[0](x)).reshape(-1, 7).double()  # (200, 7)
        o = lin(x).reshape(-1, 3).double()
    assert acc["h"].count == 200 and acc["h"].mean.dtype == torch.float64
    torch.testing.assert_close(acc["h"].mean, h.mean(0))
    torch.testing.assert_close(acc["h"].cov, torch.cov(h.T, correction=0))
    torch.testing.assert_close(acc["o"].energy, (o * o).mean(0))
    assert not any(m._forward_hooks for m in lin.modules())  # hooks removed


def test_head_qk_stats_equal_direct():
    torch.manual_seed(1)
    h, dh, b, t = 2, 3, 5, 4
    x = torch.randn(b, t, 3 * h * dh)
    acc = HeadQK(h, dh)
    acc.update("a", x[:2])
    acc.update("a", x[2:])
    st = acc.result()["a"]
    q = x[..., : h * dh].double().reshape(b, t, h, dh)
    k = x[..., h * dh : 2 * h * dh].double().reshape(b, t, h, dh)
    for i in range(h):
        torch.testing.assert_close(st.gram_q[i], q[:, :, i].reshape(-1, dh).T @ q[:, :, i].reshape(-1, dh) / (b * t))
        energy = torch.stack([(q[n, :, i] ** 2).sum(0) * (k[n, :, i] ** 2).sum(0) for n in range(b)]).mean(0)
        torch.testing.assert_close(st.energy[i], energy)


# --- closed-form math against references -----------------------------------------------------------------------

def _correlated(n=400, f=12, seed=0):
    rng = np.random.default_rng(seed)
    z = rng.normal(size=(n, 4))
    return z @ rng.normal(size=(4, f)) + 0.3 * rng.normal(size=(n, f)) + rng.normal(size=f)  # (n, f), rank ~4 + noise


def test_mlp_compensation_equals_sklearn_ridge():
    from sklearn.linear_model import Ridge

    x = _correlated()
    n, f = x.shape
    keep = torch.tensor([True, False] * (f // 2))
    acc = Moments()
    acc.update("x", torch.from_numpy(x[:150]))
    acc.update("x", torch.from_numpy(x[150:]))
    st = acc.result()["x"]
    lam = 0.05
    b, c = corp_math.affine_predictor(st.mean, st.cov, keep, lam)
    ref = Ridge(alpha=lam * n, fit_intercept=True).fit(x[:, keep.numpy()], x[:, ~keep.numpy()])
    np.testing.assert_allclose(b.numpy(), ref.coef_, rtol=1e-8, atol=1e-10)
    np.testing.assert_allclose(c.numpy(), ref.intercept_, rtol=1e-8, atol=1e-10)
    # folding: W~_S x_S + b~ == W_S x_S + W_P (B x_S + c) + b for every sample
    rng = np.random.default_rng(3)
    w, bias = torch.from_numpy(rng.normal(size=(5, f))), torch.from_numpy(rng.normal(size=5))
    ws, bt = corp_math.fold_mlp(w, bias, keep, b, c)
    xt = torch.from_numpy(x)
    pred = xt[:, keep] @ b.T + c  # (n, |P|) predicted x_P
    want = xt[:, keep] @ w[:, keep].T + pred @ w[:, ~keep].T + bias
    torch.testing.assert_close(xt[:, keep] @ ws.T + bt, want)


def test_oas_ridge_matches_sklearn_oas():
    from sklearn.covariance import OAS

    x = _correlated(n=60, f=20, seed=2)
    cov = torch.from_numpy(np.cov(x.T, bias=True))
    rho = OAS().fit(x).shrinkage_
    assert corp_math.oas_shrinkage(cov, len(x)) == pytest.approx(rho, rel=1e-10)
    mu = float(np.trace(cov.numpy())) / 20
    assert corp_math.oas_ridge(cov, len(x)) == pytest.approx(rho * mu / (1 - rho), rel=1e-10)


def test_sylvester_equals_kronecker_solve():
    rng = np.random.default_rng(4)
    k, lam = 4, 0.3
    ga, gb = rng.normal(size=(k, k)), rng.normal(size=(k, k))
    a, b, c = ga @ ga.T, gb @ gb.T, rng.normal(size=(k, k))
    m = corp_math.sylvester_ridge(torch.from_numpy(a), torch.from_numpy(b), torch.from_numpy(c), lam).numpy()
    # vec(A M B) = (B^T kron A) vec(M), column-major vec
    big = np.kron(b.T, a) + lam * np.eye(k * k)
    ref = np.linalg.solve(big, c.flatten(order="F")).reshape(k, k, order="F")
    np.testing.assert_allclose(m, ref, rtol=1e-9, atol=1e-12)


def test_qk_compensation_is_the_ridge_fit_of_missing_logits():
    """From token matrices: min_M ||Q_P K_P^T - Q_S M K_S^T||^2 + lam ||M||^2 solved by vectorization (forms
    the n x n logits, which the implementation never does) equals U V^T - I from the Grams."""
    rng = np.random.default_rng(5)
    n, dh = 30, 5
    q, kk = rng.normal(size=(n, dh)) @ rng.normal(size=(dh, dh)), rng.normal(size=(n, dh)) @ rng.normal(size=(dh, dh))
    keep = torch.tensor([True, False, True, True, False])
    s, p = keep.numpy(), ~keep.numpy()
    gq, gk = torch.from_numpy(q.T @ q / n), torch.from_numpy(kk.T @ kk / n)
    ridge = 0.01
    u, v = corp_math.qk_compensation(gq, gk, keep, ridge)
    t = q[:, p] @ kk[:, p].T  # (n, n) missing logits
    a = np.kron(kk[:, s], q[:, s])  # vec(Q_S M K_S^T) = (K_S kron Q_S) vec(M)
    lam = ridge * np.mean(np.diag(gq.numpy()[np.ix_(s, s)])) * np.mean(np.diag(gk.numpy()[np.ix_(s, s)])) * n * n
    m = np.linalg.solve(a.T @ a + lam * np.eye(9), a.T @ t.flatten(order="F")).reshape(3, 3, order="F")
    np.testing.assert_allclose((u @ v.T).numpy(), np.eye(3) + m, rtol=1e-8, atol=1e-10)
    # and compensation does reduce the logit error against dropping the dims
    err0 = np.linalg.norm(t)
    err1 = np.linalg.norm(t - q[:, s] @ m @ kk[:, s].T)
    assert err1 < 0.9 * err0


# --- the authors' automatic λ (docs/methods.md#corp) -------------------------------------------------------------

def test_authors_lambda_hand_values():
    s2 = torch.tensor([[2.0, 0.5], [0.5, 1.0]], dtype=torch.float64)
    assert corp_math.chen_oas_rho(s2, 10) == pytest.approx(0.9, abs=1e-12)  # 9 / ((10 + 1 - 1)(5.5 - 4.5))
    assert corp_math.authors_lambda(s2, 10) == pytest.approx(1.35, abs=1e-12)
    s3 = torch.tensor([[2.0, 0.5, 0.0], [0.5, 1.0, 0.2], [0.0, 0.2, 0.5]], dtype=torch.float64)
    assert corp_math.chen_oas_rho(s3, 10) == pytest.approx(0.7863826644, abs=1e-10)
    assert corp_math.authors_lambda(s3, 10) == pytest.approx(0.9174464418, abs=1e-10)
    assert corp_math.authors_lambda(s3, 1000) == pytest.approx(0.009477120858, abs=1e-12)
    assert corp_math.chen_oas_rho(s3, 100000) == pytest.approx(8.125927112e-05, rel=1e-9)
    assert corp_math.authors_lambda(s3, 100000) == 1e-3  # raw 9.48e-5: the absolute floor applies
    assert corp_math.authors_lambda(torch.tensor([[0.3]], dtype=torch.float64), 50) == pytest.approx(0.3)  # p = 1
    assert corp_math.authors_lambda(0.5 * torch.eye(3, dtype=torch.float64), 50) == pytest.approx(0.5)  # c·I
    assert corp_math.authors_lambda(1e-4 * s3, 10) == 1e-3  # raw 9.17e-5


def test_authors_lambda_uses_only_the_kept_units():
    """Full 4×4 covariance, keep units 0-2: the authors' λ is the 3×3 value; the earlier full-covariance OAS
    gives B = 0 at n = 10 (ρ = 1) and 0.013330 at n = 1000."""
    from tasks.healing.corp import _mlp_lambda

    f = torch.tensor([[2, .5, 0, .3], [.5, 1, .2, .1], [0, .2, .5, .05], [.3, .1, .05, .8]], dtype=torch.float64)
    keep = torch.tensor([True, True, True, False])
    s = CORP_H.resolved_settings({})
    assert s == {"lambda": "authors", "lambda_floor": 1e-3, "qk_ridge": 1e-3, "qk_symmetrize": True}
    assert _mlp_lambda(f, keep, 10, s) == pytest.approx(0.9174464418, abs=1e-10)
    assert _mlp_lambda(f, keep, 1000, s) == pytest.approx(0.009477120858, abs=1e-12)
    oas = CORP_H.resolved_settings({"lambda": "oas"})
    assert _mlp_lambda(f, keep, 10, oas) == float("inf")
    assert _mlp_lambda(f, keep, 1000, oas) == pytest.approx(0.013330, abs=1e-6)
    assert _mlp_lambda(f, keep, 1000, CORP_H.resolved_settings({"lambda": 0.25})) == 0.25  # fixed, absolute


def test_qk_lambda_is_the_authors_value_over_n_squared():
    """Head Q-side Σ_SS = the 3×3 example (Gram = Σ + μμᵀ), n = 1000 tokens: λ = 0.009477 in sum-Gram units,
    0.009477 / 1000² in the project's mean-Gram units."""
    from tasks.healing.corp import _qk_lambda

    s3 = torch.tensor([[2.0, 0.5, 0.0], [0.5, 1.0, 0.2], [0.0, 0.2, 0.5]], dtype=torch.float64)
    mu = torch.tensor([0.3, -1.0, 2.0, 5.0], dtype=torch.float64)
    gram = torch.zeros(4, 4, dtype=torch.float64)
    gram[:3, :3] = s3
    gram += torch.outer(mu, mu)
    keep = torch.tensor([True, True, True, False])
    lam = _qk_lambda(gram, mu, keep, 1000, CORP_H.resolved_settings({}))
    assert lam == pytest.approx(0.009477120858 / 1000 ** 2, rel=1e-9)
    assert _qk_lambda(gram, mu, keep, 1000, CORP_H.resolved_settings({"lambda": "oas"})) is None  # relative qk_ridge


def test_qk_symmetrize_gives_the_symmetric_part():
    rng = np.random.default_rng(1)
    q = torch.from_numpy(rng.normal(size=(40, 4)) @ rng.normal(size=(4, 4)))
    k = torch.from_numpy(rng.normal(size=(40, 4)) @ rng.normal(size=(4, 4)))
    keep = torch.tensor([True, True, False, True])
    gq, gk = q.T @ q / 40, k.T @ k / 40
    u, v = corp_math.qk_compensation(gq, gk, keep, lam=1e-9)
    us, vs = corp_math.qk_compensation(gq, gk, keep, lam=1e-9, symmetrize=True)
    t = u @ v.T
    assert not torch.allclose(t, t.T)
    torch.testing.assert_close(us @ vs.T, (t + t.T) / 2, rtol=1e-8, atol=1e-10)


def test_corp_lambda_setting_validated():
    CORP_H.check({"lambda": "oas"})
    CORP_H.check({"lambda": 0.01, "qk_symmetrize": False})
    for bad in ("auto", -1.0, True, float("inf")):
        with pytest.raises(ValueError, match="lambda"):
            CORP_H.check({"lambda": bad})
    with pytest.raises(ValueError, match="unknown setting"):
        CORP_H.check({"shrinkage": "oas"})
