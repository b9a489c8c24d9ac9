"""What a sweep report reads of one sweep (``SweepResults``: its trials and parent run from MLflow, each cell's
winner by the sweep's objective) and the findings drawn from it; analysis/report.py renders them."""
from __future__ import annotations

from dataclasses import dataclass

import pandas as pd

from .findings import findings
from .findings_render import FINDINGS_HOW, QUOTED
from .reported import reported
from .runs import grid_names, load_sweep_info, load_trials
from .search_space import _box, flag_boundary
from .search_stops import attach, explored_lr

UNKNOWN_MODEL = "(unknown model)"


@dataclass
class SweepResults:
    """What a report reads of one sweep: its name, the parent run's info, the trials and each cell's winner."""
    name: str
    info: dict
    trials: pd.DataFrame
    best: pd.DataFrame  # best per cell (by ``objective``), with its stop reason and boundary flags
    objective: str
    model_of: pd.Series  # each trial's model (UNKNOWN_MODEL when it logged none)
    models: list[str]

    def best_of(self, model: str) -> pd.DataFrame:
        return self.best[self.best["model"].astype("object").fillna(UNKNOWN_MODEL) == model]


def load_sweep(tracking_uri: str, sweep_id: str, experiment: str, title: str | None, parent_run_id: str | None,
               search: dict | None, widened: dict | None, stops: dict | None) -> SweepResults:
    """The sweep's trials and parent run from MLflow, and its winners: each cell's best by the sweep's objective,
    with why its search stopped and whether it sits on its search box's boundary."""
    trials = load_trials(tracking_uri, sweep_id, experiment)
    info = load_sweep_info(tracking_uri, sweep_id, experiment, parent_run_id)
    objective = info.get("objective") or "selection_acc"
    best = flag_boundary(attach(reported(trials, objective), stops or {}), search, tracking_uri, widened,
                         explored_lr(trials), trials.loc[trials["boundary_tag"] == "true", "run_id"])  # re-evaluated
    model_of = trials["model"].astype("object").fillna(UNKNOWN_MODEL)
    return SweepResults(title or info["name"] or sweep_id, info, trials, best, objective, model_of, sorted(set(model_of)))


def all_findings(sw: SweepResults, bands_json: dict, widened: dict | None, search: dict | None) -> list:
    """Every model's findings (analysis/findings.py): from its winners, bands, CTS and cells without a winner."""
    fs = []
    for model in sw.models:
        mb = sw.best_of(model)
        if mb.empty:
            continue
        mt, mj = sw.trials[sw.model_of == model], bands_json["models"].get(model, {})
        fs += findings(mb, model, mj.get("bands", []), mj.get("cts"), failed_cells(mt, mb), mt, sw.objective,
                       {c: _box(b) for c, b in (widened or {}).items()}, bounds=search)
    return fs


def findings_how(best: pd.DataFrame, settings: dict | None) -> str:
    """How to read the findings: the band settings, and which healed accuracy they quote."""
    from .bands import BandSettings

    bst = BandSettings(**(settings or {}).get("bands", {}))
    rehealed = "n_reevaluated" in best.columns and bool((best["n_reevaluated"].fillna(0) > 0).any())
    return FINDINGS_HOW.format(ret=bst.retention, z=bst.z, quoted=QUOTED[rehealed])


def failed_cells(mt: pd.DataFrame, mb: pd.DataFrame) -> dict[str, list[str]]:
    """grid -> the cells of one model's trials ``mt`` with no winner in ``mb`` (no finished trial), sorted."""
    grids = grid_names(mt)
    out: dict[str, list[str]] = {}
    for grid in set(grids):
        missing = sorted(set(mt.loc[grids == grid, "cell_id"].dropna()) - set(mb["cell_id"]))
        if missing:
            out[grid] = missing
    return out
