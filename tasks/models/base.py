"""What every model source shares: the loaded-model record, the two registries (``MODELS``: reference models
the project trained itself and ships; ``MODEL_SOURCES``: timm / torchvision / checkpoints) and the spec's model reference.
A leaf of the models package: implementations import it, it imports none of them."""
from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from typing import Any, Callable, Mapping

import torch
import torch.nn as nn

from tasks.registry import Registry
from tasks.data.splits import DatasetSplits
from tasks.errors import ModelSourceError  # noqa: F401 - re-exported (raised by every model source)


@dataclass(frozen=True)
class TrainRecipe:
    epochs: int
    lr: float
    weight_decay: float
    batch_size: int
    max_shift: int  # random translation augmentation, pixels
    label_smoothing: float = 0.0


@dataclass(frozen=True)
class ReferenceModel:
    """A reference model the project trained itself (architecture + recipe + dataset); its weights are shipped
    (tasks/models/weights) and ``healsweep models train`` retrains it."""

    name: str
    dataset: str
    arch: dict  # constructor settings, part of the content key
    build: Callable[[dict], nn.Module]
    recipe: TrainRecipe


@dataclass
class LoadedModel:
    name: str
    model: nn.Module
    digest: str  # sha256 of the weights file (first 16 hex), or of the source's settings (timm/torchvision hub weights)
    dataset: DatasetSplits
    info: dict  # checkpoint metadata (dense accuracy on the evaluation split, seeds, ...)


MODELS: Registry[ReferenceModel] = Registry("model")


REF_KEYS = ("name", "source", "arch", "pretrained", "weights", "path", "num_classes", "offline", "init_seed",
            "model_args", "sha256", "input_size")


@dataclass(frozen=True)
class ModelRef:
    name: str  # display name: configs, MLflow params, reports
    source: str = "reference"  # reference | timm | torchvision | checkpoint
    arch: str = ""  # builder name (timm model name, torchvision builder, or "torchvision:<builder>"); "" = name
    pretrained: bool = False  # timm: load the pretrained weights (pretrained tag via `weights`)
    weights: str | None = None  # torchvision: enum "ViT_B_16_Weights.IMAGENET1K_V1"; timm: pretrained tag
    path: str | None = None  # checkpoint / reference: a .safetensors file (checkpoint also: a torch state dict)
    num_classes: int | None = None  # None: the architecture's default (1000 for ImageNet models)
    offline: bool = False  # also offline when HF_HUB_OFFLINE=1
    init_seed: int = 0  # random init (pretrained off, or layers a checkpoint does not cover)
    model_args: Mapping[str, Any] | None = None  # extra builder arguments (timm: img_size, depth, drop_path_rate...)
    sha256: str | None = None  # with `path`: the file's expected sha256 (16-64 hex); a mismatch is refused
    input_size: int | list[int] | None = None  # evaluation preprocessing size N or [H, W] (timm's eval transform at
    # that size); for a model whose source does not say it: a torchvision builder without weights, a checkpoint

    @property
    def builder(self) -> str:
        return self.arch or self.name

    def to_dict(self) -> dict:
        return asdict(self)


class ExternalSource:
    """A source of real models (timm, torchvision, checkpoints): build, load, digest, preprocessing."""

    kind = ""

    def check(self, ref: ModelRef) -> None:
        """Raise ModelSourceError for an invalid ref (no building, no download)."""

    def build(self, ref: ModelRef, pretrained: bool) -> nn.Module:
        raise NotImplementedError

    def load(self, ref: ModelRef) -> nn.Module:
        """The model with its real weights, in eval mode."""
        torch.manual_seed(ref.init_seed)
        return self.build(ref, pretrained=ref.pretrained).eval()

    def digest(self, ref: ModelRef) -> str:
        """Identity of the weights (part of every content key built on this model)."""
        return _digest({k: v for k, v in ref.to_dict().items() if k not in ("name", "offline", "sha256", "input_size")})

    def transform(self, ref: ModelRef, model: nn.Module) -> tuple[Callable, str]:
        """(PIL image -> (C, H, W) float tensor, a stable description of it)."""
        return timm_transform(model, ref.input_size)


MODEL_SOURCES: Registry[ExternalSource] = Registry("model source", instances=True)


def _digest(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:16]


def timm_transform(model: nn.Module, input_size: int | list[int] | None = None) -> tuple[Callable, str]:
    """Evaluation preprocessing from the model's timm data config (resolve_data_config + create_transform);
    ``input_size`` (N or [H, W]) replaces its size (a model timm has no config for gets timm's defaults: 224)."""
    from timm.data import create_transform, resolve_data_config

    size = None if input_size is None else [input_size] * 2 if isinstance(input_size, int) else list(input_size)
    cfg = resolve_data_config({} if size is None else {"input_size": (3, *size)}, model=model)
    return create_transform(**cfg, is_training=False), "timm:" + json.dumps(cfg, sort_keys=True, default=list)
