"""Sweep report (HTML + Markdown + PNG figures) built only from what MLflow holds.

Nothing is recomputed: accuracies, retention and achieved sparsity are the logged metrics of the
best trial of each cell (chosen by the sweep's search objective: selection-split accuracy, or the label-free
heldout_align; see ``runs.best_per_cell``).
Figures use ``matplotlib.figure.Figure`` with an Agg canvas, so importing this module changes no
global matplotlib state.
"""

from __future__ import annotations

import base64
import html
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd

from tasks.atomic import atomic_write_text

from .accuracy_figure import healer_colors, model_figure
from .figures import healers_figure
from .findings import common_failure
from .findings_render import findings_html, findings_md
from .layout import save_png
from .paired import healer_panels, paired_sections
from .report_style import REPORT_CSS
from .report_sweep import UNKNOWN_MODEL, SweepResults, all_findings, findings_how, load_sweep
from .runs import grid_names, grid_order, pattern_sort_key
from .search_space import search_bounds, widened_cells
from .search_stops import search_stops, stop_table
from .sweep_state import state_note

__all__ = ["write_report", "write_report_from", "model_table", "model_figure", "run_url"]

HOW_TO_READ = (
    "Each grid cell (model x pattern x calibration size x pruner x healer) ran several trials with "
    "different learning rates and epoch (or optimizer step) counts. The best trial per cell is chosen by the "
    "sweep's search objective: its accuracy on the selection split, or with objective heldout_align the lowest "
    "alignment loss on held-out calibration images (no labels); ties: fewer steps/epochs, then the lower Optuna "
    "trial number. Never by evaluation accuracy. Its configuration (with search.converge: the centre of the cell's "
    "best plateau of ties, which need not be its best draw) is then healed again on fresh healing seeds "
    "(search.reevaluate) and the healed accuracy shown is their mean ('± sd' their spread; 'winner' the trial's "
    "own draw, which is biased upwards). Dense, pruned "
    "and healed are top-1 accuracies (%) on the evaluation split: dense = unpruned model, pruned = "
    "after masking and before healing, healed = after healing. Retention = healed / dense. Sparsity "
    "is the achieved fraction of prunable weights that are zero. Trials counts the cell's search runs, "
    "failed ones included (its re-evaluations are the n of the mean); failed runs are never selected. "
    "Closed-form healers (CR+BN, none) have no learning rate or epochs: their rows read 'closed form'. With "
    "search.calib_draws, a closed-form cell whose healer or mask reads the calibration images (CR+BN, CORP; RR, "
    "SnapViT, CORP masks) is healed on the sweep's "
    "draw of them and once on each other draw: its healed accuracy is the mean over all of them (n counts every "
    "draw; 'winner' is the sweep's draw, not biased: nothing was picked)."
)
HEALERS_HOW = ("How to read this: one panel per pruner × pattern × calibration size; healers sorted by mean "
               "healed accuracy. Each grey line is one seed, i.e. one mask shared by every healer, so parallel "
               "lines mean a consistent (paired) difference and crossing lines mean the order changes with the "
               "seed. Black bars: mean ± std over seeds.")


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
    rows: list[list[str]]  # the text cells: every header but the last ``len(links[i])``
    run_ids: list[str] = field(default_factory=list)
    experiment_ids: list[str] = field(default_factory=list)
    links: list[list[list[str]]] = field(default_factory=list)  # per row, per run column: its run ids


RUNS_OF_MEAN = "runs of healed (%)"  # the runs whose mean the healed column quotes (healsweep export takes any)


def model_table(best: pd.DataFrame) -> Table:
    """Formatted rows for one model's best-per-cell frame; the run columns (the winner's run; with re-evaluated
    winners, the runs of the quoted mean) are ``links``."""
    best = _sorted_rows(best)
    extra = [c for c in ("scope", "granularity", "seed") if _varying(best, c)]
    steps = "steps" in best.columns and bool(best["steps"].notna().any())  # a steps-based search
    again = "n_reevaluated" in best.columns and bool((best["n_reevaluated"] > 0).any())  # re-evaluated winners
    headers = ["pruner", "pattern", "sparsity", "calib size", "dense (%)", "pruned (%)",
               "healed (%)", "retention", "best lr", *(["steps"] if steps else []), "epochs", "trials", "healer",
               *(["winner's own draw (%)"] if again else []), *extra,
               "MLflow run", *([RUNS_OF_MEAN] if again else [])]
    rows, links = [], []
    for r in best.itertuples(index=False):
        fixed = _num(r.lr) == 0.0 and (_num(r.epochs) or 0) == 0
        rows.append([
            str(r.pruner), str(r.pattern), _fmt(r.achieved_sparsity, ".3f"), _fmt_int(r.calib_size),
            _fmt(r.dense_acc, ".2f", 100), _fmt(r.pruned_acc, ".2f", 100),
            _healed(r), _fmt(r.retention, ".3f"),
            "closed form" if fixed else _fmt(r.lr, ".2e"),
            *([_fmt_int(r.steps) if not fixed and pd.notna(r.steps) else "–"] if steps else []),
            "–" if fixed else _fmt_int(r.epochs),
            _fmt_trials(int(r.n_trials), int(r.n_failed)), str(r.healer),
            *([_fmt(r.healed_acc_search, ".2f", 100) if r.n_reevaluated else "–"] if again else []),
            *(str(getattr(r, c)) for c in extra),
        ])
        quoted = str(getattr(r, "quoted_run_ids", "") or r.run_id).split(";")
        links.append([[str(r.run_id)], *([quoted] if again else [])])
    return Table(headers, rows, [str(x) for x in best["run_id"]],
                 [str(x) for x in best["experiment_id"]], links)


