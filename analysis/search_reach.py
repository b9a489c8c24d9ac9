"""Searched cells where at most one of the search's trials healed above chance: the quoted number rests on that one
configuration (or none), so it says what this search found, not what the healer reaches within the budget. Cells
that ``search.converge`` stopped at the dense model's accuracy ("recovered") are not named, nor a grid whose dense
model is at chance (analysis/findings.py warns about that instead).

Measured 2026-12-01 (benchmarks/results/retest_resnet_healers_2026-12-01_*: every gradient healer on the ResNet
reference at 0.9 / 0.95, the default design, 3 trials a cell): such cells (6 and 10 of 20 in runs A and B) moved by
up to 68 pp with another sampler seed (KL at 0.95: 91 % in one run, 23 % in the other, each from its one working
configuration), and claims about them reversed; with ``search.converge`` none was left and the largest move was
8.4 pp. The default sweep has 3-4 such cells a run (STARFISH on the ResNet at 0.85-0.95), stable there.
"""
from __future__ import annotations

import pandas as pd

from .bands import BandSettings, chance_limit
from .runs import cell_list, stage_of
from .search_stops import RECOVERED


def lone_cells(trials: pd.DataFrame, z: float = BandSettings().z) -> pd.DataFrame:
    """Per searched cell with >= 2 finished search trials of which at most one healed above chance (the collapse
    limit, analysis/bands.py): index cell id, columns ``above`` and ``tried``."""
    need = {"cell_id", "lr", "status", "healed_acc", "num_classes", "n_eval"}
    if trials is None or trials.empty or not need <= set(trials.columns):
        return pd.DataFrame(columns=["above", "tried"])
    t = trials[(stage_of(trials) == "search") & (trials["lr"].astype(float) > 0) & (trials["status"] == "FINISHED")]
    lim = pd.Series([chance_limit(k, n, z) for k, n in zip(t["num_classes"], t["n_eval"])], index=t.index,
                    dtype=float)
    t = t[lim.notna()]  # a trial without a chance limit (no n_eval logged) says nothing either way
    above = t["healed_acc"].astype(float).gt(lim[t.index])
    g = t.assign(_above=above).groupby("cell_id")["_above"].agg(above="sum", tried="size")
    return g[(g["tried"] >= 2) & (g["above"] <= 1)]


def lone_warning(trials: pd.DataFrame, gb: pd.DataFrame) -> str:
    """The warning for the quoted cells ``gb`` (indexed or keyed by ``cell_id``) that ``lone_cells`` finds in
    ``trials``; '' when none."""
    lone = lone_cells(trials)
    if lone.empty or "cell_id" not in gb.columns:
        return ""
    hit = gb[gb["cell_id"].isin(lone.index)]
    if "search_stop" in hit.columns:  # search.converge stopped it at the dense model's accuracy: nothing to find
        hit = hit[~hit["search_stop"].astype(str).str.startswith(RECOVERED)]
    hit = hit.sort_values("healed_acc")  # the lowest numbers first
    if hit.empty:
        return ""
    searched = int((gb["lr"].astype(float) > 0).sum()) if "lr" in gb.columns else len(gb)
    cells = cell_list(hit, lambda r: f"{int(lone.loc[r.cell_id, 'above'])} of {int(lone.loc[r.cell_id, 'tried'])}, "
                                     f"quoted {100 * r.healed_acc:.1f} %")
    return (f"In {len(hit)} of {searched} searched cells at most one search trial healed above chance: {cells}. "
            "Their numbers rest on at most one working configuration, what this search found rather than what the "
            "healer reaches, and another sampler seed may land elsewhere (a ResNet healer comparison moved up to "
            "68 pp); search.converge keeps searching such cells (docs/methods.md#search-design).")
