"""CORP (tasks.corp, tasks.corp_math, tasks.shrink) and the shared statistics hooks (tasks.stats):
reference solutions (ridge regression, OAS, Kronecker-vectorized Sylvester), exact structured masks, the
closed-form healer's invariants, physical shrink equivalence, and recovery on the cached digits ViT."""
from __future__ import annotations

import copy
import os
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn as nn

from tasks.healing import HEALERS, HealConfig, HealContext, corp_math, dense_targets, in_memory_batches, steps_per_epoch
from tasks.models import get_adapter
from tasks.pruning import PRUNERS, PruneContext, achieved_sparsity, apply_masks, make_masks, mask_violations, n_pruned
from tasks.pruning.corp import CORPPruner, vit_blocks
from tasks.pruning.shrink import n_params, shrink_vit
from tasks.stats import HeadQK, Moments, Several, Tap, collect
from tests.conftest import calib_images

REPO = Path(__file__).resolve().parents[2]
CORP_P, CORP_H = PRUNERS.get("corp"), HEALERS.get("corp")


def _masks(model, kind, scope, s, rank="activation", n=16):
    ad = get_adapter(model)
    e = ad.scope(model, scope)
    return e, make_masks(model, e, "corp", s, seed=0, settings={"rank": rank},
                         ctx=PruneContext(model, ad, e, calib_images=calib_images(kind, n)))


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


# --- structured masks --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["timm_vit", "tv_vit"])
@pytest.mark.parametrize("s", [0.25, 0.5, 0.75])
def test_masks_remove_whole_units_exactly(tiny_model, kind, s):
    model = tiny_model(kind)
    entries, masks = _masks(model, kind, "mlp_qk", s)
    for blk in vit_blocks(model, get_adapter(model)):
        m1, m2 = masks[blk.fc1], masks[blk.fc2]  # (H, D), (D, H)
        rows = m1.all(1)
        assert torch.equal(rows, m1.any(1))  # whole rows only
        assert int((~rows).sum()) == n_pruned(m1.shape[0], s)
        assert torch.equal(m2, rows[None, :].expand_as(m2))  # matching fc2 columns
        assert torch.equal(masks[blk.fc1[: -len("weight")] + "bias"], rows)
        mq = masks[blk.qkv]  # (3D, D)
        d, h, dh = blk.dim, blk.num_heads, blk.head_dim
        dims = mq.all(1)
        assert torch.equal(dims, mq.any(1))
        assert torch.equal(dims[:d], dims[d : 2 * d])  # same dims removed from q and k
        assert bool(dims[2 * d :].all())  # V untouched
        assert ((~dims[:d]).view(h, dh).sum(1) == n_pruned(dh, s)).all()  # exact count in every head
        bq = masks[blk.qkv[: -len("weight")] + "bias"]
        assert torch.equal(bq, dims)
    assert achieved_sparsity(entries, masks) == pytest.approx(s, abs=1 / 32)


def test_activation_rank_drops_lowest_energy_units(tiny_model):
    model = tiny_model("timm_vit")
    _, masks = _masks(model, "timm_vit", "mlp", 0.5)
    x = calib_images("timm_vit", 16)
    seen = []
    h = model.blocks[1].mlp.fc2.register_forward_hook(lambda m, i, o: seen.append(i[0].detach()))
    with torch.no_grad():
        model(x)
    h.remove()
    energy = (torch.cat(seen).reshape(-1, 128).double() ** 2).mean(0)  # (H,) E[x_j^2]
    kept = masks["blocks.1.mlp.fc1.weight"].all(1)
    assert energy[kept].min() >= energy[~kept].max()
    _, mag = _masks(model, "timm_vit", "mlp", 0.5, rank="magnitude")
    assert not torch.equal(mag["blocks.1.mlp.fc1.weight"], masks["blocks.1.mlp.fc1.weight"])  # another rule


def test_bad_input_rejected(tiny_model):
    res = tiny_model("resnet")
    with pytest.raises(ValueError, match="ResNet.*neither"):
        CORP_P.check_model(res, get_adapter(res), "conv", {})
    vit = tiny_model("timm_vit")
    with pytest.raises(ValueError, match="scopes mlp, qk, qk_mlp, mlp_qk"):
        CORP_P.check_model(vit, get_adapter(vit), "qkv_out_mlp", {})
    with pytest.raises(ValueError, match="rank"):
        CORP_P.check({"rank": "random"})
    with pytest.raises(ValueError, match="healer 'corp'.*pruner 'magnitude'"):
        CORP_H.check_cell(vit, get_adapter(vit), "magnitude", {}, {})
    with pytest.raises(ValueError, match="ResNet"):
        CORP_H.check_cell(res, get_adapter(res), "corp", {}, {})


