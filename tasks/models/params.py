"""Names of parameters and the modules that own them: written once, used by every method that folds or rescales
weights (CORP, CR+BN, SnapViT)."""
from __future__ import annotations

import torch.nn as nn


def bias_name(weight_name: str) -> str:
    """"mlp.fc1.weight" -> "mlp.fc1.bias"; torchvision's fused "in_proj_weight" -> "in_proj_bias"."""
    return weight_name[: -len("weight")] + "bias"


def module_of(model: nn.Module, param: str) -> nn.Module:
    """The module owning a parameter name such as ``layer1.0.conv1.weight``."""
    return model.get_submodule(param.rsplit(".", 1)[0])
