"""The search: which configurations each grid cell heals, and which one is its answer (docs/methods.md#search-design).

A design is swappable like an Optuna sampler: ``search.design`` names a registered ``SearchDesign`` (``shared``,
the default; ``tpe``; ``grid``). The contract is in ``base``; the sweep only calls ``make_searcher`` and the Ray
Tune adapter in ``tune``. Importing this package registers the built-in designs (timm's pattern).
"""
from orchestrator.search import designs  # noqa: F401 - registers the built-in designs
from orchestrator.search.base import MAX_REEVALUATE, SearchDesign
from orchestrator.search.records import (
    DONE,
    FINISHED,
    REEVALUATE,
    SEARCH,
    Ask,
    Budget,
    cell_sampler_seed,
    fixed_cell,
    journal_cells,
    open_journal,
    reevaluation_seeds,
    resolve_epochs,
    study_label,
)
from orchestrator.search.registry import DESIGNS
from orchestrator.search.tune import DesignSearcher, PerCellOptunaSearch, budget_of, make_searcher


def search_kwargs(search) -> dict:
    """Keyword arguments of ``PerCellOptunaSearch`` that follow the spec's ``search`` section (objective, its
    direction, a steps-based space, the design and its re-evaluations)."""
    from orchestrator.spec.checks import OBJECTIVES

    return {"metric": search.objective, "mode": OBJECTIVES[search.objective], "steps": search.steps,
            "design": search.design, "reevaluate": search.reevaluate, "converge": getattr(search, "converge", None)}


__all__ = ["DESIGNS", "DONE", "FINISHED", "MAX_REEVALUATE", "REEVALUATE", "SEARCH", "Ask", "Budget", "DesignSearcher",
           "PerCellOptunaSearch", "SearchDesign", "budget_of", "cell_sampler_seed", "fixed_cell", "journal_cells",
           "make_searcher", "open_journal", "reevaluation_seeds", "resolve_epochs", "search_kwargs", "study_label"]
