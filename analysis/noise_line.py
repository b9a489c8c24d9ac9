"""The noise line under each grid's findings: what the report quotes, its measured noise (analysis/reported.py),
whether that noise holds the calibration draw's spread (search.calib_draws), closed-form cells and masks that
depend on the seed, and how many best-method leads are resolved."""
from __future__ import annotations

import pandas as pd

from tasks import catalog

from .reported import closed_form

__all__ = ["noise_line"]


def noise_line(gb: pd.DataFrame, rows: list[dict]) -> str:
    """How sure the grid's numbers are: what is quoted, its measured noise and how many best-method leads are
    resolved (analysis/reported.py)."""
    fixed = closed_form(gb)
    searched = gb[~fixed]
    n_re = searched["n_reevaluated"] if "n_reevaluated" in searched.columns else pd.Series(dtype=float)
    noise = searched["noise"].dropna() if "noise" in searched.columns else pd.Series(dtype=float)
    contested = [r for r in rows if r.get("contested", True)]  # a cell with one pruner × healer has no lead
    leads = sum(bool(r.get("resolved")) for r in contested)
    told = (f"{leads} of {len(contested)} best-method leads resolved" if contested else
            "no best-method lead to resolve (one pruner × healer per cell)")
    closed = gb[fixed & (gb["n_draws"].fillna(0) > 0)] if "n_draws" in gb.columns else gb.iloc[:0]
    if noise.empty and len(closed):  # only closed-form cells, healed on other draws too (search.calib_draws)
        k = _drawn(closed)
        what = (f"Quoted numbers are the mean of each closed-form cell over the sweep's draw of the calibration images "
                f"and {k} other{'s' * (k > 1)} (search.calib_draws); {_spread(closed['noise'])}the draw's spread included")
    elif noise.empty:
        what = "Quoted numbers are each cell's best search trial (no re-evaluation: noise not measured)"
    else:
        what = (f"Quoted numbers are the mean of {int(n_re.median())} re-evaluations of each searched cell's winner"
                f"{_draws_said(searched)}; {_spread(noise)}" + (
                    f"the draw's spread included{_closed_form_said(gb)}" if _drawn(searched) else
                    "on this one draw of the calibration images (another draw can move a cell beyond it: "
                    "docs/methods.md#reading-the-noise)"))
    return f"{what}; {told}.{_seeded_masks(gb)}"


def _spread(noise: pd.Series) -> str:
    return f"noise median ±{100 * noise.median():.2f} pp, max ±{100 * noise.max():.2f} pp, "


def _drawn(searched: pd.DataFrame) -> int:
    """The other calibration draws a typical re-evaluated cell healed on (median, rounded half up; 0: none, every
    re-evaluation on the sweep's own draw)."""
    n = searched["n_draws"].dropna() if "n_draws" in searched.columns else pd.Series(dtype=float)
    n = n[searched.loc[n.index, "n_reevaluated"] > 0] if "n_reevaluated" in searched.columns else n
    return int(n.median() + 0.5) if len(n) else 0


def _draws_said(searched: pd.DataFrame) -> str:
    k = _drawn(searched)
    return f", healed on {k} other draw{'s' * (k > 1)} of the calibration images (search.calib_draws)" if k else ""


def _closed_form_said(gb: pd.DataFrame) -> str:
    """Closed-form cells (lr 0) whose healer or pruner reads the calibration images (CR+BN, CORP; RR, SnapViT, CORP
    masks): healed on every draw and their mean quoted (search.calib_draws re-evaluates them), or, where some were
    healed once on the sweep's draw (a sweep from before closed-form cells healed on the draws), that their noise is
    not the draw's. Those that read none (``none`` on magnitude) give one number on every draw: nothing to say."""
    fixed = closed_form(gb)
    readers = gb[fixed & gb.apply(_reads_calibration, axis=1)] if fixed.any() else gb.iloc[:0]
    if readers.empty:
        return ""
    once = int((readers["n_draws"].fillna(0) == 0).sum()) if "n_draws" in readers.columns else len(readers)
    if once:
        return f" (not in {once} closed-form cell{'s' * (once > 1)}: healed once, on the sweep's draw)"
    return " (closed-form cells: the mean over the sweep's draw and the others)"


def _reads_calibration(row: pd.Series) -> bool:
    """Another draw can change the closed-form cell's number (``catalog.changes_with_draw``, for each step of a
    chain; from the table: a method it does not list reads nothing)."""
    pruner = catalog.PRUNERS.get(str(row.get("pruner", "")))
    return any(catalog.changes_with_draw(pruner, catalog.HEALERS.get(h)) for h in str(row.get("healer", "")).split("+"))


def _seeded_masks(gb: pd.DataFrame) -> str:
    """Where masks depend on the seed (analysis/reported.py ``mask_sd``): which pruners, and that their noise
    includes the seeds' spread; where a pruner's mask depends on the seed (tasks/catalog.py ``seeded_mask``) but its
    cell's spread could not be measured (one seed quoted), that the noise misses it."""
    measured = gb["mask_sd"].notna() if "mask_sd" in gb.columns else pd.Series(False, index=gb.index)
    out = ""
    if measured.any():
        seeded = gb[measured]
        out = (f" The mask depends on the seed for {', '.join(sorted(seeded['pruner'].astype(str).unique()))} "
               f"({len(seeded)} cells): their noise is at least the spread of their seeds' numbers (another seed, "
               f"another mask), up to ±{100 * seeded['mask_sd'].max():.2f} pp.")
    spread = gb["sibling_sd"].notna() if "sibling_sd" in gb.columns else measured  # a spread among its seeds
    blind = gb[~spread & _seeded(gb)] if "pruner" in gb.columns else gb.iloc[:0]
    if len(blind):
        n = len(blind)
        out += (f" The mask of {', '.join(sorted(blind['pruner'].astype(str).unique()))} depends on the seed, but "
                f"{n} of its cells {'has' if n == 1 else 'have'} one seed quoted: their noise misses the spread between masks "
                f"(docs/methods.md#reading-the-noise); list two seeds or more to measure it.")
    return out


def _seeded_pruner(name: str) -> bool:
    """The pruner's mask depends on the seed (its static entry; a pruner the table does not list: False)."""
    return bool(getattr(catalog.PRUNERS.get(name), "seeded_mask", False))


def _seeded(gb: pd.DataFrame) -> pd.Series:
    """Per cell, whether its pruner's mask depends on the seed: the ``seeded_mask`` metric its trial logged (a
    plugin pruner's too), else the static table (sweeps before 2026-12-01)."""
    table = gb["pruner"].astype(str).map(_seeded_pruner)
    if "seeded_mask" not in gb.columns:
        return table
    logged = pd.to_numeric(gb["seeded_mask"], errors="coerce")
    return logged.gt(0).where(logged.notna(), table).astype(bool)
