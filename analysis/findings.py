"""The report's first screen: per model and grid, what the sweep found.

For each pruner × healer (× calibration size) the repairability bands of ``analysis.bands`` are summarised as
three ranges (recoverable, transition, collapse) with the grid's resolution (the gap to the neighbouring grid
point: a band edge is only known to lie between two tested sparsities) and the seed spread; next to them the
calibration-only CTS band. At every sparsity the best healer (per pruner) and the best pruner (per healer) are
named with the paired 95 % interval of their lead over the runner-up (``analysis.ordering.paired_ci``; healers
pair on identical masks, pruners pair on the seed). Warnings: winners on the search boundary
(``search_boundary``), single-seed points, cells without a finished trial. Nothing is recomputed.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import pandas as pd

from .band_ranges import Range, fmt_range, ranges
from .bands import BandSettings, chance_limit
from .leads import ranked, tied_with, values, winner
from .matched import matched_lines
from .noise_line import noise_line
from .reported import Z, closed_form, identical_masks
from .runs import cell_list, grid_names, grid_order, pattern_sort_key
from .search_reach import lone_warning

__all__ = ["Findings", "grid_names", "ranges", "best_rows", "boundary", "edges", "findings", "fmt_range", "FIXED_HEALERS"]

FIXED_HEALERS = ("crbn", "none", "corp")  # closed form / no training: no lr, no epochs
EDGE = 0.1  # fraction of the log-lr range (or of the epochs range) that counts as "on the boundary"


def boundary(row, bounds: dict | None) -> str:
    """'' or a reason: the winning lr in the top/bottom ``EDGE`` of the log range, or its epochs (a steps-based
    search: steps) at the range's maximum. ``bounds``: {"lr": [lo, hi], "epochs" or "steps": [lo, hi]} of the
    row's grid (None: unknown -> '')."""
    return "; ".join(edges(row, bounds).values())


def edges(row, bounds: dict | None) -> dict[str, str]:
    """The search-space edges the winner ``row`` sits on: {"lr_cap" | "lr_floor" | "length_cap": reason}
    (``boundary`` joins the reasons; orchestrator/lifecycle/widen.py searches past these edges)."""
    if not bounds or pd.isna(row.get("lr")) or float(row.get("lr") or 0) <= 0:
        return {}
    lo, hi = bounds["lr"]
    why = {}
    if hi > lo:  # a fixed lr (lo == hi) was not searched: no boundary to sit on
        pos = (math.log(float(row["lr"])) - math.log(lo)) / (math.log(hi) - math.log(lo))
        if pos >= 1 - EDGE:
            why["lr_cap"] = f"lr {float(row['lr']):.2g} at the {hi:.2g} cap"
        elif pos <= EDGE:
            why["lr_floor"] = f"lr {float(row['lr']):.2g} at the {lo:.2g} floor"
    key = "steps" if bounds.get("steps") else "epochs"
    elo, ehi = bounds.get(key) or (0, 0)
    n = row.get(key)
    if ehi > elo and n is not None and pd.notna(n) and int(n) >= ehi:
        why["length_cap"] = f"{int(n)} of {ehi} {key}"
    return why


def best_rows(best: pd.DataFrame) -> list[dict]:
    """Per sparsity × calib size: the best pruner × healer, the combos it is not resolved from (``tied``: named
    beside it), and its lead over the runner-up healer (same pruner, identical masks) and runner-up pruner (same
    healer, paired on the seed)."""
    df = best[best["healed_acc"].notna()].copy()
    df["_combo"] = df["pruner"].astype(str) + " × " + df["healer"].astype(str)
    out = []
    for (pat, n), g in sorted(df.groupby(["pattern", "calib_size"], dropna=False),
                              key=lambda kv: (pattern_sort_key(kv[0][0]), float(kv[0][1]) if pd.notna(kv[0][1])
                                              else math.inf)):
        combos = values(g, "_combo", "seed")
        combo, acc, _, resolved = winner(combos)
        pruner, healer = combo.split(" × ", 1)
        vs_healer = winner(values(g[g["pruner"] == pruner], "healer", "mask"))[2]
        vs_pruner = winner(values(g[g["healer"] == healer], "pruner", "seed"))[2]
        out.append(dict(pattern=str(pat), calib_size="–" if pd.isna(n) else str(int(n)), best=combo,
                        healed=acc, vs_healer=vs_healer, vs_pruner=vs_pruner, tied=tied_with(combos, combo),
                        resolved=resolved, contested=len(ranked(combos)[0]) > 1))
    return out


@dataclass
class Findings:
    model: str
    grid: str
    ranges: list[Range]
    best: list[dict]
    warnings: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    budget: str = ""  # the healing budget the bands and leads hold within (analysis/budget.py): first screen

    @property
    def flags(self) -> list[str]:
        """One short label per warning, for the first screen (the full text follows the tables)."""
        return [flag_of(w) for w in self.warnings]