def test_spec_rejects_corp_on_resnet_and_corp_healer_with_other_masks():
    import yaml

    from orchestrator.spec import SpecError, parse_spec

    base = yaml.safe_load((REPO / "configs" / "tiny.yaml").read_text())
    bad = dict(base, models=["resnet_digits"], pruners=["corp"])
    with pytest.raises(SpecError, match="pruner 'corp' cannot serve model 'resnet_digits'.*ResNet"):
        parse_spec(bad)
    bad = dict(base, pruners=["magnitude"], healers=["corp"], scope={"vit_digits": "mlp_qk"})
    with pytest.raises(SpecError, match="healer 'corp' with pruner 'magnitude'"):
        parse_spec(bad)
    ok = parse_spec(dict(base, pruners=["corp"], healers=["corp", "starfish"], scope={"vit_digits": "mlp_qk"}))
    assert [h.name for h in ok.healers] == ["corp", "starfish"]


# --- healer ------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["timm_vit", "tv_vit"])
def test_corp_healer_changes_only_what_it_declares(heal_case, kind):
    case = heal_case(kind, "qk_mlp", sparsity=0.5, pruner="corp")
    allowed = CORP_H.may_change(case.model, case.entries)
    assert allowed and all(k.endswith("bias") for k in allowed)
    res = CORP_H.heal(case.ctx, HealConfig())
    case.assert_invariants(allowed=allowed)
    assert mask_violations(case.model, case.masks) == 0 and res.steps == 0
    sd = case.model.state_dict()
    for blk in vit_blocks(case.model, get_adapter(case.model)):
        d = blk.dim
        qb = blk.qkv[: -len("weight")] + "bias"
        assert torch.equal(sd[qb][2 * d :], case.before[qb][2 * d :])  # V bias untouched
        assert not torch.equal(sd[blk.fc2], case.before[blk.fc2])  # fc2 kept columns compensated
        assert not torch.equal(sd[blk.fc2[: -len("weight")] + "bias"], case.before[blk.fc2[: -len("weight")] + "bias"])
        assert not torch.equal(sd[blk.qkv][:d], case.before[blk.qkv][:d])  # kept q rows rotated


def test_starfish_keeps_removed_units_bias_at_zero(tiny_model):
    dense = tiny_model("timm_vit")
    with torch.no_grad():  # timm initializes biases to 0, which would make this check vacuous
        for name, p in dense.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.1)
    model, ad = copy.deepcopy(dense), get_adapter(dense)
    entries, masks = _masks(model, "timm_vit", "qk_mlp", 0.5, n=32)
    apply_masks(model, masks)
    imgs = calib_images("timm_vit", 32)
    ctx = HealContext(model, ad.blocks(model), entries, masks, imgs,
                      in_memory_batches(dense_targets(dense, ad.blocks(dense), imgs), 8, 0), 4, "token")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    HEALERS.get("starfish").heal(ctx, HealConfig(lr=1e-2, epochs=2, batch_size=8))
    assert mask_violations(model, masks) == 0
    b = model.blocks[0].mlp.fc1.bias
    assert int((b == 0).sum()) == n_pruned(128, 0.5)  # exactly the removed units' biases
    qb = model.blocks[0].attn.qkv.bias
    assert int((qb == 0).sum()) == 2 * 4 * n_pruned(8, 0.5)
    assert torch.equal(qb, before["blocks.0.attn.qkv.bias"])  # biases are never trained by STARFISH
    assert not torch.equal(model.blocks[0].mlp.fc1.weight, before["blocks.0.mlp.fc1.weight"])  # weights were


# --- physical shrink ---------------------------------------------------------------------------------------------

def test_shrink_equals_masked_model_and_counts_params(tiny_model):
    model = tiny_model("timm_vit")
    _, masks = _masks(model, "timm_vit", "mlp_qk", 0.5)
    apply_masks(model, masks)
    small = shrink_vit(model, masks)
    x = calib_images("timm_vit", 8)
    with torch.no_grad():
        torch.testing.assert_close(small(x), model(x), atol=1e-5, rtol=0)
    # per block: fc1 (64 of 128 rows) + bias, fc2 columns, q/k rows 16 of 32 each (+bias)
    removed = 2 * (64 * 32 + 64 + 32 * 64 + 2 * 16 * 32 + 2 * 16)
    assert n_params(small) == n_params(model) - removed
    blk = small.blocks[0]
    assert blk.attn.qk_dim == 4 and blk.attn.qkv.out_features == 2 * 16 + 32 and blk.mlp.fc1.out_features == 64
    with pytest.raises(ValueError, match="timm VisionTransformer"):
        shrink_vit(tiny_model("tv_vit"), masks)


# --- cached digits ViT: recovery, shrink, efficiency -------------------------------------------------------------

@pytest.fixture(scope="module")
def digits_vit():
    from tasks.models import load_model

    cache = Path(os.environ.get("HEALSWEEP_TEST_CACHE", REPO / ".healsweep" / "models"))
    return load_model("vit_digits", cache, progress=False)


