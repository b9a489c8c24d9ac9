"""Numeric precision of a healing run (``heal.precision``, docs/methods.md#precision): a named setting, logged
with every trial, the same code on CPU and GPU.

- ``fp32`` (default, the authors' recipe: shrikboi/STARFISH recovery.py trains in plain float32 under PyTorch's
  defaults): no autocast; matmuls in full float32; cuDNN convolutions as PyTorch ships them (TF32 allowed).
- ``tf32``: float32 tensors, matmuls and convolutions on the tensor cores' TF32 mode (CUDA; the CPU has none, so
  there it is fp32).
- ``bf16``: the forward pass under ``torch.autocast(bfloat16)``; weights, gradients, optimizer state and the loss
  stay float32 (block outputs and logits are upcast before the objective).
"""
from __future__ import annotations

from contextlib import contextmanager, nullcontext
from typing import Iterator, Mapping

import torch

PRECISIONS = ("fp32", "tf32", "bf16")


def check_precision(precision: str) -> str:
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
    return precision


@contextmanager
def precision_flags(precision: str) -> Iterator[None]:
    """TF32 flags of the run (process-global in torch, so set for the run and restored after it)."""
    check_precision(precision)
    mm, conv = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    tf32 = precision == "tf32"
    torch.backends.cuda.matmul.allow_tf32 = tf32  # fp32/bf16: PyTorch's default (False)
    torch.backends.cudnn.allow_tf32 = True  # PyTorch's default in every mode (the authors ran it so)
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = mm, conv


def forward_context(precision: str, device: torch.device):
    """The autocast region of one forward pass (bf16), else nothing."""
    if precision == "bf16":
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    return nullcontext()


def as_f32(x: torch.Tensor) -> torch.Tensor:
    """A half/bfloat16 tensor upcast to float32 (losses are computed in float32); float32 and others unchanged."""
    return x.float() if x.dtype in (torch.float16, torch.bfloat16) else x


def dict_f32(d: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: as_f32(v) for k, v in d.items()}
