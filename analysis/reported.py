"""The number the report quotes for each cell, its spread, and whether a claim about it is resolved.

A cell's winner is its best search trial on the selection split (``runs.best_per_cell``; under search.converge
the search trial at the configuration the design chose to quote, ``runs.quoted_per_cell``). Its configuration is
then healed again on fresh healing seeds (``stage`` = reevaluate, search.reevaluate): the report quotes the
mean evaluation accuracy of those re-evaluations, never the winner's own draw (the maximum of noisy draws is
biased upwards: the winner's curse). Without re-evaluations (older sweeps, ``reevaluate: 0``, closed-form
healers) the winner's own accuracy is quoted, with n = 1.

Noise of a quoted number (docs/methods.md#reading-the-noise), per cell i of a family F (grid × model × healer):

    seed_sd_i   = sqrt(((n_i - 1) s_i^2 + K pooled_F^2) / (n_i - 1 + K))   the re-evaluations' std, shrunk
                  (K = 2) towards the family's pooled std: two seeds alone say little about a spread
    search_sd_F = median over F of |winner's own accuracy - re-evaluation mean|: how far one draw of the
                  search lands from what its configuration gives on other seeds
    rival_sd_i  = std of the evaluation accuracies of the cell's *contenders*: the search trials whose objective
                  is within Z sqrt(2) sqrt(pooled_F^2 + split_F^2) of the winner's (as good as the winner given one
                  draw's noise; split_F^2: the family's variance of selection - evaluation accuracy over its search
                  trials, centred per cell, what the selection split's own sampling adds): another search (sampler
                  seed, healing seed) may pick any of them, and quote its number
    noise_i     = sqrt(seed_sd_i^2 / n_i + max(search_sd_F, rival_sd_i)^2)

Where a cell has siblings (the cells of its family that differ only in their seed: same pruner, scope, pattern,
calibration size, granularity), pooled_F and search_sd_F are each at least the same figure over its siblings
(when >= 2 of them have re-evaluations): a family pools sparsities whose draws spread very differently (grid
`healers`: MSE at 0.85 ±0.4 pp, KL at 0.9 ±4 pp), and its median spread under-claimed the noise of the hard
ones (retest of configs/healers.yaml with shifted seeds, 2026-11-30: the noise covered the move in 40 of 45 cells,
all 5 misses at 0.9-0.95; with the sibling figures 45 of 45).

Where a cell has quoted siblings, its noise is at least the std of their quoted numbers (``sibling_sd``,
``_sibling_spread``): they are draws of what a rerun on other seeds would quote. Where the mask depends on the
seed (the siblings' ``mask_digest`` params differ: SnapViT's seeded search) that spread is also ``mask_sd``, which
the report names: re-healing one mask does not measure what another seed's mask gives.

Cells whose healer does not train (closed form, ``none``: lr 0) are not searched, but their mask depends on the
seed: their noise is the binomial standard error of the accuracy on the evaluation images, sqrt(p (1 - p) / n_eval)
(``_closed_form_noise``). With search.calib_draws, a closed-form cell whose healer or pruner reads the calibration
images (CR+BN, CORP; RR, SnapViT, CORP masks) heals once on each other draw as well: its quoted number is the mean
over every draw, its own included (nothing was picked among draws: no winner's curse), and its noise at least
that mean's standard error, sqrt(seed_sd_i^2 / n_i), seed_sd_i shrunk as above but towards its family's cells of
the same pruner (a draw moves an RR mask itself, a magnitude mask not at all; on one draw, RR x CR+BN at 0.9 of
the default spec moved 9-14 pp with the draw against a 2-noise of 7.4: docs/methods.md#reading-the-noise)).
A difference between two quoted numbers is *resolved* when it exceeds Z = 2 noise units of the difference
(``resolved``); a band class is resolved when the quoted number is that far from the class's threshold.
"""
from __future__ import annotations

import math

import numpy as np
import pandas as pd

from .runs import at_config, grid_names, load_sweep_info, load_trials, quoted_per_cell, stage_of

__all__ = ["cell_results", "reported", "resolved", "identical_masks", "closed_form", "Z", "SHRINK"]

