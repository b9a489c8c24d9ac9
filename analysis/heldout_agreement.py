"""How well the label-free score ``heldout_align`` (tasks/healing/heldout.py; lower is better) ranks a cell's trials
against ``selection_acc`` (the labeled objective): Spearman ρ between −heldout_align and selection_acc per cell
(cells with ≥ 3 finished search trials that logged both and are not constant), and the evaluation accuracy lost by
picking each cell's trial with heldout_align instead of selection_acc (pp; ≥ 0 on average when selection
generalises). Only search trials are candidates, as in the search itself (analysis/runs.py ``best_per_cell``): a
re-evaluation repeats the winner on another seed or calibration draw, and a closed-form cell's runs on other draws
(search.calib_draws) are draws, not configurations to pick among.
"""
from __future__ import annotations

import math

import pandas as pd
from scipy import stats

from .runs import stage_of

__all__ = ["agreement", "agreement_line"]


def agreement(trials: pd.DataFrame) -> dict | None:
    """{"cells", "rho_median", "rho_min", "lost_mean", "lost_max", "n_picked"} or None without the metric."""
    if "heldout_align" not in trials.columns:
        return None
    t = trials[(trials["status"] == "FINISHED") & trials["heldout_align"].notna() & trials["selection_acc"].notna()
               & (stage_of(trials) != "reevaluate")]
    rhos, lost = [], []
    for _, g in t.groupby("cell_id"):
        if len(g) >= 2:
            by_sel = g.sort_values(["selection_acc", "epochs", "optuna_trial"], ascending=[False, True, True]).iloc[0]
            by_ho = g.sort_values(["heldout_align", "epochs", "optuna_trial"], ascending=[True, True, True]).iloc[0]
            lost.append(100 * (by_sel["healed_acc"] - by_ho["healed_acc"]))
        if len(g) >= 3 and g["heldout_align"].nunique() > 1 and g["selection_acc"].nunique() > 1:
            rhos.append(float(stats.spearmanr(-g["heldout_align"], g["selection_acc"]).statistic))
    if not lost:
        return None
    rhos = [r for r in rhos if not math.isnan(r)]
    return {"cells": len(rhos), "rho_median": float(pd.Series(rhos).median()) if rhos else None,
            "rho_min": min(rhos) if rhos else None, "lost_mean": float(pd.Series(lost).mean()),
            "lost_max": float(max(lost)), "n_picked": len(lost)}


def agreement_line(a: dict | None) -> str:
    if a is None:
        return ""
    rho = ("no cell with ≥ 3 varying trials for a rank correlation" if a["rho_median"] is None else
           f"Spearman ρ(−heldout_align, selection_acc) median {a['rho_median']:.2f} (min {a['rho_min']:.2f}) over "
           f"{a['cells']} cells")
    return (f"Label-free selection (heldout_align, calibration images no trial trained on): {rho}; picking each "
            f"cell's trial by it instead of selection accuracy {_change(a['lost_mean'])} on average "
            f"({_worst(a['lost_max'])}) over {a['n_picked']} cells.")


def _worst(lost: float) -> str:
    return f"worst cell: loses {lost:.2f} pp" if round(lost, 2) > 0 else "no cell loses"


def _change(lost: float) -> str:
    """'loses 0.17 pp evaluation accuracy' / 'gains ...' / 'leaves evaluation accuracy unchanged' (``lost``: pp
    lost, negative when gained)."""
    if round(lost, 2) == 0:
        return "leaves evaluation accuracy unchanged"
    return f"{'loses' if lost > 0 else 'gains'} {abs(lost):.2f} pp evaluation accuracy"