def _healed(r) -> str:
    """The quoted healed accuracy: the re-evaluations' mean ± their std (n), or the winner's own when none."""
    n = int(getattr(r, "n_reevaluated", 0) or 0)
    if n == 0:
        return _fmt(r.healed_acc, ".2f", 100)
    sd = _num(getattr(r, "healed_acc_sd", None))
    return f"{_fmt(r.healed_acc, '.2f', 100)} ± {_fmt(sd, '.2f', 100)} (n={n})" if sd is not None else \
        f"{_fmt(r.healed_acc, '.2f', 100)} (n={n})"


def _md_cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


_LEFT = {"pruner", "pattern", "healer", "scope", "granularity", "MLflow run", RUNS_OF_MEAN}


def _md_table(t: Table, tracking_uri: str) -> str:
    lines = ["| " + " | ".join(_md_cell(h) for h in t.headers) + " |",
             "|" + "|".join("---" if h in _LEFT else "---:" for h in t.headers) + "|"]
    for row, cols, eid in zip(t.rows, t.links, t.experiment_ids):
        runs = [", ".join(f"[{rid}]({url})" if (url := run_url(tracking_uri, eid, rid)) else f"`{rid}`"
                          for rid in ids) for ids in cols]
        lines.append("| " + " | ".join([_md_cell(c) for c in row] + runs) + " |")
    return "\n".join(lines)


def _html_table(t: Table, tracking_uri: str) -> str:
    e = html.escape
    head = "".join(f"<th>{e(h)}</th>" for h in t.headers)
    cls = ['<td class="l">' if h in _LEFT else "<td>" for h in t.headers]
    body = []
    for row, cols, eid in zip(t.rows, t.links, t.experiment_ids):
        runs = ["<br>".join(f'<a href="{e(url)}">{e(rid)}</a>' if (url := run_url(tracking_uri, eid, rid))
                            else f"<code>{e(rid)}</code>" for rid in ids) for ids in cols]
        body.append("<tr>" + "".join(f"{td}{e(c)}</td>" for td, c in zip(cls, row))
                    + "".join(f'<td class="l">{c}</td>' for c in runs) + "</tr>")
    return f"<table>\n<thead><tr>{head}</tr></thead>\n<tbody>\n" + "\n".join(body) + \
        "\n</tbody>\n</table>"


# ----------------------------------------------------------------------------- report


def _summary(trials: pd.DataFrame, name: str, sweep_id: str, tracking_uri: str, calib_seed: int = 0) -> list[tuple]:
    n_fin = int((trials["status"] == "FINISHED").sum())
    n_fail = int(trials["status"].isin(("FAILED", "KILLED")).sum())
    other = len(trials) - n_fin - n_fail
    text = f"{len(trials)} ({n_fin} finished, {n_fail} failed" + \
        (f", {other} unfinished" if other else "") + ")"  # RUNNING or SCHEDULED: an interrupted sweep's
    draw = [("Calibration draw", f"calib_seed {calib_seed}")] if calib_seed else []  # 0: the data seed's order
    return [("Sweep", name), ("Sweep id", sweep_id), ("Trials", text),
            ("Cells", str(trials["cell_id"].dropna().nunique())), *draw, ("Tracking URI", tracking_uri)]


