"""Transition-band sections of the report: CTS (calibration only), RR heat map, RR vs ERK allocation,
repairability bands with multi-seed statistics, and ``bands.json`` (the paired healer table is analysis/paired.py).

Built from MLflow alone: trial metrics (``runs.best_per_cell``) and the parent run's diagnostics
artifacts. Missing pieces (no diagnostics, no allocation module) become a one-line note, not an error.
"""
from __future__ import annotations

import base64
import html
import math
import re
from dataclasses import dataclass, field

import pandas as pd
from matplotlib.figure import Figure

from .bands import BandSettings, bands
from .cts import CTSSettings
from .layout import save_png
from .figures import allocation_figure, bands_figure, cts_figure, rr_heatmap
from .runs import grid_order

__all__ = ["Sections", "build_sections", "HOW_TO_READ", "json_clean"]

HOW_TO_READ = {
    "bands": "Healed top-1 accuracy (mean ± std over seeds of the quoted number per cell) against nominal "
             "sparsity, one panel per healer. Shading is the repairability band of each point: green = "
             "recoverable (retention ≥ {ret:g}), orange = transition, red = collapse (healed accuracy within "
             "{z:g} binomial standard errors of chance, given the evaluation set size). The hatched box is the "
             "calibration-only CTS core, the dashed box the broad CTS band: they were computed before, and "
             "without, any accuracy. Agreement = IoU of the CTS interval with the accuracy transition hull.",
    "cts": "Calibration transition score from RR diagnostics only. G(s) is how much more repair-resistant "
           "damage (mean R over layers) ERK's allocation places than the RR allocation; T(s) is the normalised "
           "repair stress between the anchors s_low = {s_low:g} and s_high = {s_high:g}; CTS = G·T, and CTS̄ is "
           "its 3-point moving average. The core (α = {a_core:g}) and band (α = {a_band:g}) are the longest runs "
           "above B + α(max CTS̄ − B), B = the largest CTS̄ at targets ≤ s_low. Expect the core where "
           "repair-aware allocation matters most, not an accuracy prediction.",
    "rr": "Relative repairability R_ℓ(s) = D_repair / D_raw of each layer pruned alone to s (all else dense), "
          "on the candidate grid. Small R: repair (CR+BN) removes most of the damage; R near or above 1: the "
          "damage resists repair. Greedy RR allocation prunes low-R layers harder.",
    "alloc": "Per-layer sparsity of the RR allocation minus ERK's at target {t:g}% (diagnostics have no seed "
             "dimension, so no error bars). Positive: RR prunes the layer harder than ERK; negative: RR "
             "protects it. LAMP is not shown: it needs the weights, which the analysis never loads.",
    "table": "Seed statistics per point: healed accuracy and retention as mean ± sample std over seeds, each seed's "
             "number the one the report quotes (its cell's winner by the sweep's search objective, re-healed on "
             "fresh seeds when search.reevaluate > 0: their mean). Run links open each seed's MLflow run.",
}


@dataclass
class Sections:
    md: dict[str, list[str]] = field(default_factory=dict)
    html: dict[str, list[str]] = field(default_factory=dict)
    bands_json: dict = field(default_factory=dict)


