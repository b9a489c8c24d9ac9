"""Healers compared on identical masks: the paired table of a model's report section.

For every model x pruner x scope x pattern x calibration size ("group") it lists each healer's healed accuracy
(the best trial of its cell, chosen on the selection split) as mean ± std over seeds, and the paired difference
against the reference healer ``starfish``: for every seed where both ran, d = healed(healer) - healed(starfish)
on the same cell but for the healer; the table shows mean ± std of d over those seeds. A pair whose two runs
carry different ``mask_key`` tags is not identical-mask and is left out (counted in the note). std is the sample
standard deviation (ddof = 1), shown only with two or more values. Nothing is recomputed: only logged metrics.
"""
from __future__ import annotations

import html
import math
from dataclasses import dataclass

import pandas as pd

from .ordering import LEGEND, claim_check, measured_ordering
from .runs import pattern_sort_key

__all__ = ["REFERENCE", "PairedRow", "paired_groups", "paired_sections", "healer_panels"]

REFERENCE = "starfish"
GROUP = ("pruner", "scope", "pattern", "calib_size")
HEADERS = ["healer", "seeds", "pruned (%)", "healed (%)", f"Δ vs {REFERENCE} (pp)", "pairs"]
NOTE = (f"Healed top-1 quoted per cell (its winner re-evaluated on fresh seeds), mean ± std over seeds. Δ = paired difference against "
        f"{REFERENCE} on identical masks (same model, pruner, pattern, calibration size and seed; only the "
        f"healer differs), mean ± std over seeds; pp = percentage points. Sorted by mean healed accuracy.")


@dataclass
class PairedRow:
    healer: str
    seeds: int
    pruned_mean: float
    healed_mean: float
    healed_std: float | None
    diff_mean: float | None  # None: no pair with the reference (or this is the reference)
    diff_std: float | None
    pairs: int
    unpaired: int  # seeds present in both but on different masks


def _mean_std(values: list[float]) -> tuple[float, float | None]:
    s = pd.Series(values, dtype="float64")
    return float(s.mean()), (float(s.std(ddof=1)) if len(s) > 1 else None)


def _labels(g: pd.DataFrame) -> pd.Series:
    """Healer name; plus the granularity where one healer name has several rows per seed (e.g. two settings)."""
    lab = g["healer"].astype("object").fillna("?").astype(str)
    dup = g.assign(_l=lab).duplicated(["_l", "seed"], keep=False)
    return lab.where(~dup, lab + " [" + g["granularity"].astype("object").fillna("?").astype(str) + "]")


def _rows(g: pd.DataFrame, reference: str) -> list[PairedRow]:
    g = g.assign(_label=_labels(g))
    ref = g[g["_label"] == reference].drop_duplicates("seed").set_index("seed")
    out = []
    for label, h in g.groupby("_label", sort=True):
        h = h.drop_duplicates("seed")
        mean, std = _mean_std(h["healed_acc"].tolist())
        diffs, unpaired = [], 0
        if label != reference:
            for r in h.itertuples(index=False):
                if r.seed not in ref.index or pd.isna(r.seed):
                    continue
                other = ref.loc[r.seed]
                same = (not isinstance(r.mask_key, str) or not isinstance(other["mask_key"], str)
                        or r.mask_key == other["mask_key"])
                if same:
                    diffs.append(r.healed_acc - other["healed_acc"])
                else:
                    unpaired += 1
        dm, ds = _mean_std(diffs) if diffs else (None, None)
        out.append(PairedRow(label, len(h), float(h["pruned_acc"].mean()), mean, std, dm, ds, len(diffs), unpaired))
    return sorted(out, key=lambda r: (-r.healed_mean if not math.isnan(r.healed_mean) else math.inf, r.healer))


def _values(g: pd.DataFrame) -> dict[str, dict[tuple, float]]:
    """healer label -> {(seed, mask_key): healed accuracy}: what analysis/ordering.py pairs."""
    g = g.assign(_label=_labels(g))
    return {label: {(r.seed, r.mask_key if isinstance(r.mask_key, str) else None): float(r.healed_acc)
                    for r in h.drop_duplicates("seed").itertuples(index=False)}
            for label, h in g.groupby("_label", sort=True)}


def _noise(g: pd.DataFrame) -> dict[str, dict[tuple, float]] | None:
    """healer label -> {(seed, mask_key): noise of the quoted number} (analysis/reported.py); None without it."""
    if "noise" not in g.columns:
        return None
    g = g.assign(_label=_labels(g))
    return {label: {(r.seed, r.mask_key if isinstance(r.mask_key, str) else None): float(r.noise)
                    for r in h.drop_duplicates("seed").itertuples(index=False)}
            for label, h in g.groupby("_label", sort=True)}


def _groups(best: pd.DataFrame):
    best = best[best["healed_acc"].notna()]
    out = [(dict(zip(GROUP, key)), g) for key, g in best.groupby(list(GROUP), dropna=False, sort=False)
           if g["healer"].nunique() >= 2]
    return sorted(out, key=lambda x: (str(x[0]["pruner"]), str(x[0]["scope"]), pattern_sort_key(x[0]["pattern"]),
                                      float(x[0]["calib_size"]) if pd.notna(x[0]["calib_size"]) else math.inf))


