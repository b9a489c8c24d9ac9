"""Model adapters (tasks.models.*adapter*): block discovery, hand-listed scopes, unsupported models, block shapes."""
import pytest
import torch
import torch.nn as nn

from tasks.healing import block_tap
from tasks.models import ADAPTERS, ScopeEntry, UnsupportedModelError, get_adapter
from tasks.models.cnn_adapters import ResNetAdapter
from tasks.models.vit_adapters import TimmVitAdapter, TorchvisionVitAdapter


def _names(entries):
    return [e.param for e in entries]


def _vit_scope(prefixes, parts):
    return [f"{p}.{s}" for p in prefixes for s in parts]


TIMM = {"qkv": "attn.qkv.weight", "proj": "attn.proj.weight", "fc1": "mlp.fc1.weight", "fc2": "mlp.fc2.weight"}
TV = {"qkv": "self_attention.in_proj_weight", "proj": "self_attention.out_proj.weight", "fc1": "mlp.0.weight",
      "fc2": "mlp.3.weight"}
VIT_PARTS = {"qkv": ["qkv"], "qkv_out": ["qkv", "proj"], "qkv_out_mlp": ["qkv", "proj", "fc1", "fc2"],
             "mlp": ["fc1", "fc2"], "qk": ["qkv"], "qk_mlp": ["qkv", "fc1", "fc2"],
             "mlp_qk": ["qkv", "fc1", "fc2"]}  # mlp_qk: alias of qk_mlp (CORP's name)
VIT_FAMILIES = {"timm_vit": (TimmVitAdapter, ["blocks.0", "blocks.1"], TIMM),
                "tv_vit": (TorchvisionVitAdapter, ["encoder.layers.encoder_layer_0", "encoder.layers.encoder_layer_1"],
                           TV)}
RESNET_CONV = ["layer1.0.conv1.weight", "layer1.0.conv2.weight", "layer1.0.downsample.0.weight",  # stem 64 -> 16
               "layer2.0.conv1.weight", "layer2.0.conv2.weight", "layer2.0.downsample.0.weight",
               "layer3.0.conv1.weight", "layer3.0.conv2.weight", "layer3.0.downsample.0.weight",
               "layer4.0.conv1.weight", "layer4.0.conv2.weight", "layer4.0.downsample.0.weight"]


def test_registered_adapters():
    assert ADAPTERS.names() == ["mobilenet", "resnet", "timm_vit", "torchvision_vit", "vgg"]
    assert TimmVitAdapter.scopes == TorchvisionVitAdapter.scopes == tuple(VIT_PARTS)
    assert ResNetAdapter.scopes == ("conv", "fc", "conv_fc", "conv_dw")


@pytest.mark.parametrize("kind", ["timm_vit", "tv_vit"])
def test_vit_blocks_and_every_scope(tiny_model, kind):
    cls, blocks, parts = VIT_FAMILIES[kind]
    model = tiny_model(kind)
    ad = get_adapter(model)
    assert type(ad) is cls and ad.default_granularity == "token" and ad.default_scope == "qkv_out_mlp"
    found = ad.blocks(model)
    assert [n for n, _ in found] == blocks
    mods = dict(model.named_modules())
    assert all(m is mods[n] for n, m in found)
    params = dict(model.named_parameters())
    for scope, ps in VIT_PARTS.items():
        entries = ad.scope(model, scope)
        assert _names(entries) == _vit_scope(blocks, [parts[p] for p in ps]), scope
        rows = [e.rows for e in entries]
        if "qk" in scope and "qkv" not in scope:  # qk, qk_mlp, mlp_qk: Q and K rows of [3D, D]
            assert rows == [(0, 64) if e.param.endswith(parts["qkv"]) else None for e in entries]
        else:
            assert rows == [None] * len(entries)
        assert all(e.param in params for e in entries)
    assert params[f"{blocks[0]}.{parts['qkv']}"].shape == (96, 32)
    with pytest.raises(ValueError, match="not defined"):
        ad.scope(model, "conv")


def test_vit_scopes_literal(tiny_model):
    timm, tv = tiny_model("timm_vit"), tiny_model("tv_vit")
    assert [(e.param, e.rows) for e in get_adapter(timm).scope(timm, "qk_mlp")] == [
        ("blocks.0.attn.qkv.weight", (0, 64)), ("blocks.0.mlp.fc1.weight", None), ("blocks.0.mlp.fc2.weight", None),
        ("blocks.1.attn.qkv.weight", (0, 64)), ("blocks.1.mlp.fc1.weight", None), ("blocks.1.mlp.fc2.weight", None)]
    assert _names(get_adapter(tv).scope(tv, "qkv_out")) == [
        "encoder.layers.encoder_layer_0.self_attention.in_proj_weight",
        "encoder.layers.encoder_layer_0.self_attention.out_proj.weight",
        "encoder.layers.encoder_layer_1.self_attention.in_proj_weight",
        "encoder.layers.encoder_layer_1.self_attention.out_proj.weight"]


