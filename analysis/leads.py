"""Leads between labelled groups of quoted cells (pruner × healer combos, healers, pruners, patterns): each label's
quoted numbers keyed by what pairs them (the seed, and for healers the mask), the noise of their mean, and whether
one label's lead over another is resolved (analysis/reported.py noise, and with several seeds the paired 95 %
interval of analysis/ordering.py). Used by the best lines (analysis/findings.py) and the matched-sparsity lines
(analysis/matched.py)."""
from __future__ import annotations

import math
from dataclasses import dataclass

import pandas as pd

from .ordering import paired_ci
from .reported import Z, resolved

__all__ = ["Lead", "values", "lead", "lead_text", "ranked", "winner", "tied_with"]

VN = tuple[dict[str, dict[tuple, float]], dict[str, float]]  # (label -> {pairing key: quoted acc}, label -> noise)


def values(g: pd.DataFrame, by: str, key: str) -> VN:
    """(label -> {pairing key: quoted healed acc}, label -> noise of its mean over those keys); healers pair on
    (seed, mask), pruners on the seed alone."""
    out: dict[str, dict[tuple, float]] = {}
    noise: dict[str, float] = {}
    for lab, h in g.groupby(by, sort=True):
        h = h.drop_duplicates("seed")
        out[str(lab)] = {((r["seed"], r["mask_key"] if isinstance(r.get("mask_key"), str) else None)
                          if key == "mask" else (r["seed"],)): float(r["healed_acc"]) for _, r in h.iterrows()}
        nz = h["noise"].astype(float) if "noise" in h.columns else pd.Series(math.nan, index=h.index)
        noise[str(lab)] = math.sqrt(float((nz ** 2).sum())) / len(h) if nz.notna().all() else math.nan
    return out, noise


@dataclass(frozen=True)
class Lead:
    """``a``'s lead over ``b``: the paired mean difference over their shared seeds (None: no shared seed), its 95 %
    half-width (None: one seed), the noise band it must exceed (NaN: not measured) and whether it is resolved."""

    mean: float | None
    half: float | None
    n: int
    band: float
    ok: bool

    def why(self) -> str:
        """"resolved: 2 noise units = ±x pp" (or "not resolved: ..."): ``band`` is 2 units already (reported.Z)."""
        within = f"{Z:g} noise units = ±{100 * self.band:.2f} pp" if not math.isnan(self.band) else "noise not measured"
        return f"{'resolved' if self.ok else 'not resolved'}: {within}"

    def interval(self, sign: int = 1) -> str:
        """" [95 % CI lo, hi], n=N" of ``sign`` × the difference ("" with one seed)."""
        if self.half is None:
            return ""
        lo, hi = sorted((100 * sign * (self.mean - self.half), 100 * sign * (self.mean + self.half)))
        return f" [95 % CI {lo:+.2f}, {hi:+.2f}], n={self.n}"


def lead(vn: VN, a: str, b: str) -> Lead:
    """``a``'s lead over ``b``: resolved only when it exceeds the measured noise (analysis/reported.py: search + seed
    noise), is positive on their shared seeds and, with several seeds, its paired 95 % CI excludes 0."""
    vals, noise = vn
    means = ranked(vn)[1]
    band = Z * math.hypot(noise.get(a, math.nan), noise.get(b, math.nan))
    measured = not math.isnan(band)  # no re-evaluations (reevaluate: 0, older sweeps): the seeds' CI alone
    ok = resolved(means[a], noise[a], means[b], noise[b]) if measured else None
    ci = paired_ci(vals[a], vals[b])
    if ci is None:
        return Lead(None, None, 0, band, False)
    if ci.half is None:
        return Lead(ci.mean, None, ci.n, band, bool(ok) and ci.mean > 0)
    # never narrower than the noise band (analysis/ordering.paired_ci's floor, docs/methods.md): the seeds' t-interval
    # alone excluded 0 beside "not resolved" (+9.03 pp [+3.38, +14.68] with a band of ±12.7 pp)
    half = max(ci.half, band) if measured else ci.half
    return Lead(ci.mean, half, ci.n, band, ci.mean - half > 0 and ok is not False)


def lead_text(vn: VN, a: str, b: str) -> tuple[bool, str]:
    """(whether ``a``'s lead over ``b`` is resolved, "+x pp vs b [95 % CI lo, hi], n=N (resolved: 2 noise units = ±y pp)")."""
    d = lead(vn, a, b)
    if d.mean is None:
        return False, f"vs {b}: no shared seed"
    return d.ok, f"{100 * d.mean:+.2f} pp vs {b}{d.interval()} ({d.why()})"


def ranked(vn: VN) -> tuple[list[str], dict[str, float]]:
    """(labels by mean, best first; ties by name), label -> mean."""
    means = {k: sum(v.values()) / len(v) for k, v in vn[0].items() if v}
    return sorted(means, key=lambda k: (-means[k], k)), means


def winner(vn: VN) -> tuple[str, float, str, bool]:
    """(label of the best mean, its mean, 'lead over runner-up' text, whether that lead is resolved; ``lead_text``)."""
    order, means = ranked(vn)
    best = order[0]
    if len(order) == 1:
        return best, means[best], "(the only one)", True
    ok, text = lead_text(vn, best, order[1])
    return best, means[best], text, ok


def tied_with(vn: VN, best: str) -> list[str]:
    """The labels whose gap to ``best`` is not resolved (``lead_text``), by name: the report cannot tell them from the
    best, so a best line names them beside it (a different argmax among them on a rerun is not a different claim)."""
    return sorted(k for k, v in vn[0].items() if v and k != best and not lead(vn, best, k).ok)
