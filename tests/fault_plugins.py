"""Test-only healers for the orchestration tests (imported through a spec's ``plugins`` list, so Ray workers
register them too). Each is STARFISH with an injected fault:

- ``test_flaky``: raises RuntimeError at the start of epoch 2 on the first attempt of a trial (an attempt
  counter file under ``settings.marker_dir``); every attempt appends the epoch it started from to that file.
- ``test_nan``: the loss becomes NaN at the first step of epoch 2 -> HealingDiverged.
- ``test_broken``: raises RuntimeError before healing while the file ``settings.marker_dir/broken`` exists (a fault
  that is mended between two sessions: ``run --resume --retry-failed``).
"""
from __future__ import annotations

import os
from pathlib import Path

from tasks.healing import HEALERS, StarfishHealer
from tasks.healing.losses import GRANULARITIES


class _Faulty(StarfishHealer):
    settings_schema = {"granularity": ("auto",) + GRANULARITIES, "marker_dir": str}

    def resolve(self, ctx, settings):
        return {**super().resolve(ctx, settings), "marker_dir": settings.get("marker_dir", "")}


class FlakyHealer(_Faulty):
    name = "test_flaky"

    def heal(self, ctx, cfg, on_epoch=None):
        start = int(ctx.resume["epoch"]) if ctx.resume else 0
        log = Path(cfg.settings["marker_dir"]) / f"flaky-{cfg.seed}-{cfg.lr:.6g}.log"
        first = not log.exists()
        with open(log, "a") as f:
            f.write(f"{start}\n")

        def fail_at_epoch_2(epoch, metrics):
            if on_epoch is not None:
                on_epoch(epoch, metrics)
            if first and epoch == 1:
                raise RuntimeError(f"injected failure after epoch 1 (pid {os.getpid()})")

        return super().heal(ctx, cfg, fail_at_epoch_2)


class NanHealer(_Faulty):
    name = "test_nan"

    def heal(self, ctx, cfg, on_epoch=None):
        state = {"epoch": 0}

        def count(epoch, metrics):
            state["epoch"] = epoch
            if on_epoch is not None:
                on_epoch(epoch, metrics)

        self._state = state
        return super().heal(ctx, cfg, count)

    def loss(self, outputs, targets, settings):
        value = super().loss(outputs, targets, settings)
        return value * float("nan") if self._state["epoch"] >= 1 else value


class BrokenHealer(_Faulty):
    name = "test_broken"

    def heal(self, ctx, cfg, on_epoch=None):
        if (Path(cfg.settings["marker_dir"]) / "broken").exists():
            raise RuntimeError("injected failure: the marker file 'broken' exists")
        return super().heal(ctx, cfg, on_epoch)


HEALERS.register("test_flaky")(FlakyHealer())
HEALERS.register("test_nan")(NanHealer())
HEALERS.register("test_broken")(BrokenHealer())
