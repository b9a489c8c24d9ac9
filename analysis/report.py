"""Sweep report (HTML + Markdown + PNG figures) built only from what MLflow holds.

Nothing is recomputed: accuracies, retention and achieved sparsity are the logged metrics of the
best trial of each cell (chosen by selection-split accuracy, see ``runs.best_per_cell``).
Figures use ``matplotlib.figure.Figure`` with an Agg canvas, so importing this module changes no
global matplotlib state.
"""

from __future__ import annotations

import base64
import html
import io
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd
from matplotlib import colormaps
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from .figures import healers_figure
from .paired import healer_panels, paired_sections
from .runs import best_per_cell, is_nm, load_sweep_info, load_trials, pattern_sort_key, pattern_sparsity

__all__ = ["write_report", "write_report_from", "model_table", "model_figure", "run_url"]

HOW_TO_READ = (
    "Each grid cell (model x pattern x calibration size x pruner x healer) ran several trials with "
    "different learning rates and epoch counts. The best trial per cell is chosen by its accuracy on "
    "the selection split (ties: shorter healing time), never by evaluation accuracy. Dense, pruned "
    "and healed are top-1 accuracies (%) on the evaluation split: dense = unpruned model, pruned = "
    "after masking and before healing, healed = after healing. Retention = healed / dense. Sparsity "
    "is the achieved fraction of prunable weights that are zero. Trials counts every run of the "
    "cell, failed ones included; failed runs are never selected."
)
HEALERS_HOW = ("How to read this: one panel per pruner × pattern × calibration size; healers sorted by mean "
               "healed accuracy. Each grey line is one seed, i.e. one mask shared by every healer, so parallel "
               "lines mean a consistent (paired) difference and crossing lines mean the order changes with the "
               "seed. Black bars: mean ± std over seeds.")
UNKNOWN_MODEL = "(unknown model)"


# ----------------------------------------------------------------------------- formatting
def _num(x) -> float | None:
    try:
        v = float(x)
    except (TypeError, ValueError):
        return None
    return None if math.isnan(v) else v


def _fmt(x, spec: str, scale: float = 1.0) -> str:
    v = _num(x)
    return "–" if v is None else format(v * scale, spec)


def _fmt_int(x) -> str:
    return "–" if x is None or pd.isna(x) else str(int(x))


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" + ("" if n == 1 else "s")


def _fmt_trials(n: int, k: int) -> str:
    return f"{n} ({k} failed)" if k else str(n)


def run_url(tracking_uri: str, experiment_id, run_id: str) -> str | None:
    """MLflow UI link for http(s) tracking servers, else None."""
    if not re.match(r"^https?://", str(tracking_uri)):
        return None
    return f"{str(tracking_uri).rstrip('/')}/#/experiments/{experiment_id}/runs/{run_id}"


def _safe_name(model: str, taken: set[str]) -> str:
    base = re.sub(r"[^A-Za-z0-9._-]+", "_", model).strip("._") or "model"
    name, i = base, 2
    while name in taken:
        name, i = f"{base}_{i}", i + 1
    taken.add(name)
    return name


# ----------------------------------------------------------------------------- tables
def _sorted_rows(best: pd.DataFrame) -> pd.DataFrame:
    key = best["pattern"].map(pattern_sort_key)
    order = sorted(range(len(best)), key=lambda i: (
        str(best["pruner"].iloc[i]), key.iloc[i],
        _num(best["calib_size"].iloc[i]) if _num(best["calib_size"].iloc[i]) is not None else math.inf,
        str(best["healer"].iloc[i]), str(best["scope"].iloc[i]), str(best["granularity"].iloc[i]),
        str(best["run_id"].iloc[i])))
    return best.iloc[order].reset_index(drop=True)


def _varying(best: pd.DataFrame, col: str) -> bool:
    return best[col].astype("object").fillna("").nunique() > 1


@dataclass
class Table:
    headers: list[str]
    rows: list[list[str]]
    run_ids: list[str] = field(default_factory=list)
    experiment_ids: list[str] = field(default_factory=list)