def flag_of(warning: str) -> str:
    """'23 of 34 searched cells' winners sit on the search boundary, so …: cells' -> '23 of 34 searched cells'
    winners sit on the search boundary'; other warnings: their first sentence (up to ':' or '.', outside parentheses)."""
    depth = 0
    for i, ch in enumerate(warning):
        depth += (ch == "(") - (ch == ")")
        if depth == 0 and (ch in ":." and (i + 1 == len(warning) or warning[i + 1] == " ")):
            return _unbracket(warning[:i].split(", so ")[0])
    return _unbracket(warning)


def _unbracket(text: str) -> str:
    """``text`` without its parenthesised parts: 'budgets (64 images: 2 steps) differ' -> 'budgets differ'."""
    out, depth = [], 0
    for ch in text:
        depth += ch == "("
        if depth == 0:
            out.append(ch)
        depth -= ch == ")" and depth > 0
    return " ".join("".join(out).split())


def headline(rows: list[dict]) -> str:
    """The best pruner × healer at each sparsity over calibration sizes: '0.5: magnitude × crbn 97.2 % · …'; a lead
    that is not resolved names what the best is tied with: '0.9: lamp × starfish 91.2 % (≈ erk × starfish: lead not
    resolved)'."""
    top: dict[str, dict] = {}
    for r in rows:  # best_rows is ordered by sparsity, then calibration size
        if r["pattern"] not in top or r["healed"] > top[r["pattern"]]["healed"]:
            top[r["pattern"]] = r
    calibs = len({r["calib_size"] for r in rows}) > 1
    return " · ".join(f"{p}: {r['best']} {100 * r['healed']:.1f} %" + (f" (calib {r['calib_size']})" if calibs else "")
                      + ("" if r.get("resolved", True) else f" ({_tied_text(r.get('tied', []))}lead not resolved)")
                      for p, r in top.items())


def _tied_text(tied: list[str]) -> str:
    """'≈ a, b: ' (at most two named), '≈ 3 others: ', or ''."""
    if not tied:
        return ""
    return f"≈ {', '.join(tied)}: " if len(tied) <= 2 else f"≈ {len(tied)} others: "


def common_failure(trials: pd.DataFrame | None, cells: list[str] | None = None) -> str:
    """' Most common failure (k of n failed trials): REASON.' over the trials (of ``cells``) that logged a
    ``failure_reason`` (the last line of the trial's error: orchestrator/tracking/logger.py), and how many of them a
    retry runs again (orchestrator/tracking/retry.py: all but the diverged ones); '' when none did."""
    if trials is None or "failure_reason" not in trials.columns:
        return ""
    t = trials if cells is None else trials[trials["cell_id"].isin(cells)]
    reasons = t["failure_reason"].dropna().astype(str)
    reasons = reasons[reasons.str.strip() != ""]
    if reasons.empty:
        return ""
    top = reasons.value_counts()  # (reason -> count), most common first
    raised = int((~reasons.str.startswith("HealingDiverged")).sum())  # not a configuration's result: retried
    again = (f" {raised} of them raised an error, not divergence: healsweep run --resume DIR --retry-failed runs them "
             "again once its cause is mended." if raised else "")
    return f" Most common failure ({top.iloc[0]} of {len(reasons)} failed trials): {top.index[0][:300]}.{again}"


def _warnings(mb: pd.DataFrame, failed: list[str], why: str = "", trials: pd.DataFrame | None = None) -> list[str]:
    """``why``: the failed cells' most common failure (``common_failure``); ``trials``: the grid's trials (the
    cells whose search found at most one configuration above chance)."""
    chance = dense_at_chance(mb)
    out = [chance] if chance else []
    searched = mb[~closed_form(mb)]  # a closed-form cell (CR+BN, none) searches nothing: no boundary, binomial noise
    edge = mb[mb["search_boundary"].astype(bool)] if "search_boundary" in mb.columns else mb.iloc[:0]
    at_budget = edge["search_boundary"].astype(str).str.fullmatch(r"\d+ of \d+ (steps|epochs)")
    edge = edge[~at_budget]  # on the length cap only: the declared budget (the first screen's budget line), not under-tuned
    if len(edge):
        out.append(f"{len(edge)} of {len(searched)} searched cells' winners sit on the search boundary, so those accuracies may "
                   f"be under-tuned: {cell_list(edge, lambda r: r.search_boundary)}.")
    seeds = mb.groupby(["pruner", "healer", "pattern", "calib_size"], dropna=False)["seed"].nunique()
    if len(seeds) and seeds.max() <= 1:
        judged = searched if len(searched) else mb
        measured = "noise" in mb.columns and judged["noise"].astype(float).notna().all()  # re-evaluations
        out.append("Single seed: no point has a spread or a confidence interval; differences are tested against the "
                   "measured noise only (search + re-healing), not across seeds." if measured else
                   "Single seed: no point has a spread or a confidence interval; differences are not tested.")
    budget = _budget_warning(mb)
    if budget:
        out.append(budget)
    lowered = healing_lowered(mb)
    if lowered:
        out.append(lowered)
    lone = "" if trials is None or chance else lone_warning(trials, mb)  # at chance: every point collapses anyway
    if lone:
        out.append(lone)
    if failed:
        out.append(f"Cells without a finished trial ({len(failed)}): {_failed_names(failed, trials)}; their "
                   "sparsities are missing from the ranges above." + why)
    return out


