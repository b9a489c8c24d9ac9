"""Figures of the transition-band report (Agg canvases; no global matplotlib state).

- ``bands_figure``: healed accuracy vs sparsity (seed mean ± std) per healer, bands shaded,
  CTS core/band marked.
- ``cts_figure``: G, T, CTS, CTS̄ with threshold, core and broad band.
- ``rr_heatmap``: per-layer R_ℓ(s) on the candidate grid.
- ``allocation_figure``: s_ℓ(RR) − s_ℓ(ERK) per layer at one target (the Relative Repairability paper Fig. 4 style).
- ``healers_figure``: healers on identical masks, every seed's accuracy joined across healers (paired view),
  mean ± std per healer.
"""
from __future__ import annotations

import math

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.colors import LogNorm
from matplotlib.figure import Figure
from matplotlib.patches import Patch

from .layout import fit_legend

__all__ = ["bands_figure", "cts_figure", "rr_heatmap", "allocation_figure", "healers_figure", "BAND_COLORS"]

BAND_COLORS = {"recoverable": "#2ca02c", "transition": "#ff7f0e", "collapse": "#d62728"}


def _fig(w: float, h: float, constrained: bool = False) -> Figure:
    fig = Figure(figsize=(w, h), dpi=100, layout="constrained" if constrained else None)
    FigureCanvasAgg(fig)
    return fig


def _edges(xs: list[float]) -> list[tuple[float, float]]:
    """Span of each point: halfway to its neighbours (a 0.005 half-width at the ends)."""
    out = []
    for i, x in enumerate(xs):
        lo = (xs[i - 1] + x) / 2 if i > 0 else x - (xs[1] - x) / 2 if len(xs) > 1 else x - 0.0025
        hi = (xs[i + 1] + x) / 2 if i + 1 < len(xs) else x + (x - xs[i - 1]) / 2 if len(xs) > 1 else x + 0.0025
        out.append((max(0.0, lo), min(1.0, hi)))  # sparsity lives in [0, 1]
    return out


def _mark_cts(ax, cts: dict | None) -> None:
    if not cts:
        return
    if cts.get("band"):
        b = cts["band"]
        ax.axvspan(b["lo"] - 0.0025, b["hi"] + 0.0025, facecolor="none", edgecolor="navy", linestyle="--",
                   linewidth=1.2, label=f"CTS band {100 * b['lo']:.1f}–{100 * b['hi']:.1f}%")
    if cts.get("core"):
        c = cts["core"]
        ax.axvspan(c["lo"] - 0.0025, c["hi"] + 0.0025, facecolor="none", edgecolor="black", hatch="//",
                   linewidth=1.2, label=f"CTS core {100 * c['lo']:.1f}–{100 * c['hi']:.1f}%")


def bands_figure(records: list[dict], title: str, cts: dict | None = None) -> Figure:
    """One panel per band record (healer × calib size × ...), accuracy in %, one shared y scale; one legend
    below the panels."""
    n = max(1, len(records))
    cols = min(3, n)
    rows = math.ceil(n / cols)
    fig = _fig(max(7.0, 4.6 * cols), 3.4 * rows + 1.4, constrained=True)
    axs = fig.subplots(rows, cols, sharey=True, squeeze=False).ravel()
    for ax, rec in zip(axs, records):
        pts = rec["points"]
        xs = [p["sparsity"] for p in pts]
        for (lo, hi), p in zip(_edges(xs), pts):
            ax.axvspan(lo, hi, color=BAND_COLORS[p["label"]], alpha=0.18, linewidth=0)
        n_seeds = max(p["n_seeds"] for p in pts)
        ax.errorbar(xs, [100 * p["healed_mean"] for p in pts],
                    yerr=[100 * p["healed_std"] for p in pts] if n_seeds > 1 else None,
                    marker="s", capsize=3, color="black",
                    label="healed (mean ± std over seeds)" if n_seeds > 1 else "healed (one seed)")
        lims = [p["chance_limit"] for p in pts if p["chance_limit"] is not None]
        if lims:
            ax.axhline(100 * lims[0], color=BAND_COLORS["collapse"], linestyle=":", linewidth=1,
                       label="chance + 2σ")
        _mark_cts(ax, cts)
        extra = [f"{c}={rec[c]}" for c in ("calib_size", "scope", "granularity") if rec.get(c)]
        ax.set_title(f"{rec['healer']}\n{rec['pruner']}; {', '.join(extra)}", fontsize="small")
        ax.set_xlabel("sparsity (nominal)")
        ax.grid(True, alpha=0.3)
    for ax in axs[len(records):]:
        ax.set_visible(False)
    for r in range(rows):
        axs[r * cols].set_ylabel("healed top-1 (%)")
    handles, labels = axs[0].get_legend_handles_labels()
    for lab, col in BAND_COLORS.items():
        handles.append(Patch(color=col, alpha=0.4))
        labels.append(lab)
    fit_legend(fig, handles, labels, max_cols=4, fontsize="small")
    fig.suptitle(title)
    return fig


