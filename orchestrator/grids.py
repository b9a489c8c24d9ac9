"""Moved to orchestrator/spec/grids.py; this name stays for existing importers (plan.py)."""
from orchestrator.spec.grids import GRID_KEYS, MAIN, SEARCH_KEYS, parse_grids, view_raw, views  # noqa: F401
from orchestrator.spec.schema import GridSpec  # noqa: F401