def model_table(best: pd.DataFrame) -> Table:
    """Formatted rows (last column = run id) for one model's best-per-cell frame."""
    best = _sorted_rows(best)
    extra = [c for c in ("scope", "granularity", "seed") if _varying(best, c)]
    headers = ["pruner", "pattern", "sparsity", "calib size", "dense (%)", "pruned (%)",
               "healed (%)", "retention", "best lr", "epochs", "trials", "healer", *extra,
               "MLflow run"]
    rows = []
    for r in best.itertuples(index=False):
        rows.append([
            str(r.pruner), str(r.pattern), _fmt(r.achieved_sparsity, ".3f"), _fmt_int(r.calib_size),
            _fmt(r.dense_acc, ".2f", 100), _fmt(r.pruned_acc, ".2f", 100),
            _fmt(r.healed_acc, ".2f", 100), _fmt(r.retention, ".3f"), _fmt(r.lr, ".2e"),
            _fmt_int(r.epochs), _fmt_trials(int(r.n_trials), int(r.n_failed)), str(r.healer),
            *(str(getattr(r, c)) for c in extra), str(r.run_id),
        ])
    return Table(headers, rows, [str(x) for x in best["run_id"]],
                 [str(x) for x in best["experiment_id"]])


def _md_cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


_LEFT = {"pruner", "pattern", "healer", "scope", "granularity", "MLflow run"}