def _failed_names(failed: list[str], trials: pd.DataFrame | None) -> str:
    """'magnitude/starfish 0.95 n=64 seed 0 (cell a53415a4fef8), …' from the cells' trials (the id alone without)."""
    cols = {"cell_id", "pruner", "healer", "pattern", "calib_size", "seed"}
    if trials is None or not cols <= set(trials.columns):
        return ", ".join(failed[:6]) + (" …" if len(failed) > 6 else "")
    rows = trials[trials["cell_id"].isin(failed)].drop_duplicates("cell_id")
    known = cell_list(rows, lambda r: f"cell {r.cell_id}")
    unnamed = [c for c in failed if c not in set(rows["cell_id"])]
    return ", ".join(x for x in (known, ", ".join(unnamed)) if x)


def dense_at_chance(mb: pd.DataFrame) -> str:
    """A dense model within 2 binomial standard errors of chance (the collapse rule, analysis/bands.py): every
    point then reads 'collapse' whatever healing did, so the grid's bands and leads say nothing."""
    cols = {"dense_acc", "num_classes", "n_eval"}
    g = mb.dropna(subset=list(cols)) if cols <= set(mb.columns) else mb.iloc[:0]
    if g.empty:
        return ""
    dense, k, n = float(g["dense_acc"].max()), float(g["num_classes"].max()), float(g["n_eval"].min())
    lim = chance_limit(k, n, BandSettings().z)
    if math.isnan(lim) or dense > lim:
        return ""
    return (f"Dense model at chance: {100 * dense:.1f} % on {n:g} evaluation images is within 2 binomial standard "
            f"errors of chance for {k:g} classes ({100 * lim:.1f} %), so every point reads 'collapse' and the bands "
            "and leads below say nothing (untrained or random-init weights, or the wrong classes for this data?).")


def healing_lowered(mb: pd.DataFrame) -> str:
    """Cells whose quoted healed accuracy is below their pruned model's before healing by more than ``Z`` noise
    units: a healer that harms there. The pruned accuracy is exact (one mask, one evaluation set, no draw); cells
    of unknown or zero noise (no evaluation-set size logged) are left out. It read 95.0 -> 14.7 % where CR+BN
    amplified collapsed channels (2026-12-01)."""
    cols = {"pruned_acc", "healed_acc", "noise", "healer"}
    if not cols <= set(mb.columns):
        return ""
    noise = pd.to_numeric(mb["noise"], errors="coerce")
    g = mb[(mb["healer"].astype(str) != "none") & noise.gt(0)].dropna(subset=["pruned_acc", "healed_acc"])
    drop = g["pruned_acc"].astype(float) - g["healed_acc"].astype(float)  # (cells,) accuracy lost by healing
    hit = g.assign(_drop=drop)[drop > Z * noise[g.index]].sort_values("_drop", ascending=False)
    if hit.empty:
        return ""
    cells = cell_list(hit, lambda r: f"{100 * r.pruned_acc:.1f} → {100 * r.healed_acc:.1f} %")
    return (f"Healing lowered accuracy in {len(hit)} of {len(g)} cells, by more than {Z:g} noise units below the "
            f"pruned model before healing: {cells}.")


def _budget_warning(mb: pd.DataFrame) -> str:
    """Epochs are passes over the calibration set: calibration sizes differ in optimizer steps per epoch (a
    steps-based search, ``steps`` logged, gives every calibration size the same budget: no warning)."""
    g = mb[(mb["lr"].fillna(0) > 0) & mb["calib_size"].notna() & mb["batch_size"].notna()]
    if "steps" in g.columns:
        g = g[g["steps"].isna()]
    sizes = sorted({(int(n), int(b)) for n, b in zip(g["calib_size"], g["batch_size"])})
    per_epoch = {n: math.ceil(n / b) for n, b in sizes}  # optimizer steps per epoch
    if len(per_epoch) < 2 or len(set(per_epoch.values())) < 2:  # one size, or the same steps each (16 and 32 at 32)
        return ""
    steps = ", ".join(f"{n} images: {per_epoch[n]} step{'s' if per_epoch[n] != 1 else ''}/epoch (batch {b})"
                      for n, b in sizes)
    return (f"Calibration sizes get different optimisation budgets for the same epochs ({steps}): comparing "
            "calibration sizes also compares budgets (docs/methods.md#search).")