def cts_figure(cts: dict, title: str) -> Figure:
    fig = _fig(8.0, 5.4, constrained=True)
    ax = fig.add_subplot()
    s = np.asarray(cts["s"])
    ax.plot(s, cts["G"], color="tab:blue", linewidth=1, label="G(s) = J_RR(ERK) − J_RR(RR)")
    ax.plot(s, cts["CTS"], color="grey", marker=".", linewidth=1, label="CTS(s) = G·T")
    ax.plot(s, cts["CTS_smooth"], color="black", linewidth=2, label="CTS̄ (3-point mean)")
    ax2 = ax.twinx()
    ax2.plot(s, cts["T"], color="tab:purple", linestyle="--", linewidth=1, label="T(s) (right axis)")
    ax2.set_ylim(-0.05, 1.05)
    ax2.set_ylabel("repair stress T(s)")
    for key, col in (("core", "black"), ("band", "navy")):
        iv = cts.get(key)
        if iv:
            ax.axhline(iv["threshold"], color=col, linestyle=":", linewidth=1,
                       label=f"{key} threshold (B = {iv['baseline']:.3g})")
    _mark_cts(ax, cts)
    h1, l1 = ax.get_legend_handles_labels()
    h2, l2 = ax2.get_legend_handles_labels()
    fit_legend(fig, h1 + h2, l1 + l2, max_cols=3, fontsize="x-small")
    ax.set_xlabel("target global sparsity")
    ax.set_ylabel("RR objective gap / score")
    ax.grid(True, alpha=0.3)
    ax.set_title(title)
    return fig


def rr_heatmap(layers: list[str], grid: list[float], r: np.ndarray, title: str) -> Figure:
    """r: (L, K); log colour scale (R > 1 is legal: repair made it worse)."""
    fig = _fig(max(6.0, 0.9 * len(grid) + 4), max(3.0, 0.28 * len(layers) + 1.6))
    ax = fig.add_subplot()
    pos = np.clip(r, 1e-6, None)
    norm = LogNorm(vmin=pos.min(), vmax=max(pos.max(), pos.min() * 1.01))
    im = ax.imshow(pos, aspect="auto", cmap="viridis", norm=norm)
    ax.set_xticks(range(len(grid)), [f"{100 * g:g}" for g in grid])
    ax.set_yticks(range(len(layers)), layers, fontsize="x-small")
    ax.set_xlabel("layer sparsity (%)")
    for i in range(r.shape[0]):
        for j in range(r.shape[1]):
            ax.text(j, i, f"{r[i, j]:.2f}", ha="center", va="center", fontsize=6,
                    color="white" if pos[i, j] < np.sqrt(pos.min() * pos.max()) else "black")
    fig.colorbar(im, ax=ax, label="R = D_repair / D_raw (log)")
    ax.set_title(title)
    fig.tight_layout()
    return fig


def allocation_figure(layers: list[str], rr: dict, erk: dict, target: float, title: str) -> Figure:
    d = np.array([rr[ly] - erk[ly] for ly in layers])  # (L,)
    fig = _fig(8.0, max(3.0, 0.28 * len(layers) + 1.4))
    ax = fig.add_subplot()
    ax.barh(range(len(layers)), 100 * d, color=["tab:red" if x > 0 else "tab:blue" for x in d])
    ax.set_yticks(range(len(layers)), layers, fontsize="x-small")
    ax.invert_yaxis()
    ax.axvline(0, color="black", linewidth=0.8)
    ax.set_xlabel(f"s(RR) − s(ERK), points of sparsity, at target {100 * target:g}%")
    ax.grid(True, axis="x", alpha=0.3)
    ax.set_title(title)
    fig.tight_layout()
    return fig


def healers_figure(panels: list[tuple[str, dict]], title: str) -> Figure:
    """One panel per group: x = healers by mean healed accuracy, one grey line per seed (same mask) through
    its healers, black bar = mean with a ± std whisker; accuracy in %."""
    n = max(1, len(panels))
    cols = min(3, n)
    rows = math.ceil(n / cols)
    fig = _fig(5.2 * cols, 3.9 * rows)
    for k, (name, values) in enumerate(panels):
        ax = fig.add_subplot(rows, cols, k + 1)
        means = {h: float(np.mean(list(v.values()))) for h, v in values.items() if v}
        order = sorted(means, key=lambda h: (-means[h], h))
        for key in sorted({key for v in values.values() for key in v}, key=repr):  # one seed (and mask)
            pts = [(i, 100 * values[h][key]) for i, h in enumerate(order) if key in values[h]]
            ax.plot(*zip(*pts), color="0.6", marker="o", markersize=3.5, linewidth=0.8, zorder=1)
        for i, h in enumerate(order):
            v = 100 * np.asarray(list(values[h].values()))
            std = float(v.std(ddof=1)) if len(v) > 1 else 0.0
            ax.errorbar([i], [v.mean()], yerr=[std], fmt="_", color="black", markersize=18, capsize=4, zorder=2)
        ax.set_xticks(range(len(order)), order, rotation=30, ha="right", fontsize=8)
        ax.set_ylabel("healed top-1 (%)")
        ax.set_title(name, fontsize=9)
        ax.grid(True, axis="y", alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    return fig
