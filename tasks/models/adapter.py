"""Model adapters: block discovery (where dense targets are taken) and prunable scopes (docs/methods.md#pruning-patterns-and-scopes).

An adapter knows one architecture family. ``get_adapter(model)`` finds the adapter that serves a model or
fails with a message naming the families it expected. Scopes return ``ScopeEntry`` items: a parameter name
and, optionally, the row range of it that is prunable (``qk`` = the query and key rows of a fused qkv weight;
V rows stay untouched and untrained).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch.nn as nn

from tasks.registry import Registry


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


ADAPTERS: Registry[ModelAdapter] = Registry("model adapter", instances=True)

# Parts of a transformer block that ViT scopes are made of. "qk" is a row range of the fused qkv weight.
VIT_SCOPES: dict[str, tuple[str, ...]] = {
    "qkv": ("qkv",),
    "qkv_out": ("qkv", "proj"),
    "qkv_out_mlp": ("qkv", "proj", "fc1", "fc2"),
    "mlp": ("fc1", "fc2"),
    "qk": ("qk",),
    "qk_mlp": ("qk", "fc1", "fc2"),
    "mlp_qk": ("qk", "fc1", "fc2"),  # alias of qk_mlp (the name CORP's paper and docs/methods.md#corp use)
}


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
