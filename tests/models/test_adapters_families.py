"""One test per model family of issue 8, on randomly initialized timm/torchvision instances (pretrained off,
small inputs): the adapter found, block discovery, exact scope contents, and one STARFISH epoch that keeps the
mask and touches nothing outside the scope."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

from tasks.healing import HEALERS, HealConfig, HealContext, dense_targets, in_memory_batches, steps_per_epoch
from tasks.models import ModelRef, build_untrained, get_adapter
from tasks.pruning import apply_masks, make_masks, mask_violations


def _timm(arch, **kw):
    return build_untrained(ModelRef(arch, "timm", pretrained=False, num_classes=10, model_args=kw or None))


def _tv(arch, **kw):
    return build_untrained(ModelRef(arch, "torchvision", num_classes=10, model_args=kw or None))


# family -> (builder, input size, adapter family prefix, {scope: number of entries}, number of blocks)
FAMILIES = {
    "deit": (lambda: _timm("deit_tiny_patch16_224", img_size=32, patch_size=8, depth=2), 32, "timm VisionTransformer",
             {"mlp": 4, "qk": 2, "qk_mlp": 6, "qkv_out_mlp": 8}, 2),
    "deit3": (lambda: _timm("deit3_small_patch16_224", img_size=32, patch_size=8, depth=2), 32,
              "timm VisionTransformer", {"mlp": 4, "qk": 2}, 2),
    "vit": (lambda: _timm("vit_small_patch16_224", img_size=32, patch_size=8, depth=3), 32, "timm VisionTransformer",
            {"qkv_out": 6}, 3),
    "tv_vit_b_16": (lambda: _tv("vit_b_16", image_size=32), 32, "torchvision VisionTransformer",
                    {"mlp": 24, "qk": 12}, 12),
    "resnet18": (lambda: _timm("resnet18"), 32, "ResNet", {"conv": 19, "fc": 1, "conv_fc": 20}, 8),
    "resnet34": (lambda: _timm("resnet34"), 32, "ResNet", {"conv": 35, "fc": 1}, 16),
    "vgg16_bn": (lambda: _timm("vgg16_bn", mlp_ratio=1 / 64), 32, "VGG", {"conv": 12, "fc": 3, "conv_fc": 15}, 13),
    "mobilenetv1_100": (lambda: _timm("mobilenetv1_100"), 32, "timm MobileNet",
                        {"conv": 13, "conv_dw": 13, "fc": 1, "conv_fc": 14}, 13),
}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_family_blocks_and_scopes(family):
    build, size, fam, scopes, n_blocks = FAMILIES[family]
    model = build()
    adapter = get_adapter(model)
    assert adapter.family.startswith(fam)
    blocks = adapter.blocks(model)
    assert len(blocks) == n_blocks
    params = dict(model.named_parameters())
    for scope, n in scopes.items():
        entries = adapter.scope(model, scope)
        assert len(entries) == n, scope
        assert all(e.param in params for e in entries)
    if family == "mobilenetv1_100":  # conv_dw: exactly the depthwise convs; conv: the pointwise ones
        mods = dict(model.named_modules())
        for e in adapter.scope(model, "conv_dw"):
            conv = mods[e.param[: -len(".weight")]]
            assert conv.groups == conv.in_channels > 1
        assert all(e.param.endswith("conv_pw.weight") for e in adapter.scope(model, "conv"))
    if family == "vgg16_bn":  # each block closes a conv+bn+relu group
        feats = model.features
        for name, mod in blocks:
            i = int(name.split(".")[1])
            assert isinstance(mod, nn.ReLU) and isinstance(feats[i - 1], nn.BatchNorm2d) and isinstance(feats[i - 2], nn.Conv2d)
        assert {e.param for e in adapter.scope(model, "fc")} == {"pre_logits.fc1.weight", "pre_logits.fc2.weight",
                                                                 "head.fc.weight"}
        assert "features.0.weight" not in {e.param for e in adapter.scope(model, "conv")}  # the stem stays dense
    x = torch.randn(2, 3, size, size)
    targets = dense_targets(model, blocks, x)
    assert set(targets) == {n for n, _ in blocks} | {"logits"} and targets["logits"].shape == (2, 10)


@pytest.mark.parametrize("family, scope", [("mobilenetv1_100", "conv_dw"), ("resnet18", "conv_fc"),
                                           ("deit3", "qk_mlp")])
def test_family_heals_within_mask_and_scope(family, scope):
    build, size, *_ = FAMILIES[family]
    torch.manual_seed(0)
    dense = build()
    adapter = get_adapter(dense)
    images = torch.randn(4, 3, size, size)
    targets = dense_targets(dense, adapter.blocks(dense), images)
    model = copy.deepcopy(dense)
    entries = adapter.scope(model, scope)
    masks = make_masks(model, entries, "magnitude", 0.5, seed=0)
    apply_masks(model, masks)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    ctx = HealContext(model=model, blocks=adapter.blocks(model), entries=entries, masks=masks, images=images,
                      batches=in_memory_batches(targets, 2, 0), steps_per_epoch=steps_per_epoch(4, 2),
                      default_granularity=adapter.default_granularity)
    losses = []
    HEALERS.get("starfish").heal(ctx, HealConfig(lr=1e-3, epochs=2, batch_size=2, seed=0),
                                 lambda e, m: losses.append(m["train_loss"]))
    assert mask_violations(model, masks) == 0
    # the scope, and what the healer declares: BN running statistics (bn: train, the authors' default)
    allowed = {e.param for e in entries} | HEALERS.get("starfish").may_change(model, entries, {})
    after = model.state_dict()
    changed = {k for k in after if not torch.equal(after[k], before[k])}
    assert changed and changed <= allowed  # nothing outside the scope and the declared BN statistics changes
    assert len(losses) == 2 and all(torch.isfinite(torch.tensor(losses)))
