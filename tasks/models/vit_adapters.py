"""Adapters for Vision Transformers (timm ViT/DeiT/DeiT3 and torchvision ViT): blocks are the transformer blocks;
scopes are made of the parts in ``VIT_SCOPES`` (``qk`` = the query and key rows of the fused qkv weight)."""
from __future__ import annotations

import torch.nn as nn

from tasks.models.adapter import ADAPTERS, VIT_SCOPES, ModelAdapter, ScopeEntry


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


@ADAPTERS.register("timm_vit")
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


@ADAPTERS.register("torchvision_vit")
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
