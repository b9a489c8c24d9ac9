"""Healer chains: registered healers run in order on the same masked model (spec ``{chain: [corp, starfish]}``).
The chain's name is the parts' names joined by ``+`` (e.g. ``corp+starfish``): the name configs, MLflow and
reports show. Each gradient part gets the trial's lr and epochs."""
from __future__ import annotations

import time
from dataclasses import replace
from typing import Any, Mapping, Sequence

from tasks.healing.base import HEALERS, EpochCallback, HealConfig, HealContext, Healer, HealResult

CHAIN_SEP = "+"


def chain_name(names: Sequence[str]) -> str:
    return CHAIN_SEP.join(names)


class ChainHealer(Healer):
    """Registered healers run in order on the same masked model. Built from a spec entry's ``chain`` setting:
    ``[{"name": ..., "settings": {...}}, ...]``; every gradient part gets the trial's lr and epochs, and epoch
    reports continue counting across parts (part 2's epoch 1 is reported as epochs(part 1) + 1)."""

    def __init__(self, chain: Sequence[Mapping[str, Any]]) -> None:
        if len(chain) < 2:
            raise ValueError(f"a healer chain needs at least 2 healers, got {len(chain)}")
        self.parts: list[tuple[Healer, dict]] = []
        for i, st in enumerate(chain):
            try:
                part = HEALERS.get(st["name"])
            except KeyError as e:
                raise ValueError(f"chain[{i}]: {e.args[0]}") from None
            self.parts.append((part, dict(st.get("settings") or {})))
        self.name = chain_name([p.name for p, _ in self.parts])
        self.trains = any(p.trains for p, _ in self.parts)
        self.uses_calibration = any(p.uses_calibration for p, _ in self.parts)

    def _each(self, fn):
        for i, (part, settings) in enumerate(self.parts):
            try:
                fn(part, settings)
            except ValueError as e:
                raise ValueError(f"chain[{i}] ({part.name!r}): {e}") from None

    def check(self, settings):
        if set(settings) - {"chain"}:
            raise ValueError(f"a healer chain takes no settings of its own; set them per step, got {sorted(settings)}")
        self._each(lambda part, s: part.check(s))

    def check_cell(self, model, adapter, pruner, pruner_settings, settings):
        self._each(lambda part, s: part.check_cell(model, adapter, pruner, pruner_settings, s))

    def check_data(self, dataset, settings):
        self._each(lambda part, s: part.check_data(dataset, s))

    def may_change(self, model, entries, settings=None):
        return set().union(*(part.may_change(model, entries, s) for part, s in self.parts))

    def resolved_settings(self, settings):
        return {"chain": [{"name": part.name, "settings": part.resolved_settings(s)} for part, s in self.parts]}

    def reads_targets(self, block_names, settings):
        return list(dict.fromkeys(n for part, s in self.parts for n in part.reads_targets(block_names, s)))

    def epochs(self, cfg):
        return sum(part.epochs(replace(cfg, settings=s)) for part, s in self.parts)

    def heal(self, ctx: HealContext, cfg: HealConfig, on_epoch: EpochCallback | None = None) -> HealResult:
        t0, losses, steps, offset = time.perf_counter(), [], 0, 0
        for part, settings in self.parts:
            pcfg = replace(cfg, settings=settings)
            cb = None if on_epoch is None else (lambda e, m, o=offset: on_epoch(o + e, m))
            res = part.heal(ctx, pcfg, cb)
            losses += res.epoch_losses
            steps += res.steps
            offset += part.epochs(pcfg)
        return HealResult(losses, time.perf_counter() - t0, steps)


def resolve_healer(name: str, settings: Mapping[str, Any] | None = None) -> Healer:
    """A registered healer, or the composition a spec entry describes (name ``a+b`` with settings {"chain": [...]})."""
    settings = settings or {}
    if name in HEALERS:
        return HEALERS.get(name)
    if "chain" in settings:
        h = ChainHealer(settings["chain"])
        if h.name != name:
            raise ValueError(f"healer chain name {name!r} does not match its steps ({h.name!r})")
        return h
    return HEALERS.get(name)  # raises the registry's "unknown healer" error
