"""Shared helpers for the store tests: deterministic fake dense targets and a shard runner that counts."""
from __future__ import annotations

import torch

SHAPES = {"blocks.0": (3, 4), "logits": (5,)}


def fake_targets(n: int, dtype=torch.float16, seed: int = 0) -> dict[str, torch.Tensor]:
    """Row i depends only on (seed, i): any prefix of fake_targets(n) equals fake_targets(m)[:n]."""
    out = {}
    for name, shape in SHAPES.items():
        rows = [torch.randn(shape, generator=torch.Generator().manual_seed(seed * 100003 + i * 7 + len(name)))
                for i in range(n)]
        out[name] = torch.stack(rows).to(dtype)
    return out


class Runner:
    """run_shards for ensure_targets: writes shards of fake targets, records the plans it was given."""

    def __init__(self, store, key, dtype=torch.float16, seed: int = 0):
        self.store, self.key, self.dtype, self.seed = store, key, dtype, seed
        self.calls: list[tuple[int, int, int]] = []

    def __call__(self, plan):
        for idx, a, b in plan:
            self.calls.append((idx, a, b))
            t = fake_targets(b, self.dtype, self.seed)
            yield self.store.write_shard(self.key, idx, a, {k: v[a:b] for k, v in t.items()})
