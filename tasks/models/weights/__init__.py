"""The reference models' shipped weights: one safetensors file per model next to this module, with its sha256
and evaluation accuracy recorded here. Every machine loads these exact bytes (verified on every load), so the
reference models, their dense targets and their masks are the same everywhere.

Produced once by the project's own training (``healsweep models train NAME``, data seed 0, train seed 0, torch
2.14.1 on the development machine's CPU); retraining elsewhere gives other bytes (CPU kernels differ), a new
digest, and a file in the model cache, never here.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

WEIGHTS_DIR = Path(__file__).resolve().parent
DATA_SEED = 0  # the shipped weights were trained on this data seed's train split (and evaluated on its evaluation split)
TRAIN_SEED = 0


@dataclass(frozen=True)
class ShippedWeights:
    file: str  # under WEIGHTS_DIR
    sha256: str  # of the file's bytes (64 hex)
    eval_correct: int  # evaluation split: top-1 correct out of eval_total (data seed DATA_SEED)
    eval_total: int
    eval_min_margin: float  # smallest top-1 minus top-2 logit over the evaluation split (see tests/models)

    @property
    def path(self) -> Path:
        return WEIGHTS_DIR / self.file

    @property
    def eval_acc(self) -> float:
        return self.eval_correct / self.eval_total


SHIPPED = {
    "vit_digits": ShippedWeights("vit_digits.safetensors",
                                 "a82e66177bd68dc0f206f5ed34d5622e1bf3d3624557c89de545865ca1039399", 355, 360, 0.08661127),
    "resnet_digits": ShippedWeights("resnet_digits.safetensors",
                                    "03f3c57ecfd0bf020dab8097d56f2d8ac7fa96d879c47b39edee06fea4b25998", 357, 360, 0.06643581),
}