Z = 2.0  # noise units a difference must exceed to count as resolved
SHRINK = 2.0  # pseudo-degrees of freedom of the family's pooled seed std
FAMILY = ["grid", "model", "healer"]
# a cell's siblings: the cells of its family that ask the same question on another seed (same pruner and its
# settings, scope, sparsity pattern, calibration size, healer settings and granularity; grid `healers`' 3 seeds of
# one sparsity x healer)
SIBLINGS = [*FAMILY, "pruner", "pruner_settings", "scope", "pattern", "calib_size", "healer_settings", "granularity"]


def reported(trials: pd.DataFrame, objective: str = "selection_acc") -> pd.DataFrame:
    """One row per cell with a finished search trial: ``quoted_per_cell`` of the trials, then

    - ``healed_acc``: the re-evaluations' mean (the winner's own accuracy when there are none; a closed-form cell
      on other draws: the mean over them and its own),
    - ``healed_acc_search``: the winner's own accuracy, ``healed_acc_sd``: the re-evaluations' std,
    - ``quoted_run_ids``: the runs whose mean ``healed_acc`` is, ";"-joined in id order (the winner's run alone
      when there are no re-evaluations),
    - ``n_reevaluated``: finished re-evaluations (a closed-form cell on other draws: its own trial counted too),
      ``n_draws``: the other calibration draws they healed on,
      ``retention``: ``healed_acc / dense_acc``,
    - ``seed_sd``, ``search_sd``, ``noise``: the noise model of the module docstring (accuracy units)."""
    best = quoted_per_cell(trials, objective)  # search trials only: the configuration re-evaluated
    again = _of_winners(trials[(stage_of(trials) == "reevaluate") & (trials["status"] == "FINISHED")], best)
    again = _with_own_draw(again, best)
    stats = again.groupby("cell_id")["healed_acc"].agg(["mean", "std", "size"]) if len(again) else None
    best = best.copy()
    best["healed_acc_search"] = best["healed_acc"]
    m = best["cell_id"].map(stats["mean"]) if stats is not None else pd.Series(np.nan, index=best.index)
    best["n_reevaluated"] = (best["cell_id"].map(stats["size"]).fillna(0).astype(int) if stats is not None else 0)
    best["n_draws"] = _draws(again, best)
    searched = trials[(stage_of(trials) != "reevaluate") & (trials["status"] == "FINISHED")]
    best["healed_acc_sd"] = best["cell_id"].map(stats["std"]) if stats is not None else np.nan
    best["healed_acc"] = m.where(m.notna(), best["healed_acc_search"])
    best["quoted_run_ids"] = _quoted_runs(again, best)
    dense = best["dense_acc"].astype(float)
    best["retention"] = np.where(dense > 0, best["healed_acc"] / dense.where(dense > 0, 1.0), 0.0)
    return _noise(best, searched, objective)


def closed_form(best: pd.DataFrame) -> pd.Series:
    """Per cell: its healer does not train (closed form, ``none``: lr 0, nothing searched)."""
    return best["lr"].fillna(0) <= 0 if "lr" in best.columns else pd.Series(False, index=best.index)


def _with_own_draw(again: pd.DataFrame, best: pd.DataFrame) -> pd.DataFrame:
    """``again`` plus the own trial of each closed-form cell re-evaluated on other calibration draws (search.
    calib_draws: CR+BN, CORP, or a mask that reads the images): nothing was searched, so its own trial is not a
    winner picked among noisy draws but one more draw, and its quoted number is the mean over every draw."""
    if again.empty:
        return again
    own = best[closed_form(best) & best["cell_id"].isin(again["cell_id"])]
    return pd.concat([again, own[[c for c in again.columns if c in own.columns]]], ignore_index=True) \
        if len(own) else again


def _quoted_runs(again: pd.DataFrame, best: pd.DataFrame) -> pd.Series:
    """Per cell (``best``'s index): the runs its quoted ``healed_acc`` averages, ";"-joined in id order: the
    re-evaluations (and a closed-form cell's own trial on other draws), else the winner's run alone."""
    runs = again.groupby("cell_id")["run_id"].agg(lambda s: ";".join(sorted(map(str, s)))) if len(again) else {}
    return pd.Series([runs.get(c) or str(r) for c, r in zip(best["cell_id"], best["run_id"])], index=best.index,
                     dtype=object)


