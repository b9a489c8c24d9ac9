"""CORP (tasks.pruning.corp, tasks.healing.corp, tasks.pruning.shrink): exact structured masks, the closed-form
healer's invariants, physical shrink equivalence, recovery and efficiency figures on the cached digits ViT, the
latency budget. The closed-form math and the statistics hooks against references: tests/pruning/test_corp_math.py."""
from __future__ import annotations

import copy
import os
from pathlib import Path

import pytest
import timm
import torch

from tasks.healing import HEALERS, HealConfig, HealContext, dense_targets, in_memory_batches, steps_per_epoch
from tasks.models import get_adapter
from tasks.pruning import PRUNERS, PruneContext, achieved_sparsity, apply_masks, make_masks, mask_violations, n_pruned
from tasks.pruning.corp import CORPPruner, vit_blocks
from tasks.pruning.shrink import n_params, shrink_vit
from tests.conftest import calib_images

REPO = Path(__file__).resolve().parents[2]
CORP_P, CORP_H = PRUNERS.get("corp"), HEALERS.get("corp")


def _masks(model, kind, scope, s, rank="activation", n=16):
    ad = get_adapter(model)
    e = ad.scope(model, scope)
    return e, make_masks(model, e, "corp", s, seed=0, settings={"rank": rank},
                         ctx=PruneContext(model, ad, e, calib_images=calib_images(kind, n)))


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
        lambda mod, args, out: calls.append(args[0].device.type) if type(mod).__name__ == "VisionTransformer" else None)
    try:
        one = CORP_P.structured_metrics(model, masks, digits_vit.dataset["evaluation"].images[:32], rounds=1)
    finally:
        hook.remove()
    # one timed pass each on real tensors (the output check reuses their outputs), one FLOP count each on meta ones
    assert sorted(calls) == ["cpu", "cpu", "meta", "meta"] and set(one) == set(m)
    assert one["dense_params"] == m["dense_params"] and one["shrunk_flops"] == m["shrunk_flops"]
    assert one["shrink_max_abs_diff"] <= 1e-5


def test_flops_on_meta_tensors_count_every_matmul_attention_included(digits_vit):
    """The FLOP count runs on meta tensors (shapes only). A real pass on the CPU missed attention: timm's ViT calls
    SDPA, whose CPU kernel has no formula in torch's FlopCounterMode, while the shrunk model's CPU attention (plain
    matmuls) was counted, so dense and shrunk FLOPs were counted differently. On meta tensors SDPA decomposes into
    matmuls: a 224-px DeiT-T's count equals the hand-computed one, attention included."""
    from torch.utils.flop_counter import FlopCounterMode

    from tasks.pruning.shrink import flops

    def real(m, x):
        with torch.no_grad(), FlopCounterMode(display=False) as fc:
            m(x)
        return int(fc.get_total_flops())

    deit = timm.create_model("deit_tiny_patch16_224", pretrained=False, num_classes=10).eval()
    b, n, d, heads, blocks = 2, 197, 192, 3, 12  # 2 images, 14 x 14 patches + CLS, width 192, 3 heads of 64
    macs = (b * 196 * d * 3 * 16 * 16  # patch embedding (a 16 x 16 stride-16 conv)
            + b * blocks * n * (d * 3 * d + d * d + 2 * d * 4 * d)  # qkv, proj, fc1, fc2
            + b * blocks * 2 * heads * n * n * (d // heads)  # attention: Q K^T and A V
            + b * d * 10)  # the head, on the CLS token
    x = torch.randn(b, 3, 224, 224)
    assert flops(deit, x) == 2 * macs
    assert real(deit, x) == 2 * macs - 2 * b * blocks * 2 * heads * n * n * (d // heads)  # the CPU pass: no attention
    model = copy.deepcopy(digits_vit.model).eval()
    _, masks = _masks_digits(digits_vit, model, 0.5)
    apply_masks(model, masks)
    small, x = shrink_vit(model, masks), digits_vit.dataset["evaluation"].images[:8]
    assert flops(small, x) == real(small, x) < flops(model, x)  # plain-matmul attention: counted either way

    class MadeOnTheCPU(torch.nn.Module):  # a forward that makes a CPU tensor: meta cannot mix it in
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(4, 3)

        def forward(self, z):
            return self.lin(z) + torch.ones(z.shape[0], 3)

    assert flops(MadeOnTheCPU(), torch.randn(5, 4)) == 2 * 5 * 4 * 3  # counted on a real pass instead


def _masks_digits(lm, model, s):
    ad = get_adapter(model)
    e = ad.scope(model, "mlp_qk")
    return e, make_masks(model, e, "corp", s, seed=0,
                         ctx=PruneContext(model, ad, e, calib_images=lm.dataset["calibration"].images[:128]))


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
