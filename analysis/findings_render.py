"""The first screen's findings as text: the Markdown and HTML of ``analysis.findings.Findings`` (ranges table,
best pruner x healer per sparsity, warnings and notes)."""
from __future__ import annotations

import html as _h

from .findings import Findings, Range, headline

__all__ = ["FINDINGS_HOW", "QUOTED", "findings_md", "findings_html"]

FINDINGS_HOW = ("Ranges are the repairability bands of the seed-mean quoted healed accuracy ({quoted}) "
                "(recoverable: retention ≥ "
                "{ret:g}; collapse: within {z:g} binomial standard errors of chance; transition: between). A band "
                "edge is only known to lie between two tested sparsities (the grid step). Best: highest mean healed "
                "accuracy; the lead over the runner-up healer (same pruner, identical masks) and pruner (same "
                "healer, same seed) is a paired 95 % interval, or n=1 with a single seed; a lead is resolved only when it "
                "exceeds 2 noise units (search + seed noise, docs/methods.md#reading-the-noise); the combos the best is not "
                "resolved from are named beside it (≈). CTS: the "
                "calibration-only broad band, computed without any accuracy.")
QUOTED = {True: "each cell's winner re-healed on fresh seeds: docs/methods.md#search-design",
          False: "each cell's best search trial: search.reevaluate 0, no re-healing"}  # {quoted}, by re-evaluation
_RANGE_HEADS = ["pruner", "healer", "calib", "recoverable", "transition", "collapse", "resolution", "seeds",
                "class not resolved at", "CTS band"]
_FOLDABLE = ("resolution", "seeds", "unresolved", "cts")  # columns shown once in the caption when every row has the same value


def _folded(ranges: list[Range]) -> dict[str, str]:
    """{field: value} of the foldable columns that are the same on every row (shown once, not per row)."""
    return {k: getattr(ranges[0], k) for k in _FOLDABLE
            if len(ranges) > 1 and len({getattr(r, k) for r in ranges}) == 1}


def _best_grid(rows: list[dict]) -> tuple[list[str], list[list[str]]]:
    """rows = patterns, columns = calibration sizes; cell = best combo, accuracy, what it is tied with, leads."""
    calibs = list(dict.fromkeys(r["calib_size"] for r in rows))
    pats = list(dict.fromkeys(r["pattern"] for r in rows))
    at = {(r["pattern"], r["calib_size"]): r for r in rows}
    body = []
    for p in pats:
        cells = [p]
        for n in calibs:
            r = at.get((p, n))
            tied = f"≈ {', '.join(r['tied'])} (not resolved)\n" if r is not None and r.get("tied") else ""
            cells.append("–" if r is None else f"{r['best']} {100 * r['healed']:.2f} %\n{tied}"
                         f"healer {r['vs_healer']}; pruner {r['vs_pruner']}")
        body.append(cells)
    return ["sparsity", *(f"calib {n}" for n in calibs)], body


NO_FINDINGS = ("No trial finished, so there are no findings: the trials below failed or have not run (a partial "
               "sweep says how to resume it above).")


def findings_md(fs: list[Findings], how: str) -> list[str]:
    if not fs:  # (the how-to line would describe numbers there are none of)
        return ["## Findings", "", NO_FINDINGS, ""]
    md = ["## Findings", "", how, ""]
    for f in fs:
        md += [f"### {f.model} — grid `{f.grid}`", ""]
        md += [f"**{f.budget}**", ""] if f.budget else []
        md += [f"**Best:** {headline(f.best)}", ""] if f.best else []
        md += [f"> **Warning:** {w}" for w in f.warnings] + ([""] if f.warnings else [])
        md += [f"_{n}_" for n in f.notes] + ([""] if f.notes else [])
        md += ["| " + " | ".join(_RANGE_HEADS) + " |", "|" + "---|" * len(_RANGE_HEADS)]
        md += ["| " + " | ".join(str(getattr(r, k)) for k in Range.__dataclass_fields__) + " |" for r in f.ranges]
        heads, body = _best_grid(f.best)
        md += ["", "**Best pruner × healer per sparsity**", "", "| " + " | ".join(heads) + " |",
               "|" + "---|" * len(heads)]
        md += ["| " + " | ".join(c.replace("\n", "<br>") for c in row) + " |" for row in body]
        md.append("")
    return md


def findings_html(fs: list[Findings], how: str) -> list[str]:
    """Per model: the best method at each sparsity and short warning flags, then the ranges table (columns equal
    on every row shown once in its caption), the best-per-sparsity table and the warnings in full."""
    e = _h.escape
    heads = dict(zip(Range.__dataclass_fields__, _RANGE_HEADS))
    if not fs:
        return [f'<section id="findings"><h2>Findings</h2><p class="warn">{e(NO_FINDINGS)}</p></section>']
    ht = ['<section id="findings"><h2>Findings</h2><div class="models">']
    for f in fs:
        ht.append(f'<div class="model"><h3>{e(f.model)} <span class="grid">grid {e(f.grid)}</span></h3>')
        if f.budget:
            ht.append(f'<p class="headline"><b>{e(f.budget)}</b></p>')
        if f.best:
            ht.append(f'<p class="headline"><b>Best:</b> {e(headline(f.best))}</p>')
        if f.flags:
            ht.append('<p class="flags">⚠ ' + " · ".join(e(x) for x in f.flags) + " (details below)</p>")
        fold = _folded(f.ranges)
        cols = [k for k in Range.__dataclass_fields__ if k not in fold]
        cap = "; ".join(f"{heads[k]}: {v}" for k, v in fold.items())
        rows = "".join("<tr>" + "".join(f'<td class="{k}">{e(str(getattr(r, k)))}</td>' for k in cols) + "</tr>"
                       for r in f.ranges)
        ht.append('<table class="ranges">' + (f"<caption>every row: {e(cap)}</caption>" if cap else "")
                  + "<thead><tr>" + "".join(f"<th>{e(heads[k])}</th>" for k in cols)
                  + f"</tr></thead><tbody>{rows}</tbody></table>")
        bh, body = _best_grid(f.best)
        cells = "".join("<tr>" + "".join(
            "<td>" + "<br><small>".join(e(x) for x in c.split("\n")) + ("</small>" if "\n" in c else "") + "</td>"
            for c in row) + "</tr>" for row in body)
        ht.append('<table class="best"><caption>Best pruner × healer per sparsity</caption><thead><tr>'
                  + "".join(f"<th>{e(h)}</th>" for h in bh) + f"</tr></thead><tbody>{cells}</tbody></table>")
        ht += [f'<p class="warn">⚠ {e(w)}</p>' for w in f.warnings]
        ht += [f'<p class="note">{e(n)}</p>' for n in f.notes]
        ht.append("</div>")
    ht.append(f'</div><p class="note">{e(how)}</p></section>')
    return ht