def _draws(again: pd.DataFrame, best: pd.DataFrame) -> pd.Series:
    """Per cell (``best``'s index): the other calibration draws its re-evaluations healed on (search.calib_draws:
    param calib_seed; <NA>: the sweep's own draw, not counted); 0 without any."""
    if again.empty or "calib_seed" not in again.columns:
        return pd.Series(0, index=best.index)
    n = again["calib_seed"].groupby(again["cell_id"]).nunique()  # NA is not a value: the own draw counts 0
    return best["cell_id"].map(n).fillna(0).astype(int)


def _of_winners(again: pd.DataFrame, best: pd.DataFrame) -> pd.DataFrame:
    """The re-evaluations that repeat their cell's winner (same lr and length; a widening round can change the
    winner after earlier re-evaluations ran)."""
    cols = [c for c in ("lr", "steps", "epochs") if c in again.columns and c in best.columns]
    if again.empty or not cols:
        return again
    return at_config(again, best.set_index("cell_id")[cols])


def _rivals(best: pd.DataFrame, searched: pd.DataFrame | None, objective: str, pooled: pd.Series) -> pd.Series:
    """Per cell (``best``'s index): the std (ddof 0) of the evaluation accuracy over its contenders (module
    docstring); 0 with one contender, NaN without search trials or without a pooled std."""
    out = pd.Series(np.nan, index=best.index)
    if searched is None or searched.empty or objective != "selection_acc" or objective not in searched.columns:
        return out  # heldout_align: its units are not accuracy's; the family's search_sd alone
    sign = 1.0
    by_cell = {c: g for c, g in searched.groupby("cell_id")}
    for i, r in best.iterrows():
        g, sd = by_cell.get(r["cell_id"]), pooled.get(i, np.nan)
        if g is None or not np.isfinite(sd) or pd.isna(r.get(objective)):
            continue
        v = sign * g[objective].astype(float)
        near = g[v >= sign * float(r[objective]) - Z * math.sqrt(2) * sd]
        acc = near["healed_acc"].astype(float).dropna()
        out[i] = float(acc.std(ddof=0)) if len(acc) > 1 else 0.0
    return out


def _split_var(best: pd.DataFrame, searched: pd.DataFrame | None, fam: pd.Series, objective: str) -> dict:
    """Family -> variance of (selection accuracy - evaluation accuracy) over its search trials, centred per cell:
    how far the objective a winner is picked by strays from the number quoted, configuration to configuration
    (two splits of 180 and 360 images: their sampling error alone is ~1-2 pp at 90 % accuracy)."""
    if searched is None or searched.empty or objective != "selection_acc" or objective not in searched.columns:
        return {}
    cell_fam = dict(zip(best["cell_id"], fam))
    d = (searched[objective].astype(float) - searched["healed_acc"].astype(float)).rename("d")
    df = pd.DataFrame({"cell": searched["cell_id"], "d": d}).dropna()
    df["d"] = df["d"] - df.groupby("cell")["d"].transform("mean")
    df["fam"] = df["cell"].map(cell_fam)
    n = df.groupby("cell")["d"].transform("size")
    df = df[n > 1]  # a cell of one trial says nothing about the spread
    dof = (df.groupby("fam")["d"].size() - df.groupby("fam")["cell"].nunique()).clip(lower=1)
    return ((df["d"] ** 2).groupby(df["fam"]).sum() / dof).to_dict()


