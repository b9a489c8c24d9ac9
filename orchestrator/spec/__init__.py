"""Sweep spec: YAML (safe, bounded loader) -> a frozen, validated ``SweepSpec``.

Modules (no import circle; checks and schema are leaves): checks.py (SpecError, field checkers, bounds),
schema.py (the dataclasses), sources.py (models, dataset), methods.py (pruner/healer entries, chains),
compat.py (model x scope x pruner x healer), grids.py (extra grids), parse.py (``parse_spec``), load.py
(``load_spec``: the file), registries.py (names and settings from the static table tasks/catalog.py: no torch).
torch is imported only to build architectures for the compatibility checks when their verdict is not cached
(verdicts.py), for a plugin's method, an external model source or a dataset that reads its files.
"""
from orchestrator.spec.checks import MAX_EPOCHS, MAX_LIST, MAX_SEED, MAX_TRIALS, MAX_TRIALS_PER_CELL, SpecError
from orchestrator.spec.grids import GRID_KEYS, MAIN, SEARCH_KEYS, views
from orchestrator.spec.load import MAX_ALIASES, MAX_BYTES, load_spec, read_yaml
from orchestrator.spec.parse import parse_spec
from orchestrator.spec.reach import check_tracking, configured_tracking_uri
from orchestrator.spec.schema import GridSpec, HealSpec, MethodRef, MlflowSpec, ResourceSpec, SearchSpec, StoreSpec, SweepSpec

__all__ = ["SpecError", "MAX_EPOCHS", "MAX_LIST", "MAX_SEED", "MAX_TRIALS", "MAX_TRIALS_PER_CELL", "GRID_KEYS", "MAIN",
           "SEARCH_KEYS", "views", "MAX_ALIASES", "MAX_BYTES", "load_spec", "read_yaml", "parse_spec", "check_tracking",
           "configured_tracking_uri", "GridSpec", "HealSpec", "MethodRef", "MlflowSpec", "ResourceSpec", "SearchSpec",
           "StoreSpec", "SweepSpec"]
