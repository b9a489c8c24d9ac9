"""The store's 16-bit tensor codec: float16 / bfloat16 tensors to and from their raw uint16 bit patterns (bit-exact
round trips). Imported where values are written (``TargetStore.write_shard``) or read (``reader``, ``stream``); the
format, the checks and the builder (``format``, ``core``, ``build``) do without torch."""
from __future__ import annotations

import numpy as np
import torch

from tasks.store.format import DTYPE_NAMES

DTYPES = {name: getattr(torch, name) for name in DTYPE_NAMES}  # float16, bfloat16
NAMES = {v: k for k, v in DTYPES.items()}  # torch dtype -> its name in a manifest


def to_u16(t: torch.Tensor) -> np.ndarray:
    """(rows, *shape) float16/bfloat16 tensor -> (rows, prod(shape)) uint16 raw bit patterns."""
    a = t.detach().to("cpu").contiguous().view(torch.int16).numpy().view(np.uint16)
    return a.reshape(t.shape[0], -1)


def from_u16(a: np.ndarray, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """(B, prod(shape)) uint16 -> (B, *shape) tensor of ``dtype`` sharing ``a``'s memory."""
    return torch.from_numpy(a.view(np.int16)).view(dtype).reshape(a.shape[0], *shape)