def _noise(best: pd.DataFrame, searched: pd.DataFrame | None = None, objective: str = "selection_acc") -> pd.DataFrame:
    best["grid"] = grid_names(best)
    if best.empty:  # no cell has a finished search trial (every trial failed): nothing to estimate
        return best.assign(seed_sd=np.nan, search_sd=np.nan, rival_sd=np.nan, noise=np.nan, sibling_sd=np.nan,
                           mask_sd=np.nan)
    n = best["n_reevaluated"].astype(float)
    s2 = best["healed_acc_sd"].astype(float) ** 2
    fixed = closed_form(best)
    fam = best[FAMILY].astype(str).agg("|".join, axis=1)
    fam = fam.where(~fixed, fam + "|" + best["pruner"].astype(str)) if "pruner" in best.columns else fam
    dof = (n - 1).clip(lower=0)
    sib = best[[c for c in SIBLINGS if c in best.columns]].astype(object).fillna("").astype(str).agg("|".join, axis=1)
    p2 = _at_least(fam.map(_pooled(fam, dof, s2, 1)), sib.map(_pooled(sib, dof, s2, 2)))
    seed_var = (dof * s2.fillna(0) + SHRINK * p2) / (dof + SHRINK)
    best["seed_sd"] = np.sqrt(seed_var)
    gap = (best["healed_acc_search"] - best["healed_acc"]).abs().where((n > 0) & ~fixed)  # no search: no gap
    search = _at_least(gap.groupby(fam).transform("median"), _sibling_median(gap, sib))
    rival = _rivals(best, searched, objective, np.sqrt(p2 + fam.map(_split_var(best, searched, fam, objective))))
    best["rival_sd"] = rival
    search = _at_least(search, rival).where(~fixed)
    best["search_sd"] = search
    var = seed_var.fillna(0) / n.clip(lower=1) + search.fillna(0) ** 2
    best["noise"] = np.sqrt(var).where(n > 0)  # no re-evaluation: unknown (never "resolved" by default)
    drawn = np.sqrt(seed_var / n).where(fixed & (n > 1))  # a closed-form cell's draws: the mean's standard error
    best.loc[fixed, "noise"] = _at_least(_closed_form_noise(best[fixed]), drawn[fixed])
    best["sibling_sd"] = spread = _sibling_spread(best, sib)
    best["mask_sd"] = spread.where(_masks_differ(best, sib))
    wider = spread.notna() & best["noise"].notna() & (spread > best["noise"])
    best.loc[wider, "noise"] = spread[wider]
    return best


def _sibling_spread(best: pd.DataFrame, sib: pd.Series) -> pd.Series:
    """Per cell: the std (ddof 1) of its siblings' quoted numbers (>= 2 siblings quoted); NaN elsewhere. Siblings
    ask one question on other seeds, so their quoted numbers are draws of what a rerun would quote: their spread
    is that number's noise, measured directly, and the noise is never below it. The model above can miss it: two
    re-evaluations agree within 0.2 pp by chance while the healing seed moves a collapse-edge cell by +-7 pp
    (default grid `healers`, STARFISH+KL at 0.95, 2026-12-01: siblings 63.1-80.8 %, claimed noise 1.6-3.7 pp; a
    rerun on other seeds resolved the opposite order against STARFISH), and where the mask depends on the seed
    (SnapViT) another seed is another mask. best, sib: one entry per cell."""
    acc = best["healed_acc"].astype(float)
    have = acc.notna().groupby(sib).transform("sum")
    # one seed twice among them: not seed replicates (a table without the settings columns, e.g. two settings of one
    # method in a sweep whose runs lack the pruner_settings / healer_settings params)
    replicates = best["seed"].groupby(sib).transform("nunique") == best["seed"].groupby(sib).transform("size") \
        if "seed" in best.columns else True
    return acc.groupby(sib).transform("std").where((have >= 2) & replicates)


def _masks_differ(best: pd.DataFrame, sib: pd.Series) -> pd.Series:
    """Per cell: its siblings hold >= 2 mask digests (the mask depends on the seed, as SnapViT's seeded search makes
    it); False without the ``mask_digest`` param (sweeps before 2026-12-01)."""
    if "mask_digest" not in best.columns:
        return pd.Series(False, index=best.index)
    return best["mask_digest"].groupby(sib).transform("nunique") >= 2


def _pooled(group: pd.Series, dof: pd.Series, s2: pd.Series, min_cells: int) -> dict:
    """Group (family or siblings) -> the dof-weighted pooled variance of its cells' re-evaluations, for groups
    with at least ``min_cells`` cells that have a spread (dof > 0). group, dof, s2: one entry per cell."""
    out = {}
    for key, idx in group.groupby(group).groups.items():
        d = dof[idx]
        if (d > 0).sum() >= min_cells:
            out[key] = float((d * s2[idx].fillna(0)).sum() / d.sum())
    return out


def _sibling_median(gap: pd.Series, sib: pd.Series) -> pd.Series:
    """Per cell: the median |winner's own draw - re-evaluation mean| over its siblings; NaN where fewer than 2
    siblings have one. gap, sib: one entry per cell."""
    have = gap.notna().groupby(sib).transform("sum")
    return gap.groupby(sib).transform("median").where(have >= 2)


def _at_least(a: pd.Series, b: pd.Series) -> pd.Series:
    """Elementwise max of two figures, NaN where both are (a NaN one yields to the other)."""
    return pd.concat([a, b], axis=1).max(axis=1, skipna=True)


