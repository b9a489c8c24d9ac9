"""Adapters for ResNet (timm and torchvision), VGG (timm ``vgg16_bn`` and torchvision VGG) and timm MobileNet/EfficientNet-style networks
(``mobilenetv1_100``): block discovery and conv/fc scopes (docs/methods.md#pruning-patterns-and-scopes)."""
from __future__ import annotations

import torch.nn as nn

from tasks.models.adapter import ADAPTERS, ModelAdapter, ScopeEntry, cnn_scope


@ADAPTERS.register("resnet")
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


@ADAPTERS.register("vgg")
class VggAdapter(ModelAdapter):
    """Blocks: each conv+bn+relu group of ``features`` (the ReLU closing it is tapped). Scopes: ``conv`` (all
    feature convs but the first), ``fc`` (the classifier: timm's pre_logits convs and head, torchvision's
    Linear layers), ``conv_fc``."""

    family = "VGG (timm vgg16_bn or torchvision vgg*)"
    scopes = ("conv", "fc", "conv_fc")
    default_scope = "conv"
    default_granularity = "example"

    def matches(self, model: nn.Module) -> bool:
        from timm.models.vgg import VGG as TimmVGG
        from torchvision.models.vgg import VGG as TvVGG

        return isinstance(model, (TimmVGG, TvVGG))

    def blocks(self, model: nn.Module) -> list[tuple[str, nn.Module]]:
        out, seen_conv = [], False
        for i, mod in enumerate(model.features):
            seen_conv |= isinstance(mod, nn.Conv2d)
            if isinstance(mod, nn.ReLU) and seen_conv:
                out.append((f"features.{i}", mod))
                seen_conv = False
        return out

    def scope(self, model: nn.Module, scope: str) -> list[ScopeEntry]:
        self.check_scope(scope)
        first = next(f"features.{i}" for i, m in enumerate(model.features) if isinstance(m, nn.Conv2d))
        return cnn_scope(model, scope, self.family, dense=(first,), fc_prefixes=("pre_logits.",))


@ADAPTERS.register("mobilenet")
class MobileNetAdapter(ModelAdapter):
    """timm EfficientNet-class models (mobilenetv1_100: depthwise-separable blocks). Blocks: every block of
    every stage. Scopes: ``conv`` (pointwise/full convs but the stem), ``conv_dw`` (depthwise convs only),
    ``fc`` (classifier), ``conv_fc``."""

    family = "timm MobileNet/EfficientNet (mobilenetv1_100, ...)"
    scopes = ("conv", "conv_dw", "fc", "conv_fc")
    default_scope = "conv"
    default_granularity = "example"

    def matches(self, model: nn.Module) -> bool:
        from timm.models.efficientnet import EfficientNet

        return isinstance(model, EfficientNet)

    def blocks(self, model: nn.Module) -> list[tuple[str, nn.Module]]:
        return [(f"blocks.{i}.{j}", b) for i, stage in enumerate(model.blocks) for j, b in enumerate(stage)]

    def scope(self, model: nn.Module, scope: str) -> list[ScopeEntry]:
        self.check_scope(scope)
        return cnn_scope(model, scope, self.family, dense=("conv_stem",))
