"""Model adapters: block discovery (where dense targets are taken) and prunable scopes (SPEC §2).

An adapter knows one architecture family. ``get_adapter(model)`` finds the adapter that serves a model or
fails with a message naming the families it expected. Scopes return ``ScopeEntry`` items: a parameter name
and, optionally, the row range of it that is prunable (``qk`` = the query and key rows of a fused qkv weight;
V rows stay untouched and untrained).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch.nn as nn

from tasks._registry import Registry


class UnsupportedModelError(ValueError):
    pass


@dataclass(frozen=True)
class ScopeEntry:
    param: str  # full parameter name, e.g. "blocks.0.attn.qkv.weight"
    rows: tuple[int, int] | None = None  # prunable row range [start, stop) of dim 0; None = whole tensor


class ModelAdapter:
    family: str = ""
    scopes: tuple[str, ...] = ()
    default_scope: str = ""
    default_granularity: str = "example"

    def matches(self, model: nn.Module) -> bool:
        raise NotImplementedError

    def blocks(self, model: nn.Module) -> list[tuple[str, nn.Module]]:
        """Ordered (name, module) of the blocks whose outputs are the healing targets."""
        raise NotImplementedError

    def scope(self, model: nn.Module, scope: str) -> list[ScopeEntry]:
        raise NotImplementedError

    def check_scope(self, scope: str) -> None:
        if scope not in self.scopes:
            raise ValueError(f"scope {scope!r} is not defined for {self.family}; allowed: {', '.join(self.scopes)}")


ADAPTERS: Registry[ModelAdapter] = Registry("model adapter")

# Parts of a transformer block that ViT scopes are made of. "qk" is a row range of the fused qkv weight.
VIT_SCOPES: dict[str, tuple[str, ...]] = {
    "qkv": ("qkv",),
    "qkv_out": ("qkv", "proj"),
    "qkv_out_mlp": ("qkv", "proj", "fc1", "fc2"),
    "mlp": ("fc1", "fc2"),
    "qk": ("qk",),
    "qk_mlp": ("qk", "fc1", "fc2"),
    "mlp_qk": ("qk", "fc1", "fc2"),  # alias of qk_mlp (the name CORP's paper and SPEC §4 use)
}


class _VitAdapter(ModelAdapter):
    scopes = tuple(VIT_SCOPES)
    default_scope = "qkv_out_mlp"
    default_granularity = "token"
    parts: dict[str, str] = {}  # part -> parameter suffix inside a block

    def block_prefix(self, model: nn.Module) -> list[tuple[str, nn.Module]]:
        raise NotImplementedError

    def blocks(self, model: nn.Module) -> list[tuple[str, nn.Module]]:
        return self.block_prefix(model)

    def embed_dim(self, block: nn.Module) -> int:
        raise NotImplementedError

    def scope(self, model: nn.Module, scope: str) -> list[ScopeEntry]:
        self.check_scope(scope)
        out: list[ScopeEntry] = []
        for name, block in self.blocks(model):
            for part in VIT_SCOPES[scope]:
                if part == "qk":  # query and key rows of the fused [3D, D] weight
                    out.append(ScopeEntry(f"{name}.{self.parts['qkv']}", (0, 2 * self.embed_dim(block))))
                else:
                    out.append(ScopeEntry(f"{name}.{self.parts[part]}"))
        return out


class TimmVitAdapter(_VitAdapter):
    family = "timm VisionTransformer (ViT/DeiT/DeiT3)"
    parts = {"qkv": "attn.qkv.weight", "proj": "attn.proj.weight", "fc1": "mlp.fc1.weight", "fc2": "mlp.fc2.weight"}

    def matches(self, model: nn.Module) -> bool:
        from timm.models.vision_transformer import VisionTransformer

        return isinstance(model, VisionTransformer)

    def block_prefix(self, model: nn.Module) -> list[tuple[str, nn.Module]]:
        return [(f"blocks.{i}", b) for i, b in enumerate(model.blocks)]

    def embed_dim(self, block: nn.Module) -> int:
        return block.attn.qkv.in_features


class TorchvisionVitAdapter(_VitAdapter):
    family = "torchvision VisionTransformer (vit_b_16, vit_l_16, ...)"
    parts = {"qkv": "self_attention.in_proj_weight", "proj": "self_attention.out_proj.weight",
             "fc1": "mlp.0.weight", "fc2": "mlp.3.weight"}

    def matches(self, model: nn.Module) -> bool:
        from torchvision.models.vision_transformer import VisionTransformer

        return isinstance(model, VisionTransformer)

    def block_prefix(self, model: nn.Module) -> list[tuple[str, nn.Module]]:
        return [(f"encoder.layers.{n}", b) for n, b in model.encoder.layers.named_children()]

    def embed_dim(self, block: nn.Module) -> int:
        return block.self_attention.embed_dim


class ResNetAdapter(ModelAdapter):
    """timm and torchvision ResNets (BasicBlock or Bottleneck): blocks are the residual blocks."""

    family = "ResNet (timm or torchvision, BasicBlock/Bottleneck)"
    scopes = ("conv", "fc", "conv_fc", "conv_dw")
    default_scope = "conv"
    default_granularity = "example"

    def matches(self, model: nn.Module) -> bool:
        from timm.models.resnet import ResNet as TimmResNet
        from torchvision.models.resnet import ResNet as TvResNet

        return isinstance(model, (TimmResNet, TvResNet))

    def blocks(self, model: nn.Module) -> list[tuple[str, nn.Module]]:
        return [(f"layer{i}.{n}", b) for i in range(1, 5) for n, b in getattr(model, f"layer{i}").named_children()]

    def scope(self, model: nn.Module, scope: str, include_stem: bool = False) -> list[ScopeEntry]:
        self.check_scope(scope)
        return cnn_scope(model, scope, self.family, () if include_stem else ("conv1",))


def cnn_scope(model: nn.Module, scope: str, family: str, dense: tuple[str, ...] = (),
              fc_prefixes: tuple[str, ...] = ()) -> list[ScopeEntry]:
    """Conv/linear scopes of a CNN. ``conv``: non-depthwise convs; ``conv_dw``: depthwise convs (groups ==
    in_channels > 1); ``fc``: linear layers and convs under ``fc_prefixes`` (classifier MLPs written as
    convs); ``conv_fc``: both. Modules named in ``dense`` (the stem) stay dense."""
    out = []
    for name, mod in model.named_modules():
        if name in dense:
            continue
        is_fc = isinstance(mod, nn.Linear) or (isinstance(mod, nn.Conv2d) and name.startswith(fc_prefixes))
        if is_fc and scope in ("fc", "conv_fc"):
            out.append(ScopeEntry(f"{name}.weight"))
        elif isinstance(mod, nn.Conv2d) and not is_fc and scope in ("conv", "conv_fc", "conv_dw"):
            depthwise = mod.groups > 1 and mod.groups == mod.in_channels
            if (scope == "conv_dw") == depthwise:
                out.append(ScopeEntry(f"{name}.weight"))
    if not out:
        raise ValueError(f"scope {scope!r} selects no parameters in this {family}")
    return out


def get_adapter(model: nn.Module) -> ModelAdapter:
    for name in ADAPTERS:
        adapter = ADAPTERS.get(name)
        if adapter.matches(model):
            return adapter
    expected = "; ".join(ADAPTERS.get(n).family for n in ADAPTERS)
    raise UnsupportedModelError(f"no adapter for architecture {type(model).__module__}.{type(model).__name__}; "
                                f"expected one of: {expected}")


ADAPTERS.register("timm_vit")(TimmVitAdapter())
ADAPTERS.register("torchvision_vit")(TorchvisionVitAdapter())
ADAPTERS.register("resnet")(ResNetAdapter())

import tasks.adapters_cnn  # noqa: E402,F401 - registers VGG and MobileNet adapters
