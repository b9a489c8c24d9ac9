"""Read sweep results back from MLflow and write reports (never recomputes results).

Depends on MLflow, pandas and matplotlib; ``analysis.rr`` (the RR and ERK allocations of the report's CTS section)
also on ``tasks.allocation_rules`` (numbers alone: the report imports no torch). Never imports ``orchestrator``.
"""

from .report import write_report, write_report_from
from .runs import best_per_cell, load_sweep_info, load_trials

# The libraries a module here may import inside a function; every other import sits at the top of its file
# (tests/test_imports.py).
HEAVY = ("mlflow", "pandas", "matplotlib", "numpy", "torch", "scipy", "pyarrow")

__all__ = ["load_trials", "best_per_cell", "load_sweep_info", "write_report", "write_report_from"]
