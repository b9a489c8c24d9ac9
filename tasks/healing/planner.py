"""Cache or recompute (``store.targets: auto``): time both ways of feeding a healing step its dense targets on the
machine that will run the trials, and pick the faster.

- ``store``: targets streamed from the target store (tasks/store: memory-mapped shards, prefetched, on a GPU
  copied on a side stream);
- ``recompute``: the dense model's forward pass on every batch (one extra forward per step, no store read).

The probe heals with the real loop (STARFISH, a 50 % magnitude mask, the trial's batch size, precision, compile and
graph settings: under ``heal.graph: step`` a store step is a replay while recompute adds an eager forward pass, so
the two compare otherwise than eagerly) for a few steps each way after a warm-up, on a small probe store it writes
itself, and reports seconds per step.
"""
from __future__ import annotations

import copy
import statistics
import tempfile
import time
from pathlib import Path

import torch

from tasks.healing.base import HEALERS, HealConfig, HealContext
from tasks.healing.graphed import WARMUP
from tasks.healing.loop import GradientHealer, steps_per_epoch
from tasks.healing.objectives import StarfishHealer  # noqa: F401 - registers starfish
from tasks.healing.targets import dense_targets, recompute_batches
from tasks.pruning import apply_masks, make_masks
from tasks.store import TargetStore

PROBE_KEY = "0" * 32  # the probe store holds one key, in a temporary directory


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _heal_seconds(dense, adapter, scope: str, images, batches, cfg: HealConfig, device) -> float:
    """Wall seconds of one short STARFISH heal of a fresh pruned copy (``cfg.steps`` steps)."""
    model = copy.deepcopy(dense)
    masks = make_masks(model, adapter.scope(model, scope), "magnitude", 0.5, seed=0)
    apply_masks(model, masks)
    ctx = HealContext(model, adapter.blocks(model), adapter.scope(model, scope), masks, images, batches,
                      steps_per_epoch(len(images), cfg.batch_size), adapter.default_granularity)
    healer: GradientHealer = HEALERS.get("starfish")
    _sync(device)
    t0 = time.perf_counter()
    healer.heal(ctx, cfg)
    _sync(device)
    return time.perf_counter() - t0


def time_target_modes(dense, adapter, scope: str, images: torch.Tensor, batch_size: int, *, steps: int = 6,
                      repeats: int = 3, precision: str = "fp32", dtype: torch.dtype = torch.float16,
                      store_root: str | Path | None = None, compile: str = "off", graph: str = "off"
                      ) -> dict[str, float]:
    """{"store": s/step, "recompute": s/step}: median over ``repeats`` interleaved runs of ``steps`` - 1 steps more
    than a baseline run, each minus that run (set-up and warm-up cancel out): 1 step, and under ``graph: step`` also
    the warm-up steps, the capture and its first replay, so that the difference is replays. ``dense`` is on the
    trial's device (and memory format); ``images`` (N, C, H, W) with N >= batch_size * steps rows the probe store
    holds."""
    device = next(dense.parameters()).device
    n = min(len(images), batch_size * steps)
    images = images[:n].to(device)
    blocks = adapter.blocks(dense)
    base = 1 if graph == "off" else WARMUP + 2  # steps of the baseline run
    epochs = -(-(base + steps - 1) * batch_size // n)
    with tempfile.TemporaryDirectory(prefix="healsweep-probe-", dir=store_root) as tmp:
        store = TargetStore(Path(tmp))
        infos = [store.write_shard(PROBE_KEY, i, a, dense_targets(dense, blocks, images[a:b], dtype=dtype))
                 for i, a, b in store.shard_plan(n, batch_size)]
        store.finalize(PROBE_KEY, meta={"probe": True}, block_shapes=infos[0]["block_shapes"],
                       dtype=str(dtype).removeprefix("torch."), num_rows=n, shard_infos=infos)
        reader = store.open(PROBE_KEY)
        feeds = {"store": lambda e: reader.iter_batches(batch_size, shuffle=True, seed=0, epoch=e, device=device),
                 "recompute": lambda e: recompute_batches(dense, blocks, images, batch_size, 0, e, dtype)}
        times: dict[str, list[float]] = {m: [] for m in feeds}
        kw = dict(lr=1e-4, epochs=epochs, batch_size=batch_size, precision=precision, compile=compile, graph=graph)
        for r in range(repeats + 1):  # the first round warms kernels, allocator and page cache up
            for mode, feed in feeds.items():
                one = _heal_seconds(dense, adapter, scope, images, feed, HealConfig(steps=base, **kw), device)
                full = _heal_seconds(dense, adapter, scope, images, feed, HealConfig(steps=base + steps - 1, **kw),
                                     device)
                if r:
                    times[mode].append(max(full - one, 1e-9) / (steps - 1))
        reader.close()
    return {m: statistics.median(v) for m, v in times.items()}


def pick(seconds: dict[str, float]) -> str:
    """The faster mode; the store on a tie (it also serves later sweeps)."""
    return "recompute" if seconds["recompute"] < seconds["store"] else "store"