def _grid_sections(mb, mt, model, grid, taken, out, tracking_uri, colors):
    """(md, html) of one model × grid: the best-per-cell table, missing cells, the figure."""
    e = html.escape
    md, ht = ["", f"### {model}: grid `{grid}`", ""], [f"<h3>{e(model)}: grid {e(grid)}</h3>"]
    table = model_table(mb)
    md.append(_md_table(table, tracking_uri))
    ht.append(_html_table(table, tracking_uri))
    missing = sorted(set(mt["cell_id"].dropna()) - set(mb["cell_id"]))
    if missing:
        counts = mt.groupby("cell_id")["run_id"].size()
        msg = "Cells without a finished trial: " + ", ".join(
            f"{c} ({_plural(int(counts[c]), 'run')})" for c in missing) + "." + common_failure(mt, missing)
        md += ["", f"_{msg}_"]
        ht.append(f'<p class="note">{e(msg)}</p>')
    heads, rows = stop_table(mb)
    if rows:  # search.converge: why each cell's search stopped
        md += ["", "Why each cell's search stopped (search.converge):", "", "| " + " | ".join(heads) + " |",
               "|" + "---|" * len(heads), *("| " + " | ".join(_md_cell(c) for c in r) + " |" for r in rows)]
        ht.append("<details><summary>Why each cell's search stopped (search.converge)</summary><table><thead><tr>"
                  + "".join(f"<th>{e(h)}</th>" for h in heads) + "</tr></thead><tbody>"
                  + "".join("<tr>" + "".join(f"<td>{e(c)}</td>" for c in r) + "</tr>" for r in rows)
                  + "</tbody></table></details>")
    suffix = "" if grid == "main" else f"_{grid}"
    fname = f"fig_{_safe_name(model + suffix, taken)}.png"
    png = save_png(model_figure(mb, model, grid, colors), out / fname)
    alt = f"{model}: top-1 vs sparsity" + ("" if grid == "main" else f" (grid {grid})")
    md += ["", f"![{_md_cell(alt)}]({fname})"]
    ht.append(f'<p><img src="data:image/png;base64,{base64.b64encode(png).decode("ascii")}" alt="{e(alt)}"></p>')
    paired_md, paired_html = paired_sections(mb)  # healers on identical masks (analysis/paired.py)
    md += paired_md
    ht += paired_html
    panels = healer_panels(mb)
    if panels:  # several seeds: show the noise and the pairing
        fname = f"fig_{_safe_name(model + suffix + '_healers', taken)}.png"
        png = save_png(healers_figure(panels, f"{model} ({grid}): healers on identical masks"), out / fname)
        md += ["", f"![{_md_cell(model)}: healers on identical masks]({fname})", "", HEALERS_HOW]
        ht.append(f'<figure><img src="data:image/png;base64,{base64.b64encode(png).decode("ascii")}" '
                  f'alt="{e(model)}: healers on identical masks"><figcaption>{e(HEALERS_HOW)}</figcaption></figure>')
    return md, ht


