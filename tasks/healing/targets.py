"""Block taps and the dense target pass (docs/methods.md#starfish): r_x^l for every calibration image x and block l."""
from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import numpy as np
import torch
import torch.nn as nn

from tasks.healing.precision import precision_flags

LOGITS = "logits"  # pseudo-block holding the dense logits (for logit-distillation healers)


@contextmanager
def block_tap(blocks: list[tuple[str, nn.Module]]) -> Iterator[dict[str, torch.Tensor]]:
    """Forward hooks that record each block's output of the latest forward pass, keyed by block name; emptied on
    exit (the last outputs, with their autograd graph, are not kept alive: under ``heal.graph: step`` they live in
    the graph's memory pool)."""
    captured: dict[str, torch.Tensor] = {}

    def hook(name):
        def fn(_mod, _inp, out):
            captured[name] = out

        return fn

    handles = [m.register_forward_hook(hook(n)) for n, m in blocks]
    try:
        yield captured
    finally:
        for h in handles:
            h.remove()
        captured.clear()


def device_index(rows, device: torch.device) -> torch.Tensor:
    """(B,) int64 row indices on ``device``; to a GPU through pinned memory, without a host synchronisation."""
    idx = torch.as_tensor(rows, dtype=torch.int64)
    if device.type != "cuda":
        return idx
    return idx.pin_memory().to(device, non_blocking=True)


def take_rows(x: torch.Tensor, rows, device: torch.device) -> torch.Tensor:
    """``x[rows]`` ((B, ...) of (N, ...)) for a step on ``device``, without a host synchronisation: indexed where ``x``
    is (on a GPU through ``device_index``); from host memory for a GPU, gathered straight into pinned memory and sent
    without blocking (``.to`` of a pageable tensor would wait for the device's stream at every step; torch's caching
    host allocator reuses the pinned block only once that copy has read it). On the CPU: ``x[rows]``."""
    idx = device_index(rows, x.device)
    if x.device.type != "cpu" or torch.device(device).type != "cuda":
        return x[idx]
    out = torch.empty((len(idx), *x.shape[1:]), dtype=x.dtype, pin_memory=True)
    torch.index_select(x, 0, idx, out=out)
    return out.to(device, non_blocking=True)


@torch.no_grad()
def dense_targets(model: nn.Module, blocks: list[tuple[str, nn.Module]], images: torch.Tensor,
                  batch_size: int = 64, dtype: torch.dtype = torch.float16, out: str | None = "cpu"
                  ) -> dict[str, torch.Tensor]:
    """Run the dense model on (N, C, H, W) images; return {block: (N, *block_shape)} in ``dtype``,
    plus ``LOGITS``: (N, num_classes), on ``out`` (None: where the model is; the rounding to ``dtype`` is the same)."""
    model.eval()
    dev = next(model.parameters()).device
    where = dev if out is None else torch.device(out)
    parts: dict[str, list[torch.Tensor]] = {n: [] for n, _ in blocks}
    parts[LOGITS] = []
    with block_tap(blocks) as cap:
        for i in range(0, len(images), batch_size):
            logits = model(images[i : i + batch_size].to(dev, non_blocking=True))
            for n, _ in blocks:
                parts[n].append(cap[n].to(where, dtype))
            parts[LOGITS].append(logits.to(where, dtype))
    return {n: torch.cat(v) for n, v in parts.items()}


# --- where a trial's targets come from: the store, or recomputed per batch (target_mode = recompute) ---

TARGET_MODES = ("store", "recompute")


def recompute_batches(dense_model: nn.Module, blocks: list[tuple[str, nn.Module]], images: torch.Tensor,
                      batch_size: int, seed: int, epoch: int, dtype: torch.dtype = torch.float16
                      ) -> Iterator[tuple[np.ndarray, dict[str, torch.Tensor]]]:
    """Yield (rows (B,) int64, {block: (B, *shape)}) for a seeded random order of the (N, C, H, W) images,
    the targets computed now by ``dense_model`` (rounded to ``dtype`` exactly as the store would hold them)."""
    order = np.random.default_rng([seed, epoch]).permutation(len(images)).astype(np.int64)  # (N,)
    for i in range(0, order.size, batch_size):
        rows = order[i:i + batch_size]
        # targets stay where the dense model runs (a GPU: no round trip through the host)
        x = take_rows(images, rows, next(dense_model.parameters()).device)
        with precision_flags("fp32"):  # the dense tasks' flags (fp32 matmuls), whatever heal.precision the step has
            tgt = dense_targets(dense_model, blocks, x, batch_size=len(rows), dtype=dtype, out=None)
        yield rows, tgt
