"""STARFISH healing loop (tasks.healing.loop) on tiny random-init models: invariants, determinism, divergence."""
import pytest
import torch

from tasks.healing import (HEALERS, LOGITS, HealConfig, HealingDiverged, block_tap, dense_targets, in_memory_batches,
                           steps_per_epoch)
from tasks.healing.losses import cosine_align_loss
from tasks.models import get_adapter
from tasks.healing.loop import trainable_masks
from tasks.pruning import mask_violations

STARFISH = HEALERS.get("starfish")
FROZEN = {"bn": "frozen"}  # eval-mode BN: the tests below compare against eval-mode losses / bit-identical buffers
CASES = [("timm_vit", "qkv_out_mlp"), ("timm_vit", "qk"), ("tv_vit", "qkv_out_mlp"), ("resnet", "conv")]


def _state(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("kind,scope", CASES)
def test_heal_keeps_invariants_and_reduces_loss(heal_case, kind, scope):
    case = heal_case(kind, scope, sparsity=0.8)
    seen = []
    # tiny random-init ResNet: train-mode BN (the default) recovers slowly; the 20 % drop is checked frozen
    settings = FROZEN if kind == "resnet" else {}
    res = STARFISH.heal(case.ctx, HealConfig(lr=1e-2, epochs=4, batch_size=8, settings=settings),
                        on_epoch=lambda e, m: seen.append((e, m["train_loss"])))
    assert res.steps == 4 * 4 and len(res.epoch_losses) == 4  # 32 rows / batch 8
    assert seen == list(zip([1, 2, 3, 4], res.epoch_losses))
    assert res.epoch_losses[-1] < 0.8 * res.epoch_losses[0], res.epoch_losses
    # masked == 0, nonzeros unchanged, everything else bit-identical except what the defaults declare
    # (bn='train': BN buffers; qk_train='qkv': V rows of a qk entry)
    case.assert_invariants(allowed=STARFISH.may_change(case.model, case.entries, settings))
    assert mask_violations(case.model, case.masks) == 0
    if kind == "resnet":
        assert any(k.endswith("running_var") for k in case.before)  # the buffer comparison is not vacuous
    # healing did change weights, and only trainable ones (surviving entries of the trained set)
    sd = case.model.state_dict()
    trainable = trainable_masks(case.model, case.entries, case.masks, "qkv")
    n_changed = 0
    for e in case.entries:
        changed = sd[e.param] != case.before[e.param]
        assert not (changed & ~trainable[e.param]).any()
        n_changed += int(changed.sum())
    assert n_changed > 0
    assert not any(p.requires_grad or p.grad is not None for p in case.model.parameters())


def test_heal_scope_param_without_gradient_path(heal_case):
    case = heal_case("resnet", "conv_fc", sparsity=0.8)
    STARFISH.heal(case.ctx, HealConfig(lr=1e-2, epochs=1, batch_size=8, settings=FROZEN))
    case.assert_invariants()
    assert torch.equal(case.model.fc.weight, case.before["fc.weight"])  # no gradient -> untouched


@pytest.mark.parametrize("kind,scope", [("timm_vit", "qk_mlp"), ("resnet", "conv")])
def test_heal_is_deterministic_and_order_dependent(heal_case, kind, scope):
    cfg = HealConfig(lr=1e-2, epochs=2, batch_size=8, seed=3)
    a, b, c = (heal_case(kind, scope) for _ in range(3))
    c.ctx.batches = in_memory_batches(c.targets, 8, seed=1)  # another shuffle order
    ra, rb, rc = (STARFISH.heal(x.ctx, cfg) for x in (a, b, c))
    assert ra.epoch_losses == rb.epoch_losses
    sa, sb, sc = a.model.state_dict(), b.model.state_dict(), c.model.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not all(torch.equal(sa[k], sc[k]) for k in sa)


@pytest.mark.parametrize("kind,scope", [("timm_vit", "qkv_out_mlp"), ("resnet", "conv")])
def test_nan_target_raises_and_leaves_model_consistent(heal_case, kind, scope):
    case = heal_case(kind, scope)
    last = case.ctx.blocks[-1][0]
    case.targets[last][5].view(-1)[0] = float("nan")  # one row of one block: a few good steps happen first
    case.ctx.batches = in_memory_batches(case.targets, 8, seed=0)
    with pytest.raises(HealingDiverged, match="loss became nan"):
        STARFISH.heal(case.ctx, HealConfig(lr=1e-3, epochs=2, batch_size=8, settings=FROZEN))
    assert not any(torch.isnan(p).any() for p in case.model.parameters())
    case.assert_invariants()


def test_nan_target_on_first_step_leaves_weights_bit_identical(heal_case):
    case = heal_case("resnet", "conv")
    for v in case.targets.values():
        v[:, ...] = float("nan")
    with pytest.raises(HealingDiverged, match="epoch 1, step 1"):
        STARFISH.heal(case.ctx, HealConfig(lr=1e-3, epochs=1, batch_size=8))
    sd = case.model.state_dict()
    assert all(torch.equal(sd[k], case.before[k]) for k in sd)


def test_huge_lr_raises_healing_diverged(heal_case):
    case = heal_case("timm_vit", "qkv_out_mlp")
    with pytest.raises(HealingDiverged, match=r"lr=1e\+30"):
        STARFISH.heal(case.ctx, HealConfig(lr=1e30, epochs=4, batch_size=8))
    assert mask_violations(case.model, case.masks) == 0


def test_huge_lr_leaves_no_nan_weights(heal_case):
    case = heal_case("timm_vit", "qkv_out_mlp")
    with pytest.raises(HealingDiverged):
        STARFISH.heal(case.ctx, HealConfig(lr=1e30, epochs=4, batch_size=8))
    assert all(torch.isfinite(p).all() for p in case.model.parameters())


def test_divergence_restores_requires_grad(heal_case):
    case = heal_case("resnet", "conv")
    for v in case.targets.values():
        v[:, ...] = float("nan")
    with pytest.raises(HealingDiverged):
        STARFISH.heal(case.ctx, HealConfig(lr=1e-3, epochs=1, batch_size=8))
    assert not any(p.requires_grad for p in case.model.parameters())


@pytest.mark.parametrize("kind,default,other", [("timm_vit", "token", "example"), ("resnet", "example", "token")])
def test_granularity_auto_resolves_to_adapter_default(heal_case, kind, default, other):
    scope = "qkv_out_mlp" if kind == "timm_vit" else "conv"
    cfg = dict(lr=1e-2, epochs=1, batch_size=8)
    runs = {}
    for g in ("auto", default, other):
        case = heal_case(kind, scope)
        assert get_adapter(case.model).default_granularity == case.ctx.default_granularity == default
        assert STARFISH.resolve(case.ctx, {"granularity": g} if g != "auto" else {}) == {
            "granularity": default if g == "auto" else g}
        STARFISH.heal(case.ctx, HealConfig(**cfg, settings={"granularity": g}))
        runs[g] = case.model.state_dict()
    assert all(torch.equal(runs["auto"][k], runs[default][k]) for k in runs["auto"])
    assert not all(torch.equal(runs["auto"][k], runs[other][k]) for k in runs["auto"])


def test_starfish_check_settings():
    STARFISH.check({})
    STARFISH.check({"granularity": "auto"})
    with pytest.raises(ValueError, match="must be one of"):
        STARFISH.check({"granularity": "channel"})
    with pytest.raises(ValueError, match="unknown setting"):
        STARFISH.check({"lr": 1.0})


@pytest.mark.parametrize("kind,scope", [("timm_vit", "qkv_out_mlp"), ("tv_vit", "qk"), ("resnet", "conv")])
def test_zero_lr_epoch_loss_is_the_full_set_alignment_loss(heal_case, kind, scope):
    """lr=0: weights stay bit-identical and the epoch loss is the pruned model's loss on all rows
    (checks that batches pair every image with its own target rows)."""
    case = heal_case(kind, scope, sparsity=0.5)
    res = STARFISH.heal(case.ctx, HealConfig(lr=0.0, lr_min=0.0, epochs=1, batch_size=8, settings=FROZEN))
    sd = case.model.state_dict()
    assert all(torch.equal(sd[k], case.before[k]) for k in sd)
    with torch.no_grad(), block_tap(case.ctx.blocks) as cap:
        case.model(case.ctx.images)
        names = [n for n, _ in case.ctx.blocks]
        full = cosine_align_loss([cap[n] for n in names], [case.targets[n] for n in names],
                                 case.ctx.default_granularity).item()
    assert full > 1e-3
    assert res.epoch_losses[0] == pytest.approx(full, rel=1e-5)


@pytest.mark.parametrize("kind,scope", [("timm_vit", "qkv_out_mlp"), ("tv_vit", "qkv_out_mlp"), ("resnet", "conv")])
def test_unpruned_model_starts_aligned(heal_case, kind, scope):
    case = heal_case(kind, scope, sparsity=0.0)
    res = STARFISH.heal(case.ctx, HealConfig(lr=0.0, lr_min=0.0, epochs=1, batch_size=8, settings=FROZEN))
    assert res.epoch_losses[0] < 1e-5  # only float16 target rounding


def test_in_memory_batches_cover_every_row_once_per_epoch():
    targets = {"b": torch.arange(10.0).view(10, 1) * 10, LOGITS: torch.arange(10.0).view(10, 1)}
    batches = in_memory_batches(targets, 4, seed=7)
    epochs = []
    for epoch in range(2):
        out = list(batches(epoch))
        assert [len(r) for r, _ in out] == [4, 4, 2]
        rows = torch.cat([r for r, _ in out])
        assert sorted(rows.tolist()) == list(range(10))
        for r, t in out:
            assert torch.equal(t["b"].view(-1), r.float() * 10) and torch.equal(t[LOGITS].view(-1), r.float())
        epochs.append(rows)
    assert not torch.equal(epochs[0], epochs[1])
    assert torch.equal(torch.cat([r for r, _ in in_memory_batches(targets, 4, seed=7)(1)]), epochs[1])
    assert not torch.equal(torch.cat([r for r, _ in in_memory_batches(targets, 4, seed=8)(1)]), epochs[1])
    assert steps_per_epoch(10, 4) == 3 and steps_per_epoch(8, 4) == 2


@pytest.mark.parametrize("kind", ["timm_vit", "resnet"])
def test_dense_targets_shapes_dtype_and_values(tiny_model, kind):
    from tests.conftest import calib_images

    model = tiny_model(kind)
    blocks = get_adapter(model).blocks(model)
    imgs = calib_images(kind, 12)
    t = dense_targets(model, blocks, imgs, batch_size=5)
    assert set(t) == {n for n, _ in blocks} | {LOGITS}
    assert all(v.dtype == torch.float16 and v.shape[0] == 12 for v in t.values())
    with torch.no_grad(), block_tap(blocks) as cap:
        logits = model(imgs)
        for n, _ in blocks:
            assert t[n].shape == cap[n].shape
            torch.testing.assert_close(t[n].float(), cap[n], atol=2e-3, rtol=1e-3)
    torch.testing.assert_close(t[LOGITS].float(), logits, atol=2e-3, rtol=1e-3)
    assert dense_targets(model, blocks, imgs, dtype=torch.bfloat16)[LOGITS].dtype == torch.bfloat16
