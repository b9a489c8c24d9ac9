"""Registry-wide contracts: every registered pruner and healer, on tiny ViTs and a tiny ResNet.

The parameter lists are read from the registries at collection time (after importing every tasks.* module, so
entries registered in any module are picked up): a new pruner or healer is tested here without editing this file.
"""
import importlib
import pkgutil

import pytest
import torch

import tasks
from tasks.healing import HEALERS, GradientHealer, HealConfig, HealingDiverged, resolve_healer
from tasks.models import get_adapter
from tasks.pruning import PRUNERS, PruneContext, achieved_sparsity, make_masks, mask_violations, region
from tests.conftest import build_model as tiny_model_for
from tests.conftest import calib_images

for _m in pkgutil.iter_modules(tasks.__path__):
    importlib.import_module(f"tasks.{_m.name}")

MODEL_SCOPES = [("timm_vit", "qkv_out_mlp"), ("timm_vit", "qk_mlp"), ("tv_vit", "qkv_out_mlp"), ("resnet", "conv_fc")]
SPARSITIES = (0.0, 0.5, 0.9)


def _masks(model, kind, scope, name, s, seed=0):
    """make_masks, skipped (with the pruner's own reason) where the pruner declares it cannot serve the model,
    e.g. N:M on input widths M does not divide; calibration images are offered where the API takes them."""
    adapter = get_adapter(model)
    p = PRUNERS.get(name)
    try:
        p.check_model(model, adapter, scope, {})
    except ValueError as e:
        pytest.skip(f"{name} cannot serve {kind}/{scope}: {e}")
    entries = adapter.scope(model, scope)
    ctx = PruneContext(model=model, adapter=adapter, entries=entries, calib_images=calib_images(kind, 16))
    return make_masks(model, entries, name, s, seed=seed, settings=getattr(p, "quick_settings", {}), ctx=ctx)


@pytest.mark.parametrize("kind,scope", MODEL_SCOPES)
@pytest.mark.parametrize("name", PRUNERS.names())
def test_pruner_contract(tiny_model, name, kind, scope):
    model = tiny_model(kind)
    entries = get_adapter(model).scope(model, scope)
    params = dict(model.named_parameters())
    state = {k: v.clone() for k, v in model.state_dict().items()}
    fixed = PRUNERS.get(name).fixed_sparsity({})
    for s in SPARSITIES:
        masks = _masks(model, kind, scope, name, s)
        scoped = {e.param for e in entries}
        assert scoped <= set(masks)  # every scope tensor; beyond it only biases of structured units
        for k in set(masks) - scoped:
            assert k.endswith("bias") and masks[k].shape == params[k].shape, k
        total = pruned = 0
        for e in entries:
            m = masks[e.param]
            assert m.dtype == torch.bool and m.shape == params[e.param].shape
            outside = torch.ones_like(m)
            region(outside, e).fill_(False)
            assert bool(m[outside].all()), f"{e.param}: masked outside the prunable region"
            r = region(m, e)
            k = int((~r).sum())
            if fixed is not None:  # pattern-defined sparsity (N:M): exact in every tensor
                assert k == fixed * r.numel(), e.param
            total += r.numel()
            pruned += k
        assert achieved_sparsity(entries, masks) == pruned / total
        target = fixed if fixed is not None else s
        # at most one rounding per tensor (half a weight), or per channel group for structured pruners
        tol = PRUNERS.get(name).tolerance(model, entries) if hasattr(PRUNERS.get(name), "tolerance") else 0.5 * len(entries)
        assert abs(pruned - target * total) <= tol
        if fixed is None and s == 0.0:
            assert pruned == 0
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())  # pruners never touch weights


@pytest.mark.parametrize("kind,scope", MODEL_SCOPES)
@pytest.mark.parametrize("name", PRUNERS.names())
def test_pruner_deterministic_under_seed(tiny_model, name, kind, scope):
    a = _masks(tiny_model(kind), kind, scope, name, 0.5, seed=5)
    torch.manual_seed(12345)  # global RNG state must not matter
    torch.rand(100)
    b = _masks(tiny_model(kind), kind, scope, name, 0.5, seed=5)
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("kind,scope", MODEL_SCOPES)
@pytest.mark.parametrize("name", PRUNERS.names())
def test_pruner_mask_depends_on_the_seed_only_where_it_says_so(tiny_model, name, kind, scope):
    """``seeded_mask`` (SnapViT's seeded search) is what the report reads to say that a one-seed cell's noise misses
    the spread between masks (analysis/findings.py); every other pruner prunes the same weights for every seed."""
    a = _masks(tiny_model(kind), kind, scope, name, 0.5, seed=5)
    b = _masks(tiny_model(kind), kind, scope, name, 0.5, seed=6)
    assert (set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)) != PRUNERS.get(name).seeded_mask