def paired_groups(best: pd.DataFrame, reference: str = REFERENCE) -> list[tuple[dict, list[PairedRow]]]:
    """[(group values, rows)] for one model's best-per-cell frame; only groups with two or more healers."""
    return [(group, _rows(g, reference)) for group, g in _groups(best)]


def healer_panels(best: pd.DataFrame) -> list[tuple[str, dict[str, dict[tuple, float]]]]:
    """[(group title, healer -> {(seed, mask_key): healed acc})] of the groups where a healer ran with two or
    more seeds: what ``analysis.figures.healers_figure`` draws."""
    vary_scope = best["scope"].astype("object").nunique() > 1
    out = []
    for group, g in _groups(best):
        values = _values(g)
        if max(map(len, values.values()), default=0) >= 2:
            out.append((_title(group, vary_scope), values))
    return out


def ordering_lines(g: pd.DataFrame) -> list[str]:
    """The measured ordering of one group and, where its healers ran, the paper's claim pair by pair; nothing
    when every healer ran with one seed only."""
    values = _values(g)
    if max(map(len, values.values()), default=0) < 2:
        return []  # one seed: no noise estimate, nothing to order beyond the table
    noise = _noise(g)
    lines = [f"Measured ordering (paired, 95 % CI): {measured_ordering(values, noise)}"]
    checks = claim_check(values, noise=noise)
    if checks:
        lines.append("Paper's claim cosine ≥ MSE ≥ KL ≥ CE: " + "; ".join(
            f"{a} − {b} = {_pm(ci.mean, None, sign=True)} pp"
            f"{'' if ci.half is None else f' [95 % CI {(ci.mean - ci.half) * 100:+.2f}, {(ci.mean + ci.half) * 100:+.2f}]'}"
            f" ({word})" for a, b, ci, word in checks))
    return lines


def _pm(mean: float | None, std: float | None, scale: float = 100.0, sign: bool = False) -> str:
    if mean is None or math.isnan(mean):
        return "–"
    text = format(mean * scale, "+.2f" if sign else ".2f")
    return text if std is None else f"{text} ± {std * scale:.2f}"


def _cells(r: PairedRow) -> list[str]:
    pairs = str(r.pairs) + (f" ({r.unpaired} on other masks)" if r.unpaired else "")
    return [r.healer, str(r.seeds), _pm(r.pruned_mean, None), _pm(r.healed_mean, r.healed_std),
            "reference" if r.healer == REFERENCE else _pm(r.diff_mean, r.diff_std, sign=True),
            "–" if r.healer == REFERENCE else pairs]


def _title(group: dict, vary_scope: bool) -> str:
    n = group["calib_size"]
    parts = [str(group["pruner"]), *([str(group["scope"])] if vary_scope else []), f"pattern {group['pattern']}",
             f"calib size {int(n) if pd.notna(n) else '–'}"]
    return ", ".join(parts)


def _informative(g: pd.DataFrame) -> bool:
    """A paired table says something beyond the main table with two or more seeds (noise, pairing) or three or
    more healers (an ordering); a two-row single-seed table repeats two numbers of the main table."""
    return g.groupby("healer")["seed"].nunique().max() >= 2 or g["healer"].nunique() >= 3


def paired_sections(best: pd.DataFrame) -> tuple[list[str], list[str]]:
    """(markdown lines, html fragments) of the paired section for one model; both empty with < 2 healers, or
    when no group is informative (``_informative``)."""
    groups = [(group, g) for group, g in _groups(best) if _informative(g)]
    if not groups:
        return [], []
    vary_scope = best["scope"].astype("object").nunique() > 1
    e = html.escape
    md = ["", "### Healers on identical masks", "", NOTE + " Ordering: " + LEGEND]
    ht = ["<h3>Healers on identical masks</h3>", f'<p class="note">{e(NOTE + " Ordering: " + LEGEND)}</p>']
    for group, g in groups:
        rows, order = _rows(g, REFERENCE), ordering_lines(g)
        title = _title(group, vary_scope)
        md += ["", f"#### {title}", "", "| " + " | ".join(HEADERS) + " |",
               "|---|" + "---:|" * (len(HEADERS) - 1)]
        md += ["| " + " | ".join(_cells(r)) + " |" for r in rows]
        md += [""] + [f"{line}  " for line in order]
        head = "".join(f"<th>{e(h)}</th>" for h in HEADERS)
        tds = ['<td class="l">'] + ["<td>"] * (len(HEADERS) - 1)
        body = "".join("<tr>" + "".join(f"{td}{e(c)}</td>" for td, c in zip(tds, _cells(r))) + "</tr>\n"
                       for r in rows)
        ht += [f"<h4>{e(title)}</h4>", f"<table>\n<thead><tr>{head}</tr></thead>\n<tbody>\n{body}</tbody>\n</table>",
               *(f'<p class="ordering">{e(line)}</p>' for line in order)]
    return md, ht
