"""Moved to orchestrator/spec/sources.py; this name stays for existing importers (sweep.py)."""
from orchestrator.spec.sources import from_dict_form, parse_dataset, parse_models, untrained  # noqa: F401