# Compositions (spec `chain:` entries) go through the same contract as registered healers.
CHAINS = {"none+starfish": ["none", "starfish"], "mse+starfish": ["mse", "starfish"], "starfish+none": ["starfish", "none"]}
GRADIENT = [n for n in HEALERS.names() if isinstance(HEALERS.get(n), GradientHealer)]


def _healer(name):
    settings = {"chain": [{"name": s, "settings": {}} for s in CHAINS[name]]} if name in CHAINS else {}
    return resolve_healer(name, settings), settings


@pytest.mark.parametrize("kind,scope", [("timm_vit", "qk_mlp"), ("resnet", "conv")])
@pytest.mark.parametrize("name", HEALERS.names() + sorted(CHAINS))
def test_healer_contract(heal_case, name, kind, scope):
    """Shared by every healer (gradient or closed-form): mask invariant, nothing outside the scope changes
    (except what the healer's ``may_change`` declares), deterministic under a seed. Loss decrease and step
    counts are objective facts, tested in test_heal.py / test_healers.py."""
    healer, settings = _healer(name)
    healer.check(settings)
    pruner = getattr(healer, "requires_pruner", None) or "magnitude"  # closed-form healers tied to a mask kind
    if hasattr(healer, "check_cell"):
        model = tiny_model_for(kind)
        try:
            PRUNERS.get(pruner).check_model(model, get_adapter(model), scope, {})
            healer.check_cell(model, get_adapter(model), pruner, {}, settings)
        except ValueError as e:
            pytest.skip(f"{name} cannot serve {kind}/{scope} with {pruner} masks: {e}")
    a, b = heal_case(kind, scope, sparsity=0.8, pruner=pruner), heal_case(kind, scope, sparsity=0.8, pruner=pruner)
    cfg = HealConfig(lr=1e-2, epochs=2, batch_size=8, seed=1, settings=settings)
    ra = healer.heal(a.ctx, cfg)
    rb = healer.heal(b.ctx, cfg)
    assert len(ra.epoch_losses) == healer.epochs(cfg)
    assert all(torch.isfinite(torch.tensor(ra.epoch_losses, dtype=torch.float64)))
    # masked entries 0, nonzero count unchanged, outside scope / V rows bit-identical (bar may_change,
    # e.g. CORP's fc2 bias or CR+BN's BatchNorm statistics)
    a.assert_invariants(allowed=healer.may_change(a.model, a.entries, settings))
    assert mask_violations(a.model, a.masks) == 0
    assert ra.epoch_losses == rb.epoch_losses
    sa, sb = a.model.state_dict(), b.model.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)  # deterministic under a seed


@pytest.mark.parametrize("kind,scope", [("timm_vit", "qkv_out_mlp"), ("resnet", "conv")])
@pytest.mark.parametrize("name", GRADIENT + ["mse+starfish"])
def test_gradient_healer_nan_loss_stops_with_healing_diverged(heal_case, name, kind, scope):
    """A NaN input image (row 5 of the calibration and of the labeled set) makes every objective NaN on the step
    that contains it: the healer must raise HealingDiverged and leave finite weights that keep the invariants."""
    healer, settings = _healer(name)
    case = heal_case(kind, scope)
    case.ctx.images = case.ctx.images.clone()
    case.ctx.images[5] = float("nan")
    li, ll = case.ctx.labeled
    case.ctx.labeled = (li.clone(), ll)
    case.ctx.labeled[0][5] = float("nan")
    with pytest.raises(HealingDiverged, match="loss became nan"):
        healer.heal(case.ctx, HealConfig(lr=1e-3, epochs=2, batch_size=8, settings=settings))
    assert all(torch.isfinite(p).all() for p in case.model.parameters())
    assert all(torch.isfinite(b.float()).all() for b in case.model.buffers())  # bn='train': no NaN batch stats
    assert not any(p.requires_grad for p in case.model.parameters())
    case.assert_invariants(allowed=healer.may_change(case.model, case.entries, settings))