def _closed_form_noise(fixed: pd.DataFrame) -> pd.Series:
    """Closed-form cells (nothing searched): the binomial standard error of their accuracy on the ``n_eval``
    evaluation images, sqrt(p (1 - p) / n_eval) (0 where ``n_eval`` is unknown); on other calibration draws
    (search.calib_draws) at least their draws' standard error (``_noise``). Their
    mask still depends on the seed (allocations, calibration samples): with the seed shifted a CR+BN cell moved
    by up to 2.2 pp (benchmarks/results, issue 34), and a noise of 0 called every difference between two such
    cells resolved."""
    if "n_eval" not in fixed.columns:
        return pd.Series(0.0, index=fixed.index)
    p = fixed["healed_acc"].astype(float).clip(0, 1)
    n = pd.to_numeric(fixed["n_eval"], errors="coerce")
    return np.sqrt(p * (1 - p) / n).where(n > 0, 0.0).fillna(0.0)


def resolved(a: float, noise_a: float, b: float, noise_b: float, z: float = Z) -> bool:
    """True when ``a - b`` exceeds ``z`` noise units of the difference; unknown noise (NaN): not resolved."""
    if any(x is None or (isinstance(x, float) and math.isnan(x)) for x in (a, noise_a, b, noise_b)):
        return False
    return abs(a - b) > z * math.hypot(noise_a, noise_b)


def identical_masks(best: pd.DataFrame) -> list[dict]:
    """Cells of one grid, model, calibration size, healer and seed whose pruners produced the same mask (same
    ``mask_digest``, the mask's content; ``mask_key`` names the pruner's settings, so two pruners never share one:
    grouped by it, the check never fired; sweeps without the digest param: ``mask_key``): the same question asked
    twice, so their quoted numbers must agree within noise.
    -> one record per group: the cells (pruner, quoted accuracy, noise), the largest gap and whether it is
    within noise (``agree``; None: a gap and no measured noise to judge it by)."""
    if "mask_key" not in best.columns and "mask_digest" not in best.columns:
        return []
    keys = ["grid", "model", "calib_size", "healer", "seed", "same_mask"]
    same = best["mask_digest"] if "mask_digest" in best.columns else pd.Series(None, index=best.index, dtype=object)
    if "mask_key" in best.columns:
        same = same.where(same.notna(), best["mask_key"])
    df = best.assign(grid=grid_names(best), same_mask=same).dropna(subset=["same_mask"])
    out = []
    for key, g in df.groupby(keys, dropna=False, sort=True):
        if g["pruner"].nunique() < 2:
            continue
        rows = [{"pruner": str(r.pruner), "pattern": str(r.pattern), "healed_acc": float(r.healed_acc),
                 "noise": float(r.noise) if pd.notna(r.noise) else None} for r in g.itertuples(index=False)]
        vals = [r["healed_acc"] for r in rows]
        hi, lo = max(rows, key=lambda r: r["healed_acc"]), min(rows, key=lambda r: r["healed_acc"])
        unknown = hi["noise"] is None or lo["noise"] is None  # no re-evaluation: nothing to judge a gap by
        agree = True if max(vals) == min(vals) else None if unknown else not resolved(
            hi["healed_acc"], hi["noise"], lo["healed_acc"], lo["noise"])
        out.append({**dict(zip(keys, (str(k) for k in key))), "cells": rows, "gap": max(vals) - min(vals),
                    "agree": agree})
    return out


def cell_results(tracking_uri: str, sweep_id: str, experiment: str = "healsweep",
                 cell_id: str | None = None) -> pd.DataFrame:
    """Per cell, exactly the number the report quotes (``healed_acc``, the mean over ``quoted_run_ids``), its
    spread and noise, read back from MLflow: what users and benchmarks compare runs with (benchmarks/bench_retest.py)
    and what an export's card quotes (``cell_id``: that cell alone; its noise then lacks the family's pooling).
    Cells are picked by the sweep's own search objective (the parent run's ``objective`` param)."""
    trials = load_trials(tracking_uri, sweep_id, experiment, cell_id)
    objective = load_sweep_info(tracking_uri, sweep_id, experiment).get("objective") or "selection_acc"
    return reported(trials, objective)
