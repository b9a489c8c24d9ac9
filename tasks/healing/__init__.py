"""Healing: healers registered by name in ``HEALERS`` (STARFISH, its comparison objectives, CR+BN, CORP, none),
chains of them, and the dense targets they align to. Each healer is one module that registers its class with
``@HEALERS.register(name)``; this package face imports every one of them."""
from tasks.healing import corp, crbn, objectives  # noqa: F401 - register the healers
from tasks.healing.base import HEALERS, EpochCallback, HealConfig, HealContext, Healer, HealingDiverged, HealResult
from tasks.healing.chain import ChainHealer, chain_name, resolve_healer
from tasks.healing.loop import GradientHealer, in_memory_batches, steps_per_epoch
from tasks.healing.objectives import StarfishHealer
from tasks.healing.targets import LOGITS, TARGET_MODES, block_tap, dense_targets, recompute_batches

__all__ = ["HEALERS", "EpochCallback", "Healer", "HealConfig", "HealContext", "HealingDiverged", "HealResult",
           "ChainHealer", "chain_name", "resolve_healer", "GradientHealer", "in_memory_batches", "steps_per_epoch",
           "StarfishHealer", "LOGITS", "TARGET_MODES", "block_tap", "dense_targets", "recompute_batches"]
