"""Evaluation: top-1 accuracy and logits, batched, no gradients."""
from __future__ import annotations

import torch
import torch.nn as nn


@torch.no_grad()
def logits(model: nn.Module, images: torch.Tensor, batch_size: int = 256) -> torch.Tensor:
    """(N, C, H, W) -> (N, num_classes) float32, on the model's device, returned on CPU."""
    was_training = model.training
    model.eval()
    dev = next(model.parameters()).device
    out = [model(images[i : i + batch_size].to(dev)).float().cpu() for i in range(0, len(images), batch_size)]
    model.train(was_training)
    return torch.cat(out)


def accuracy(model: nn.Module, images: torch.Tensor, labels: torch.Tensor, batch_size: int = 256) -> float:
    """Top-1 accuracy as a fraction in [0, 1]."""
    pred = logits(model, images, batch_size).argmax(dim=1)
    return float((pred == labels).float().mean())