def findings(best: pd.DataFrame, model: str, recs: list[dict], cts: dict | None,
             failed: dict[str, list[str]], trials: pd.DataFrame | None = None,
             objective: str = "selection_acc", widened: dict | None = None,
             bounds: dict | None = None) -> list[Findings]:
    """One ``Findings`` per grid of this model (grids are never mixed). ``trials``: the model's trials, for the
    label-free objective's agreement (analysis/heldout_agreement.py) and the cells whose search found at most one
    configuration above chance (analysis/search_reach.py). ``objective``: what picked each cell's
    winner (the sweep's search objective). ``widened``: cell id -> widening note (orchestrator/lifecycle/widen.py)."""
    from .budget import budget_line
    from .heldout_agreement import agreement, agreement_line

    grids = grid_names(best)
    tgrids = grid_names(trials) if trials is not None else None
    out = []
    for grid in grid_order(grids):
        gb = best[grids == grid]
        gr = [r for r in recs if (r.get("grid") or "main") == grid]
        why = common_failure(trials, failed[grid]) if failed.get(grid) else ""
        gt = trials[tgrids == grid] if trials is not None else None
        f = Findings(model, grid, ranges(gr, cts), best_rows(gb), _warnings(gb, failed.get(grid, []), why, gt),
                     budget=budget_line(gb, (bounds or {}).get(grid) or (bounds or {}).get("main"), gt))
        line = agreement_line(agreement(gt)) if gt is not None else ""
        f.notes = [OBJECTIVE_NOTE] if objective == "heldout_align" else []
        f.notes += [line] if line else []
        f.notes += _widened_note(gb, widened or {})
        f.notes += [stop_summary_of(gb)] if stop_summary_of(gb) else []
        f.notes.insert(int(objective == "heldout_align"), noise_line(gb, f.best))  # after the label-free note
        f.notes += matched_lines(gb)
        same = identical_mask_lines(gb)
        f.notes += [ln for ok, ln in same if ok]
        f.warnings += [ln for ok, ln in same if not ok]
        out.append(f)
    return out


def stop_summary_of(gb: pd.DataFrame) -> str:
    """'Search stopped per cell: 40 converged, 5 cap; …' from ``search_stop`` (analysis/search_stops.py)."""
    if "search_stop" not in gb.columns:
        return ""
    from .search_stops import stop_summary

    rec = {r.cell_id: {"reason": r.search_stop, "trials": r.search_trials} for r in gb.itertuples() if r.search_stop}
    return stop_summary(rec, list(rec))


def identical_mask_lines(gb: pd.DataFrame) -> list[tuple[bool, str]]:
    """(agree, line): one line per group of cells whose pruners produced the same mask and whose quoted numbers
    disagree beyond noise (the same question asked twice, answered differently: analysis/reported.identical_masks),
    and one line summing up the groups that agree."""
    groups = identical_masks(gb)
    out = []
    for g in (g for g in groups if g["agree"] is not True):
        vals = " vs ".join(f"{c['pruner']} {100 * c['healed_acc']:.1f} %" for c in g["cells"])
        verdict = "DISAGREE beyond noise" if g["agree"] is False else "differ, noise not measured (search.reevaluate 0)"
        out.append((False, f"Identical masks ({g['healer']}, {g['cells'][0]['pattern']}, calib {g['calib_size']}, "
                           f"seed {g['seed']}): {vals}: {verdict} (gap {100 * g['gap']:.2f} pp)."))
    if agree := [g for g in groups if g["agree"] is True]:
        pruners = sorted({" = ".join(sorted(c["pruner"] for c in g["cells"])) for g in agree})
        at = sorted({g["cells"][0]["pattern"] for g in agree})
        out.append((True, f"Identical masks: in {len(agree)} cell group(s) two pruners produced the same mask "
                          f"({', '.join(pruners)} at {', '.join(at)}); their quoted numbers agree within noise "
                          f"(largest gap {100 * max(g['gap'] for g in agree):.2f} pp)."))
    return out


def _widened_note(gb: pd.DataFrame, widened: dict) -> list[str]:
    wide = gb[gb["cell_id"].isin(list(widened))]
    if wide.empty:
        return []
    cells = cell_list(wide, lambda r: widened[r.cell_id], sep="; ")
    return [f"Widened search: {len(wide)} cell(s) whose winner sat on the search boundary were searched past it "
            f"(search.widen): {cells}."]


OBJECTIVE_NOTE = ("Winners were picked label-free: each cell's trial with the lowest heldout_align (the alignment loss "
                  "on calibration images no trial trained on; search.objective heldout_align), not by selection "
                  "accuracy.")