def _prune_and_heal(lm, s, scope="mlp_qk", n=256):
    dense = lm.model
    ad = get_adapter(dense)
    cal = lm.dataset["calibration"].images[:n]
    model = copy.deepcopy(dense)
    e = ad.scope(model, scope)
    masks = make_masks(model, e, "corp", s, seed=0, ctx=PruneContext(model, ad, e, calib_images=cal))
    apply_masks(model, masks)
    pruned = copy.deepcopy(model)
    tg = dense_targets(dense, ad.blocks(dense), cal)
    ctx = HealContext(model, ad.blocks(model), e, masks, cal, in_memory_batches(tg, 64, 0), steps_per_epoch(n, 64),
                      "token", dense_model=lambda: copy.deepcopy(dense))
    CORP_H.heal(ctx, HealConfig())
    return pruned, model, masks


def test_corp_compensation_recovers_digits_accuracy(digits_vit):
    from tasks.evaluate import accuracy

    ev = digits_vit.dataset["evaluation"]
    dense_acc = accuracy(digits_vit.model, ev.images, ev.labels)
    # measured (360 evaluation images): s=0.5 pruned 0.958 -> corp 0.986; s=0.75 pruned 0.675 -> corp 0.981
    for s, margin in ((0.5, 0.015), (0.75, 0.2)):
        pruned, healed, masks = _prune_and_heal(digits_vit, s)
        pa, ha = accuracy(pruned, ev.images, ev.labels), accuracy(healed, ev.images, ev.labels)
        assert ha >= pa + margin, (s, pa, ha)
        assert ha >= dense_acc - 0.03
        assert mask_violations(healed, masks) == 0
        with torch.no_grad():  # the compensated model shrinks exactly too
            small = shrink_vit(healed, masks)
            torch.testing.assert_close(small(ev.images[:64]), healed(ev.images[:64]), atol=1e-5, rtol=0)


def test_efficiency_metrics_on_digits(digits_vit):
    model = copy.deepcopy(digits_vit.model)
    _, masks = _masks_digits(digits_vit, model, 0.5)
    apply_masks(model, masks)
    m = CORP_P.structured_metrics(model, masks, digits_vit.dataset["evaluation"].images[:32])
    assert set(m) >= {"dense_params", "shrunk_params", "dense_flops", "shrunk_flops", "dense_latency_ms",
                      "shrunk_latency_ms", "dense_throughput", "shrunk_throughput", "speedup"}
    assert m["shrink_max_abs_diff"] <= 1e-5
    # 6 blocks x (128 hidden units x (64 + 1 + 64) + 2 x 32 q/k rows x (64 + 1)) removed
    assert m["dense_params"] - m["shrunk_params"] == 6 * (128 * 129 + 64 * 65)
    assert m["shrunk_flops"] < 0.7 * m["dense_flops"]
    assert m["speedup"] == pytest.approx(m["shrunk_throughput"] / m["dense_throughput"])
    assert CORPPruner.__mro__[1].structured_metrics(CORP_P, model, masks, None) == {}  # base default: none
    calls = []  # heal.latency_rounds 1 (a dry run): each model timed once, no warm-up; figures still complete
    hook = torch.nn.modules.module.register_module_forward_hook(
        lambda mod, args, out: calls.append(1) if type(mod).__name__ == "VisionTransformer" else None)
    try:
        one = CORP_P.structured_metrics(model, masks, digits_vit.dataset["evaluation"].images[:32], rounds=1)
    finally:
        hook.remove()
    assert len(calls) == 2 + 2 + 2 and set(one) == set(m)  # output check, one timed pass each, one FLOP count each
    assert one["dense_params"] == m["dense_params"] and one["shrunk_flops"] == m["shrunk_flops"]


def _masks_digits(lm, model, s):
    ad = get_adapter(model)
    e = ad.scope(model, "mlp_qk")
    return e, make_masks(model, e, "corp", s, seed=0,
                         ctx=PruneContext(model, ad, e, calib_images=lm.dataset["calibration"].images[:128]))


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


def test_latency_rounds_stop_at_the_time_budget():
    """A slow model (a DeiT-B on a CPU) is timed for at least ``min_repeats`` rounds, then only until the budget is
    spent; a fast one for every round."""
    import time

    from tasks.pruning.shrink import latencies_ms

    class Slow(torch.nn.Module):
        def __init__(self, seconds: float) -> None:
            super().__init__()
            self.seconds, self.calls = seconds, 0

        def forward(self, x):
            self.calls += 1
            time.sleep(self.seconds)
            return x

    slow, fast = Slow(0.03), Slow(0.0)
    lat = latencies_ms([slow, fast], torch.zeros(1), repeats=20, warmup=1, budget_s=0.1, min_repeats=3)
    assert slow.calls == fast.calls and 1 + 3 <= slow.calls <= 1 + 5  # warmup + 3-4 rounds of ~0.03 s each
    assert lat[0] >= 30 and lat[1] < 30
    quick = Slow(0.0)
    latencies_ms([quick], torch.zeros(1), repeats=20, warmup=1, budget_s=0.1)
    assert quick.calls == 21