def json_clean(x):
    """JSON-safe copy: NaN/inf -> None, numpy scalars -> Python numbers, tuples -> lists."""
    if isinstance(x, dict):
        return {str(k): json_clean(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [json_clean(v) for v in x]
    if hasattr(x, "item") and not isinstance(x, (str, bytes)):
        x = x.item()
    if isinstance(x, float) and not math.isfinite(x):
        return None
    return x


def _safe(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", text).strip("._") or "x"


def _pm(m: float, s: float, scale: float = 100.0, spec: str = ".2f") -> str:
    return f"{format(m * scale, spec)} ± {format(s * scale, spec)}"


class _Writer:
    def __init__(self, out_dir, model: str, md: list[str], ht: list[str]) -> None:
        self.out, self.model, self.md, self.ht = out_dir, model, md, ht

    def heading(self, text: str) -> None:
        self.md += ["", f"### {text}", ""]
        self.ht.append(f"<h3>{html.escape(text)}</h3>")

    def note(self, text: str) -> None:
        self.md += [f"_{text}_", ""]
        self.ht.append(f'<p class="note">{html.escape(text)}</p>')

    def figure(self, fig: Figure, stem: str, alt: str, how: str) -> None:
        name = f"fig_{_safe(self.model)}_{stem}.png"
        b64 = base64.b64encode(save_png(fig, self.out / name)).decode("ascii")
        self.md += [f"![{alt}]({name})", "", f"**How to read this.** {how}", ""]
        self.ht.append(f'<figure><img src="data:image/png;base64,{b64}" alt="{html.escape(alt)}">'
                       f'<figcaption><b>How to read this.</b> {html.escape(how)}</figcaption></figure>')


def _points_table(w: _Writer, recs: list[dict], url_of) -> None:
    heads = ["healer", "pruner", "calib size", "sparsity", "healed (%) mean ± std", "retention mean ± std",
             "seeds", "band", "MLflow runs"]
    w.md += ["| " + " | ".join(heads) + " |", "|" + "|".join(["---"] * len(heads)) + "|"]
    rows = ["<table><thead><tr>" + "".join(f"<th>{html.escape(h)}</th>" for h in heads) + "</tr></thead><tbody>"]
    for rec in recs:
        for p in rec["points"]:
            one = p["n_seeds"] == 1  # one seed: the value alone, no "± 0.00"
            cells = [rec["healer"], rec["pruner"], rec["calib_size"], f"{p['sparsity']:g}",
                     f"{100 * p['healed_mean']:.2f}" if one else _pm(p["healed_mean"], p["healed_std"]),
                     f"{p['retention_mean']:.3f}" if one else _pm(p["retention_mean"], p["retention_std"], 1, ".3f"),
                     "1 (no spread)" if one else str(p["n_seeds"]), p["label"]]
            urls = [(rid, url_of(p["experiment_id"], rid)) for rid in p["run_ids"]]
            w.md.append("| " + " | ".join(cells) + " | " + ", ".join(
                f"[{rid[:8]}]({u})" if u else f"`{rid}`" for rid, u in urls) + " |")
            links = ", ".join(f'<a href="{html.escape(u)}">{html.escape(rid[:8])}</a>' if u
                              else f"<code>{html.escape(rid)}</code>" for rid, u in urls)
            rows.append("<tr>" + "".join(f'<td class="l">{html.escape(c)}</td>' for c in cells)
                        + f'<td class="l">{links}</td></tr>')
    rows.append("</tbody></table>")
    w.md.append("")
    w.ht.append("\n".join(rows))


def _agreement_lines(recs: list[dict]) -> list[str]:
    out = []
    for r in recs:
        a, t = r["agreement"], r["transition"]
        hull = f"{100 * t['lo']:.1f}–{100 * t['hi']:.1f}%" if t else "none"
        iou = {k: "n/a (no CTS interval)" if a[k] is None else f"{a[k]:.2f}" for k in ("core_iou", "band_iou")}
        out.append(f"{r['healer']} ({r['pruner']}, calib {r['calib_size']}): accuracy transition {hull}; "
                   f"IoU with CTS core {iou['core_iou']}, with CTS band {iou['band_iou']}")
    return out


def _jrr_section(w: _Writer, curves, lamp: dict, targets) -> list[dict]:
    """Mean repairability J_RR of the RR, ERK and LAMP allocations at a few targets
    (docs/methods.md#calibration-transition-score-and-bands)."""
    from .rr import jrr_table

    rows = jrr_table(curves, lamp, targets)
    w.heading("J_RR of the allocations (mean R over layers at the allocated sparsities; lower = more repairable)")
    cols = ["RR", "ERK", "LAMP"]
    w.md += ["| target | " + " | ".join(cols) + " |", "|---:|" + "---:|" * len(cols)]
    w.md += ["| " + f"{100 * r['target']:g}%" + " | " + " | ".join(f"{r[c]:.3f}" if c in r else "–" for c in cols)
             + " |" for r in rows] + [""]
    cells = "".join(f"<th>{c}</th>" for c in cols)
    body = "".join("<tr><td>" + f"{100 * r['target']:g}%</td>" + "".join(
        f"<td>{r[c]:.3f}</td>" if c in r else "<td>–</td>" for c in cols) + "</tr>" for r in rows)
    w.ht.append(f"<table><tr><th>target</th>{cells}</tr>{body}</table>")
    if not lamp:
        w.note("LAMP: no diagnostics/<model>.lamp.json on the parent run (a sweep before LAMP logging, or the file "
               "was deleted).")
    return rows


def _cts_for(model: str, diags: dict, cts_st: CTSSettings, w: _Writer, lamp: dict | None = None,
             logged: bool = False) -> dict | None:
    from .rr import allocations, curves_from_frame, model_cts

    if model not in diags:
        w.note(f"RR diagnostics were logged for this model (parent-run tag diagnostics_key.{model}) but "
               f"diagnostics/{model}.parquet is missing from the parent run's artifacts or could not be read (deleted, "
               "not copied with the run directory, or an artifact store out of reach), so there is no calibration "
               "transition score." if logged else
               "No RR diagnostics were logged for this model (diagnostics/<model>.parquet on the parent run), "
               "so there is no calibration transition score.")
        return None
    try:
        curves = curves_from_frame(diags[model])
        cts = model_cts(curves, cts_st)
        target = round((cts["core"]["lo"] + cts["core"]["hi"]) / 2, 4) if cts["core"] else 0.95
        target = min(max(target, curves.grid[0]), curves.grid[-1])
        al = allocations(curves, target)
    except ValueError as e:  # bad diagnostics, infeasible target
        w.note(f"CTS unavailable: {e}.")
        return None
    core = cts["core"]
    w.heading("Calibration transition score (calibration data only)")
    none = "none (CTS̄ never rises above its low-sparsity baseline B)"
    w.note("CTS core: " + (f"{100 * core['lo']:.1f}–{100 * core['hi']:.1f}%" if core else none)
           + "; broad band: " + (f"{100 * cts['band']['lo']:.1f}–{100 * cts['band']['hi']:.1f}%"
                                 if cts["band"] else "none"))
    w.figure(cts_figure(cts, f"{model}: calibration transition score"), "cts", f"{model}: CTS",
             HOW_TO_READ["cts"].format(s_low=cts_st.s_low, s_high=cts_st.s_high, a_core=cts_st.alpha_core,
                                       a_band=cts_st.alpha_band))
    w.heading("Per-layer relative repairability")
    w.figure(rr_heatmap(curves.layers, curves.grid, curves.r, f"{model}: R_ℓ(s)"), "rr", f"{model}: RR heat map",
             HOW_TO_READ["rr"])
    w.heading(f"Allocation: RR vs ERK at {100 * target:g}%")
    w.figure(allocation_figure(curves.layers, al["RR"], al["ERK"], target, f"{model}: RR − ERK sparsity"),
             "alloc", f"{model}: RR vs ERK allocation", HOW_TO_READ["alloc"].format(t=100 * target))
    cts["allocation"] = {"target": target, **al}
    lamp = lamp or {}
    near = min(lamp, key=lambda x: abs(x - target), default=None)
    if near is not None and abs(near - target) < 1e-9:
        cts["allocation"]["LAMP"] = lamp[near]
    # At the candidate grid's last value every allocation is forced to that value in every layer (and LAMP's
    # layers are clamped to it), so J_RR there measures the grid's end, not the allocator: not reported.
    targets = [t for t in (0.9, 0.925, 0.95, 0.975) if curves.grid[0] <= t < curves.grid[-1] - 1e-12]
    cts["j_rr"] = _jrr_section(w, curves, lamp, targets)
    w.note(f"J_RR is not reported at or above {100 * curves.grid[-1]:g}%, the candidate grid's last value: there "
           "every allocation is forced to the grid's end in every layer, so the numbers would rank the grid, "
           "not the allocators.")
    return cts


def build_sections(best: pd.DataFrame, models: list[str], diags: dict[str, pd.DataFrame], out_dir,
                   tracking_uri: str, url_of, cts_st: CTSSettings = CTSSettings(),
                   band_st: BandSettings = BandSettings(), lamp: dict | None = None,
                   logged: set[str] = frozenset()) -> Sections:
    """``logged``: models whose diagnostics the parent run's tags say were logged (analysis/runs.load_sweep_info's ``diagnostics``)."""
    sec = Sections(bands_json={"settings": json_clean({"cts": cts_st.to_dict(), "bands": band_st.to_dict()}),
                               "models": {}})
    for model in models:
        md, ht = [], []
        w = _Writer(out_dir, model, md, ht)
        cts = _cts_for(model, diags, cts_st, w, (lamp or {}).get(model), model in logged)
        mb = best[best["model"].astype("object") == model]
        recs = bands(mb, {model: cts} if cts else None, band_st) if not mb.empty else []
        # grids are never mixed in one figure or table (a healer comparison beside the main grid)
        for grid in grid_order(r.get("grid") or "main" for r in recs):
            gr = [r for r in recs if (r.get("grid") or "main") == grid]
            named, stem = (f" (grid {grid})", f"{_safe(grid)}_") if grid != "main" else ("", "")
            for pruner in sorted({r["pruner"] for r in gr}):
                pr = [r for r in gr if r["pruner"] == pruner]
                w.heading(f"Repairability bands: {pruner}{named}")
                w.figure(bands_figure(pr, f"{model} / {pruner}{named}: healed accuracy and bands", cts),
                         f"bands_{stem}{_safe(pruner)}", f"{model} {pruner}{named}: bands",
                         HOW_TO_READ["bands"].format(ret=band_st.retention, z=band_st.z))
                for line in _agreement_lines(pr):
                    w.note(line)
            w.heading(f"Seed statistics per healer{named}")
            w.note(HOW_TO_READ["table"])
            _points_table(w, gr, url_of)
        sec.md[model], sec.html[model] = md, ht
        sec.bands_json["models"][model] = json_clean({
            "cts": None if cts is None else {k: v for k, v in cts.items() if k != "settings"},
            "bands": recs})
    return sec
