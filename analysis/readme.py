"""Generated documentation blocks: ``<!-- report:NAME -->…<!-- /report:NAME -->`` of a Markdown file (the default
sweep's page, docs/default-sweep.md) rewritten from a sweep's report, so its tables and figures cannot go stale.

NAME is ``findings`` (the report's findings section: ranges, best methods, warnings) or the stem of a figure the
report wrote (``fig_resnet_digits``): the figure is copied into the ``docs/`` folder (the file's own folder when
the file lives in ``docs/``, else ``docs/`` beside it) and the block becomes its image link, relative to the file.
Text outside the markers is never touched; a marker naming nothing the report has, or a marker without its pair,
is an error (nothing is written then).
"""
from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

__all__ = ["BLOCK", "ReadmeError", "readme_blocks", "update_readme"]

BLOCK = re.compile(r"(<!-- report:(?P<name>[A-Za-z0-9_.-]+) -->)(?P<body>.*?)(<!-- /report:(?P=name) -->)", re.S)
MARKER = re.compile(r"<!-- (?P<end>/?)report:(?P<name>[A-Za-z0-9_.-]+) -->")


class ReadmeError(ValueError):
    pass


def _findings(report_md: str) -> str:
    m = re.search(r"^## Findings\n(.*?)(?=^## )", report_md, re.S | re.M)
    if not m:
        raise ReadmeError("report.md has no '## Findings' section (re-run healsweep report)")
    return m.group(1).strip()


def figures_dir(doc: Path) -> Path:
    """Where the figures a file's blocks link go: its own folder if that is ``docs/``, else ``docs/`` beside it."""
    return doc.parent if doc.parent.name == "docs" else doc.parent / "docs"


def readme_blocks(run_dir: Path, names: list[str], figures: str = "docs") -> dict[str, str]:
    """NAME -> generated markdown for every NAME asked for (figures linked as <figures>/<file>)."""
    md = (run_dir / "report.md").read_text(encoding="utf-8")
    out = {}
    for name in names:
        if name == "findings":
            out[name] = _findings(md)
        elif (run_dir / f"{name}.png").is_file():
            out[name] = f"![{name}]({Path(figures, f'{name}.png').as_posix()})"
        else:
            raise ReadmeError(f"<!-- report:{name} -->: no such block (findings, or a figure of {run_dir})")
    return out


CODE = re.compile(r"^(`{3,}|~{3,}).*?^\1[ \t]*$|`[^`\n]*`", re.S | re.M)  # fenced blocks, inline code spans


def unpaired(text: str) -> str | None:
    """The first marker that no block holds (an opening one without its closing one, or the reverse), as
    "<!-- ... --> (line N) has no ..."; None when every marker is in a block. Markers shown as code (a page that
    documents the syntax) are not markers."""
    text = CODE.sub(lambda m: re.sub(r"[^\n]", " ", m.group(0)), text)  # same offsets and line numbers
    paired = {i for m in BLOCK.finditer(text) for i in (m.start(1), m.start(4))}
    for m in MARKER.finditer(text):
        if m.start() not in paired:
            line = text.count("\n", 0, m.start()) + 1
            pair = f"<!-- {'' if m.group('end') else '/'}report:{m.group('name')} -->"
            return f"{m.group(0)} (line {line}) has no {pair} {'before' if m.group('end') else 'after'} it"
    return None


def update_readme(run_dir: str | Path, readme: str | Path) -> list[str]:
    """Rewrite every marked block of ``readme`` (any Markdown file) from ``run_dir``'s report; copy the figures it
    links into :func:`figures_dir`. Returns the block names rewritten."""
    run_dir, readme = Path(run_dir), Path(readme)
    text = readme.read_text(encoding="utf-8")
    if why := unpaired(text):
        raise ReadmeError(f"{readme}: {why}")
    names = [m.group("name") for m in BLOCK.finditer(text)]
    docs = figures_dir(readme)
    blocks = readme_blocks(run_dir, names, os.path.relpath(docs, readme.parent))
    for name in names:
        if name != "findings":
            docs.mkdir(exist_ok=True)
            shutil.copyfile(run_dir / f"{name}.png", docs / f"{name}.png")
    new = BLOCK.sub(lambda m: f"{m.group(1)}\n{blocks[m.group('name')]}\n{m.group(4)}", text)
    readme.write_text(new, encoding="utf-8")
    return names
