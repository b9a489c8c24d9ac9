"""Compiled healing (``heal.compile``, docs/gpu.md#settings): a named setting, logged with every trial.

- ``off`` (default, as the authors run STARFISH: shrikboi/STARFISH recovery.py trains eagerly): nothing compiled.
- ``blocks``: regional compilation. Each target block's ``forward`` (its forward and, through AOTAutograd, its
  backward) and the healer's objective on the tapped outputs (with their float32 upcasts) go through
  ``torch.compile``; identical blocks (a ViT's) share one compiled graph, since their parameters are graph inputs.
  The forward hooks that tap block outputs stay outside the compiled regions, the optimizer step, the masks and the
  divergence guard stay eager: the same arithmetic, fused into fewer kernels (results agree with ``off`` to float
  rounding, not bit for bit). The first steps pay the compilation (tens of seconds on a cold cache; Inductor
  caches compiled kernels on disk for the next trial); it pays off on large models healed for many steps on a GPU,
  not on the digits models.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Callable, Iterator

import torch
import torch.nn as nn

COMPILE_MODES = ("off", "blocks")


def check_compile(mode: str) -> str:
    if mode not in COMPILE_MODES:
        raise ValueError(f"compile must be one of {', '.join(COMPILE_MODES)}, got {mode!r}")
    return mode


@contextmanager
def compiled_blocks(blocks: list[tuple[str, nn.Module]], mode: str) -> Iterator[None]:
    """Within the context each block's ``forward`` is its ``torch.compile``d version (``mode='blocks'``); the
    eager ``forward`` is back after it (evaluation and later trials see the module as it was)."""
    if check_compile(mode) == "off":
        yield
        return
    saved = [(m, m.__dict__.get("forward")) for _, m in blocks]
    for _, m in blocks:
        m.forward = torch.compile(m.forward, dynamic=False)  # static shapes: an instance attribute: hooks still run around it (eagerly)
    # Blocks of one class share a compiled code object: a CNN's stages (other shapes, a downsample or not) each add a
    # graph, past Dynamo's default of 8, after which it would run the rest eagerly without saying so.
    cfg = torch._dynamo.config
    name = "recompile_limit" if hasattr(cfg, "recompile_limit") else "cache_size_limit"  # the name before torch 2.6
    try:
        with cfg.patch(**{name: max(int(getattr(cfg, name)), 4 * len(blocks))}):
            yield
    finally:
        for m, own in saved:
            if own is None:
                del m.forward
            else:
                m.forward = own


def compiled_fn(fn: Callable, mode: str) -> Callable:
    """``fn`` compiled under ``mode='blocks'`` (a loss on the tapped outputs), else ``fn`` itself."""
    return torch.compile(fn) if check_compile(mode) == "blocks" else fn