def _md_table(t: Table, tracking_uri: str) -> str:
    lines = ["| " + " | ".join(_md_cell(h) for h in t.headers) + " |",
             "|" + "|".join("---" if h in _LEFT else "---:" for h in t.headers) + "|"]
    for row, rid, eid in zip(t.rows, t.run_ids, t.experiment_ids):
        url = run_url(tracking_uri, eid, rid)
        cells = [_md_cell(c) for c in row[:-1]] + [f"[{rid}]({url})" if url else f"`{rid}`"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _html_table(t: Table, tracking_uri: str) -> str:
    e = html.escape
    head = "".join(f"<th>{e(h)}</th>" for h in t.headers)
    cls = ['<td class="l">' if h in _LEFT else "<td>" for h in t.headers]
    body = []
    for row, rid, eid in zip(t.rows, t.run_ids, t.experiment_ids):
        url = run_url(tracking_uri, eid, rid)
        last = f'<a href="{e(url)}">{e(rid)}</a>' if url else f"<code>{e(rid)}</code>"
        body.append("<tr>" + "".join(f"{td}{e(c)}</td>" for td, c in zip(cls, row[:-1]))
                    + f'<td class="l">{last}</td></tr>')
    return f"<table>\n<thead><tr>{head}</tr></thead>\n<tbody>\n" + "\n".join(body) + \
        "\n</tbody>\n</table>"


# ----------------------------------------------------------------------------- figures
def _variant_cols(best: pd.DataFrame, cols: tuple[str, ...]) -> list[str]:
    return [c for c in cols if _varying(best, c)]


def _prefix(row, cols: list[str]) -> str:
    return "/".join(str(row[c]) for c in cols) + " " if cols else ""


def model_figure(best: pd.DataFrame, model: str) -> Figure:
    """Top-1 (%) vs nominal sparsity for one model's best-per-cell rows."""
    fig = Figure(figsize=(7.5, 4.8), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    df = best.assign(_x=best["pattern"].map(pattern_sparsity), _nm=best["pattern"].map(is_nm))
    df = df[df["_x"].notna()]
    dense = df["dense_acc"].dropna()
    if len(dense):
        d = 100 * float(dense.median())
        ax.axhline(d, color="black", linestyle="--", linewidth=1, label=f"dense ({d:.2f}%)")
    heal_cols = _variant_cols(df, ("pruner", "scope", "healer", "granularity"))
    prune_cols = [c for c in heal_cols if c in ("pruner", "scope")]
    calibs = sorted({int(c) for c in df["calib_size"].dropna()})
    cmap = colormaps["tab10"]
    color = {c: cmap(i % 10) for i, c in enumerate(calibs)}
    num, nm = df[~df["_nm"]], df[df["_nm"]]

    # pruned: one line per pruner variant (split by calib size only if the pruned model depends on it)
    for _, g in (num.groupby(prune_cols, dropna=False) if prune_cols else [((), num)]):
        if g.empty:
            continue
        pre = _prefix(g.iloc[0], prune_cols)
        spread = g.groupby("_x")["pruned_acc"].agg(lambda s: s.max() - s.min()).fillna(0)
        parts = [(None, g)] if (spread <= 1e-9).all() else list(g.groupby("calib_size"))
        for n, gg in parts:
            s = gg.groupby("_x")["pruned_acc"].mean().dropna().sort_index()
            lab = f"{pre}pruned" + (f" (n={int(n)})" if n is not None else "")
            ax.plot(s.index, 100 * s.values, marker="o", linestyle=":", color="grey", label=lab)
    # healed: one line per (variant, calib size)
    for _, g in num.groupby([*heal_cols, "calib_size"], dropna=False):
        r0 = g.iloc[0]
        s = g.groupby("_x")["healed_acc"].mean().dropna().sort_index()
        n = r0["calib_size"]
        c = color.get(int(n)) if pd.notna(n) else None
        ax.plot(s.index, 100 * s.values, marker="s", color=c,
                label=f"{_prefix(r0, heal_cols)}healed (n={_fmt_int(n)})")
    # N:M patterns: distinct markers at 1 - N/M
    for (pat, *_), g in nm.groupby(["pattern", *prune_cols], dropna=False):
        r0 = g.iloc[0]
        ax.scatter([r0["_x"]], [100 * g["pruned_acc"].mean()], marker="X", s=70, color="grey",
                   edgecolor="black", zorder=3, label=f"{_prefix(r0, prune_cols)}{pat} pruned")
    for (pat, *_), g in nm.groupby(["pattern", *heal_cols, "calib_size"], dropna=False):
        r0 = g.iloc[0]
        n = r0["calib_size"]
        ax.scatter([r0["_x"]], [100 * g["healed_acc"].mean()], marker="*", s=160,
                   color=color.get(int(n)) if pd.notna(n) else None, edgecolor="black", zorder=3,
                   label=f"{_prefix(r0, heal_cols)}{pat} healed (n={_fmt_int(n)})")
    ax.set_xlabel("sparsity (nominal; N:M at 1 - N/M)")
    ax.set_ylabel("top-1 accuracy, evaluation split (%)")
    ax.set_title(f"{model}: top-1 vs sparsity (best trial per cell)")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize="small", loc="best")
    fig.tight_layout()
    return fig


def _png(fig: Figure) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return buf.getvalue()


# ----------------------------------------------------------------------------- report
_CSS = """body{font-family:system-ui,-apple-system,Segoe UI,Helvetica,Arial,sans-serif;margin:2em;
color:#222;max-width:1400px}table{border-collapse:collapse;margin:1em 0;font-size:.9em}
th,td{border:1px solid #ccc;padding:.3em .6em;text-align:right}th{background:#f2f2f2}
td.l,th{text-align:left}code{font-size:.9em}
img{max-width:100%;border:1px solid #eee}figure{margin:1em 0}
figcaption{color:#555;max-width:75em}.note{color:#555}dl{display:grid;
grid-template-columns:max-content auto;gap:.2em 1em}dt{font-weight:bold}"""


def _summary(trials: pd.DataFrame, name: str, sweep_id: str, tracking_uri: str) -> list[tuple]:
    n_fin = int((trials["status"] == "FINISHED").sum())
    n_fail = int(trials["status"].isin(("FAILED", "KILLED")).sum())
    other = len(trials) - n_fin - n_fail
    text = f"{len(trials)} ({n_fin} finished, {n_fail} failed" + \
        (f", {other} other" if other else "") + ")"
    return [("Sweep", name), ("Sweep id", sweep_id), ("Trials", text),
            ("Cells", str(trials["cell_id"].dropna().nunique())), ("Tracking URI", tracking_uri)]


def write_report_from(tracking_uri: str, sweep_id: str, out_dir: str | Path,
                      experiment: str = "healsweep", title: str | None = None,
                      settings: dict | None = None) -> dict[str, Path]:
    """Write ``out_dir/report.html``, ``report.md``, ``bands.json`` and ``fig_<model>*.png``.

    ``settings``: optional ``{"cts": {...CTSSettings fields}, "bands": {...BandSettings fields}}``.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    trials = load_trials(tracking_uri, sweep_id, experiment)
    info = load_sweep_info(tracking_uri, sweep_id, experiment)
    name = title or info["name"] or sweep_id
    best = best_per_cell(trials)
    model_of = trials["model"].astype("object").fillna(UNKNOWN_MODEL)
    models = sorted(set(model_of))
    summary = _summary(trials, name, sweep_id, tracking_uri)
    trans = _transition_sections(best, models, info, out, tracking_uri, settings or {})

    e = html.escape
    md = [f"# Sweep report: {name}", ""] + [f"- **{k}:** {_md_cell(v)}" for k, v in summary]
    md += ["", "## How to read this", "", HOW_TO_READ, ""]
    ht = [f"<h1>Sweep report: {e(name)}</h1>", "<dl>"] + \
        [f"<dt>{e(k)}</dt><dd>{e(v)}</dd>" for k, v in summary] + \
        ["</dl>", "<h2>How to read this</h2>", f"<p>{e(HOW_TO_READ)}</p>"]
    if not models:
        md.append("_No trial runs found for this sweep._")
        ht.append('<p class="note">No trial runs found for this sweep.</p>')
    taken: set[str] = set()
    for model in models:
        mt = trials[model_of == model]
        mb = best[best["model"].astype("object").fillna(UNKNOWN_MODEL) == model]
        md += ["", f"## {model}", ""]
        ht.append(f"<h2>{e(model)}</h2>")
        if mb.empty:
            msg = f"No finished trials for this model ({_plural(len(mt), 'run')}, none FINISHED)."
            md.append(f"_{msg}_")
            ht.append(f'<p class="note">{e(msg)}</p>')
            continue
        table = model_table(mb)
        md.append(_md_table(table, tracking_uri))
        ht.append(_html_table(table, tracking_uri))
        missing = sorted(set(mt["cell_id"].dropna()) - set(mb["cell_id"]))
        if missing:
            counts = mt.groupby("cell_id")["run_id"].size()
            msg = "Cells without a finished trial: " + ", ".join(
                f"{c} ({_plural(int(counts[c]), 'run')})" for c in missing)
            md += ["", f"_{msg}_"]
            ht.append(f'<p class="note">{e(msg)}</p>')
        fig = model_figure(mb, model)
        png = _png(fig)
        fname = f"fig_{_safe_name(model, taken)}.png"
        (out / fname).write_bytes(png)
        md += ["", f"![{_md_cell(model)}: top-1 vs sparsity]({fname})"]
        ht.append(f'<p><img src="data:image/png;base64,{base64.b64encode(png).decode("ascii")}" '
                  f'alt="{e(model)}: top-1 vs sparsity"></p>')
        paired_md, paired_html = paired_sections(mb)  # healers on identical masks (analysis/paired.py)
        md += paired_md
        ht += paired_html
        panels = healer_panels(mb)
        if panels:  # several seeds: show the noise and the pairing
            png = _png(healers_figure(panels, f"{model}: healers on identical masks"))
            fname = f"fig_{_safe_name(model + '_healers', taken)}.png"
            (out / fname).write_bytes(png)
            md += ["", f"![{_md_cell(model)}: healers on identical masks]({fname})", "", HEALERS_HOW]
            ht.append(f'<figure><img src="data:image/png;base64,{base64.b64encode(png).decode("ascii")}" '
                      f'alt="{e(model)}: healers on identical masks"><figcaption>{e(HEALERS_HOW)}</figcaption></figure>')
        md += trans.md.get(model, [])
        ht += trans.html.get(model, [])

    paths = {"html": out / "report.html", "md": out / "report.md", "bands": out / "bands.json"}
    paths["bands"].write_text(json.dumps(trans.bands_json, indent=1, allow_nan=False), encoding="utf-8")
    paths["md"].write_text("\n".join(md) + "\n", encoding="utf-8")
    page = ["<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">',
            f"<title>Sweep report: {e(name)}</title>", f"<style>{_CSS}</style></head><body>",
            *ht, "</body></html>"]
    paths["html"].write_text("\n".join(page) + "\n", encoding="utf-8")
    return paths


def _transition_sections(best, models, info, out, tracking_uri, settings):
    from .bands import BandSettings
    from .cts import CTSSettings
    from .rr import load_diagnostics, load_lamp
    from .transition_report import build_sections

    cts_kw = dict(settings.get("cts", {}))
    if "targets" in cts_kw:
        cts_kw["targets"] = tuple(float(x) for x in cts_kw["targets"])
    return build_sections(best, [m for m in models if m != UNKNOWN_MODEL],
                          load_diagnostics(tracking_uri, info["run_id"]), out, tracking_uri,
                          lambda eid, rid: run_url(tracking_uri, eid, rid), CTSSettings(**cts_kw),
                          BandSettings(**settings.get("bands", {})), lamp=load_lamp(tracking_uri, info["run_id"]))


def write_report(run_dir: str | Path) -> dict[str, Path]:
    """Report for the sweep described by ``run_dir/sweep.json``, written into ``run_dir``."""
    run_dir = Path(run_dir)
    meta = json.loads((run_dir / "sweep.json").read_text(encoding="utf-8"))
    uri = meta.get("tracking_uri") or f"sqlite:///{(run_dir / 'mlflow.db').resolve()}"
    return write_report_from(uri, meta["sweep_id"], run_dir,
                             experiment=meta.get("experiment") or "healsweep",
                             title=meta.get("name"), settings=meta.get("analysis"))
