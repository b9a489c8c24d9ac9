"""Top-1 vs sparsity for one model and ONE grid (grids are never drawn together).

One panel per pruner (× scope when it varies), all panels on one shared y scale. Colour = healer, marker =
calibration size, solid line = healed (seed mean of the quoted number: the winner re-evaluated), grey dotted = pruned before
healing, black dashed = dense. N:M patterns sit at 1 − N/M as unconnected, black-edged markers. The legend is
outside the axes, below them, in a constrained layout (nothing clipped, the axes keep the canvas).
"""
from __future__ import annotations

import math

import pandas as pd
from matplotlib import colormaps
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.lines import Line2D

from .layout import fit_legend
from .runs import is_nm, pattern_sparsity

__all__ = ["model_figure", "healer_colors", "MARKERS"]

MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*")


def healer_colors(healers) -> dict[str, tuple]:
    """One colour per healer, stable across figures (sorted names on tab10)."""
    cmap = colormaps["tab10"]
    return {h: cmap(i % 10) for i, h in enumerate(sorted(set(map(str, healers))))}


def _panel_key(df: pd.DataFrame) -> pd.Series:
    vary = df["scope"].astype("object").nunique() > 1
    return df["pruner"].astype(str) + (" / " + df["scope"].astype(str) if vary else "")


def _curve(g: pd.DataFrame, col: str) -> pd.Series:
    return (100 * g.groupby("_x")[col].mean()).dropna().sort_index()


def _draw_panel(ax, g: pd.DataFrame, colors: dict, marker: dict) -> None:
    num, nm = g[~g["_nm"]], g[g["_nm"]]
    for n, gg in num.groupby("calib_size", dropna=False):
        s = _curve(gg, "pruned_acc")
        ax.plot(s.index, s.values, linestyle=":", color="0.5", marker=marker.get(n, "o"), markersize=4,
                markerfacecolor="none")
    for (h, n), gg in num.groupby(["healer", "calib_size"], dropna=False):
        s = _curve(gg, "healed_acc")
        ax.plot(s.index, s.values, color=colors[str(h)], marker=marker.get(n, "o"), markersize=5, linewidth=1.4,
                label=f"{h} n={n}")
    for (h, n, _), gg in nm.groupby(["healer", "calib_size", "pattern"], dropna=False):
        ax.scatter(gg["_x"].iloc[:1], [100 * gg["healed_acc"].mean()], s=80, color=colors[str(h)],
                   marker=marker.get(n, "o"), edgecolor="black", linewidth=1.2, zorder=3)
        ax.annotate(str(gg["pattern"].iloc[0]), (float(gg["_x"].iloc[0]), 100 * gg["healed_acc"].mean()),
                    textcoords="offset points", xytext=(5, 4), fontsize=7)
    dense = g["dense_acc"].dropna()
    if len(dense):
        ax.axhline(100 * float(dense.median()), color="black", linestyle="--", linewidth=1)
    ax.grid(True, alpha=0.3)


def _legend_handles(colors: dict, marker: dict, has_nm: bool, dense: float | None) -> list:
    hs = [Line2D([], [], color=c, linewidth=2, label=h) for h, c in colors.items()]
    hs += [Line2D([], [], color="0.3", marker=m, linestyle="none", label=f"calib {n} images")
           for n, m in marker.items()]
    hs.append(Line2D([], [], color="0.5", linestyle=":", marker="o", markerfacecolor="none",
                     label="pruned (before healing)"))
    if dense is not None:
        hs.append(Line2D([], [], color="black", linestyle="--", label=f"dense ({dense:.2f} %)"))
    if has_nm:
        hs.append(Line2D([], [], color="0.6", marker="o", markeredgecolor="black", linestyle="none",
                         label="N:M pattern (at 1 − N/M)"))
    return hs


def model_figure(best: pd.DataFrame, model: str, grid: str = "main", colors: dict | None = None) -> Figure:
    """Figure for one model's best-per-cell rows of one grid. ``colors``: healer -> colour (shared report-wide)."""
    df = best.assign(_x=best["pattern"].map(pattern_sparsity), _nm=best["pattern"].map(is_nm))
    df = df[df["_x"].notna()]
    df = df.assign(_panel=_panel_key(df))
    panels = sorted(df["_panel"].unique())
    cols = min(3, max(1, len(panels)))
    rows = math.ceil(max(1, len(panels)) / cols)
    fig = Figure(figsize=(max(7.0, 4.4 * cols), 3.4 * rows + 1.4), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    colors = colors or healer_colors(df["healer"])
    calibs = sorted({int(n) for n in df["calib_size"].dropna()})
    marker = {n: MARKERS[i % len(MARKERS)] for i, n in enumerate(calibs)}
    axs = fig.subplots(rows, cols, sharey=True, squeeze=False).ravel()
    for ax, p in zip(axs, panels):
        _draw_panel(ax, df[df["_panel"] == p], colors, marker)
        ax.set_title(p, fontsize="medium")
        ax.set_xlabel("sparsity (nominal)")
    for ax in axs[len(panels):]:
        ax.set_visible(False)
    for r in range(rows):
        axs[r * cols].set_ylabel("top-1, evaluation split (%)")
    dense = df["dense_acc"].dropna()
    used = {h: c for h, c in colors.items() if h in set(df["healer"].astype(str))}
    handles = _legend_handles(used, marker, bool(df["_nm"].any()), 100 * float(dense.median()) if len(dense) else None)
    fit_legend(fig, handles, [h.get_label() for h in handles], fontsize="small")
    fig.suptitle(f"{model} — grid {grid}: top-1 vs sparsity (quoted numbers, seed mean)")
    return fig