def write_report_from(tracking_uri: str, sweep_id: str, out_dir: str | Path,
                      experiment: str = "healsweep", title: str | None = None,
                      settings: dict | None = None, search: dict | None = None,
                      widened: dict | None = None, stops: dict | None = None,
                      parent_run_id: str | None = None, driver: str | None = None) -> dict[str, Path]:
    """Write ``out_dir/report.html``, ``report.md``, ``bands.json`` and ``fig_<model>*.png`` (+ layout sidecars).

    ``settings``: optional ``{"cts": {...CTSSettings fields}, "bands": {...BandSettings fields}}``.
    ``search``: optional ``{grid: {"lr": [lo, hi], "epochs": [lo, hi]}}``: the search space of each grid, to flag
    winners on its boundary (``findings.boundary``; also tagged ``search_boundary`` on the winning MLflow run).
    ``widened``: cell id -> the search box of its last widening round (orchestrator/lifecycle/widen.py; ``widened_cells``
    reads them from sweep.json): those cells' boundary is that box, and the findings name them.
    ``stops``: cell id -> why its search stopped (``search_stops.search_stops``: ``search.converge``).
    ``parent_run_id``: the sweep's parent run (sweep.json's; ``load_sweep_info``). ``driver``: what holds the run
    directory, for a sweep whose parent run is RUNNING (``sweep_state.state_note``; None: not looked at).
    Each cell's winner is picked by the sweep's search objective (the parent run's ``objective`` param).
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    sw = load_sweep(tracking_uri, sweep_id, experiment, title, parent_run_id, search, widened, stops)
    summary = _summary(sw.trials, sw.name, sweep_id, tracking_uri, sw.info.get("calib_seed") or 0)
    trans = _transition_sections(sw.best, sw.models, sw.info, out, tracking_uri, settings or {})
    fs = all_findings(sw, trans.bands_json, widened, search)
    partial = state_note(sw.info, int((sw.trials["status"] == "FINISHED").sum()), out.resolve(), driver)
    md, ht = _page_head(sw.name, summary, partial, fs, findings_how(sw.best, settings))
    dmd, dht = _details(sw, trans, out, tracking_uri)
    return _write_pages(out, sw.name, md + dmd, ht + dht, trans.bands_json)


def _page_head(name: str, summary: list[tuple], partial: str | None, fs: list, how: str) -> tuple[list[str], list[str]]:
    """The page above the details (markdown lines, html parts): title, the partial-sweep warning, the summary
    line, the findings."""
    e = html.escape
    line = " · ".join(f"{k}: {v}" for k, v in summary)
    md = [f"# Sweep report: {name}", "", *([f"**{partial}**", ""] if partial else []), _md_cell(line), "",
          *findings_md(fs, how)]
    ht = [f"<h1>Sweep report: {e(name)}</h1>", *([f'<p class="partial">{e(partial)}</p>'] if partial else []),
          f'<p class="sum">{e(line)}</p>', *findings_html(fs, how)]
    return md, ht


def _details(sw: SweepResults, trans, out: Path, tracking_uri: str) -> tuple[list[str], list[str]]:
    """The collapsed details (markdown lines, html parts): how to read them, then each model's tables and
    figures followed by its CTS and RR sections."""
    md = ["## Details", "", "### How to read this", "", HOW_TO_READ, ""]
    ht = ["<details><summary>Details: per-cell tables, figures, CTS and RR diagnostics</summary>",
          "<h2>How to read this</h2>", f"<p>{html.escape(HOW_TO_READ)}</p>"]
    if not sw.models:
        md.append("_No trial runs found for this sweep._")
        ht.append('<p class="note">No trial runs found for this sweep.</p>')
    taken: set[str] = set()
    colors = healer_colors(sw.best["healer"].dropna())
    for model in sw.models:
        mmd, mht = _model_details(model, sw.trials[sw.model_of == model], sw.best_of(model), taken, out,
                                  tracking_uri, colors)
        md += mmd + trans.md.get(model, [])
        ht += mht + trans.html.get(model, [])
    return md, ht + ["</details>"]


def _model_details(model: str, mt: pd.DataFrame, mb: pd.DataFrame, taken: set[str], out: Path,
                   tracking_uri: str, colors: dict) -> tuple[list[str], list[str]]:
    """The collapsed details of one model: its per-grid tables and figures (markdown lines, html parts)."""
    e = html.escape
    md, ht = ["", f"## {model}", ""], [f"<h2>{e(model)}</h2>"]
    digests = sorted(set(mt["model_digest"].dropna())) if "model_digest" in mt else []
    if digests:  # the weights the trials loaded (sha256 of the file, 16 hex): the model's identity
        note = f"Weights sha256 {', '.join(digests)}."
        md, ht = md + [f"_{note}_", ""], ht + [f'<p class="note">{e(note)}</p>']
    if mb.empty:
        msg = f"No finished trials for this model ({_plural(len(mt), 'run')}, none FINISHED)." + common_failure(mt)
        return md + [f"_{msg}_"], ht + [f'<p class="note">{e(msg)}</p>']
    grids, tgrids = grid_names(mb), grid_names(mt)
    for grid in grid_order(grids):
        gmd, ght = _grid_sections(mb[grids == grid], mt[tgrids == grid], model, grid, taken, out,
                                  tracking_uri, colors)
        md += gmd
        ht += ght
    return md, ht


def _write_pages(out: Path, name: str, md: list[str], ht: list[str], bands_json: dict) -> dict[str, Path]:
    """report.md, report.html (self-contained) and bands.json, each written atomically."""

    paths = {"html": out / "report.html", "md": out / "report.md", "bands": out / "bands.json"}
    atomic_write_text(paths["bands"], json.dumps(bands_json, indent=1, allow_nan=False))
    atomic_write_text(paths["md"], "\n".join(md) + "\n")
    page = ["<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">',
            f"<title>Sweep report: {html.escape(name)}</title>", f"<style>{REPORT_CSS}</style></head><body>",
            *ht, "</body></html>"]
    atomic_write_text(paths["html"], "\n".join(page) + "\n")
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
                          BandSettings(**settings.get("bands", {})), lamp=load_lamp(tracking_uri, info["run_id"]),
                          logged=set(info.get("diagnostics") or ()))


def write_report(run_dir: str | Path, driver: str | None = None) -> dict[str, Path]:
    """Report for the sweep described by ``run_dir/sweep.json``, written into ``run_dir`` (``driver``:
    ``write_report_from``'s)."""
    run_dir = Path(run_dir)
    meta = json.loads((run_dir / "sweep.json").read_text(encoding="utf-8"))
    uri = meta.get("tracking_uri") or f"sqlite:///{(run_dir / 'mlflow.db').resolve()}"
    return write_report_from(uri, meta["sweep_id"], run_dir,
                             experiment=meta.get("experiment") or "healsweep",
                             title=meta.get("name"), settings=meta.get("analysis"),
                             search=search_bounds(meta.get("spec")), widened=widened_cells(meta),
                             stops=search_stops(run_dir), parent_run_id=meta.get("parent_run_id"), driver=driver)