def test_resnet_blocks_and_scopes(tiny_model):
    model = tiny_model("resnet")
    ad = get_adapter(model)
    assert type(ad) is ResNetAdapter and ad.default_granularity == "example" and ad.default_scope == "conv"
    assert [n for n, _ in ad.blocks(model)] == ["layer1.0", "layer2.0", "layer3.0", "layer4.0"]
    assert _names(ad.scope(model, "conv")) == RESNET_CONV  # no stem conv1, downsample convs included
    assert _names(ad.scope(model, "fc")) == ["fc.weight"]
    assert _names(ad.scope(model, "conv_fc")) == RESNET_CONV + ["fc.weight"]
    assert _names(ad.scope(model, "conv", include_stem=True)) == ["conv1.weight"] + RESNET_CONV
    assert all(e.rows is None for e in ad.scope(model, "conv_fc"))
    with pytest.raises(ValueError, match="selects no parameters"):
        ad.scope(model, "conv_dw")  # BasicBlock ResNet has no depthwise convs
    with pytest.raises(ValueError, match="not defined"):
        ad.scope(model, "qkv")


def test_resnet_conv_dw_selects_depthwise_only(tiny_model):
    model = tiny_model("resnet")
    model.layer1[0].conv2 = nn.Conv2d(16, 16, 3, padding=1, groups=16, bias=False)  # make one conv depthwise
    ad = get_adapter(model)
    assert _names(ad.scope(model, "conv_dw")) == ["layer1.0.conv2.weight"]
    assert "layer1.0.conv2.weight" not in _names(ad.scope(model, "conv"))
    assert len(ad.scope(model, "conv")) == len(RESNET_CONV) - 1


def test_torchvision_resnet18():
    from torchvision.models import resnet18

    model = resnet18(num_classes=10)
    ad = get_adapter(model)
    assert type(ad) is ResNetAdapter
    assert [n for n, _ in ad.blocks(model)] == [f"layer{i}.{j}" for i in range(1, 5) for j in range(2)]
    conv = _names(ad.scope(model, "conv"))
    assert len(conv) == 19 and "conv1.weight" not in conv  # 16 block convs + 3 downsample convs
    assert [c for c in conv if "downsample" in c] == [f"layer{i}.0.downsample.0.weight" for i in (2, 3, 4)]


@pytest.mark.parametrize("model", [nn.Sequential(nn.Linear(2, 2)), nn.Linear(3, 3)])
def test_unsupported_model_names_expected_families(model):
    with pytest.raises(UnsupportedModelError) as ei:
        get_adapter(model)
    msg = str(ei.value)
    assert type(model).__name__ in msg
    for name in ADAPTERS.names():
        assert ADAPTERS.get(name).family in msg
    assert isinstance(ei.value, ValueError)


@pytest.mark.parametrize("kind,shapes", [
    ("timm_vit", [(3, 17, 32)] * 2),
    ("tv_vit", [(3, 17, 32)] * 2),
    ("resnet", [(3, 16, 16, 16), (3, 32, 8, 8), (3, 64, 4, 4), (3, 128, 2, 2)]),
])
def test_block_tap_shapes_and_hook_removal(tiny_model, kind, shapes):
    model = tiny_model(kind)
    blocks = get_adapter(model).blocks(model)
    x = torch.randn(3, 3 if kind == "tv_vit" else 1, 16, 16)
    with torch.no_grad(), block_tap(blocks) as cap:
        model(x)
        assert [tuple(cap[n].shape) for n, _ in blocks] == shapes
        last = cap[blocks[-1][0]]
    assert all(len(m._forward_hooks) == 0 for _, m in blocks) and cap == {}  # hooks gone, outputs let go
    if kind == "timm_vit":  # the last block output is what the final norm sees (after both residual adds)
        with torch.no_grad():
            feats = model.forward_features(x)
        torch.testing.assert_close(model.norm(last), feats)


def test_scope_entry_is_hashable_value():
    assert ScopeEntry("a", (0, 2)) == ScopeEntry("a", (0, 2)) and len({ScopeEntry("a"), ScopeEntry("a")}) == 1
