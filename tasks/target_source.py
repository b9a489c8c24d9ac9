"""Where a trial's dense targets come from: streamed from the store, or recomputed on the fly per batch by a
dense copy of the model (``target_mode = recompute``, when the store's disk budget does not fit them)."""
from __future__ import annotations

from typing import Iterator

import numpy as np
import torch
import torch.nn as nn

from tasks.targets import dense_targets

TARGET_MODES = ("store", "recompute")


def recompute_batches(dense_model: nn.Module, blocks: list[tuple[str, nn.Module]], images: torch.Tensor,
                      batch_size: int, seed: int, epoch: int, dtype: torch.dtype = torch.float16
                      ) -> Iterator[tuple[np.ndarray, dict[str, torch.Tensor]]]:
    """Yield (rows (B,) int64, {block: (B, *shape)}) for a seeded random order of the (N, C, H, W) images,
    the targets computed now by ``dense_model`` (rounded to ``dtype`` exactly as the store would hold them)."""
    order = np.random.default_rng([seed, epoch]).permutation(len(images)).astype(np.int64)  # (N,)
    for i in range(0, order.size, batch_size):
        rows = order[i:i + batch_size]
        yield rows, dense_targets(dense_model, blocks, images[torch.from_numpy(rows)], batch_size=len(rows),
                                  dtype=dtype)
