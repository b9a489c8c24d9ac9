"""docs/layout.md names every module, and only paths that exist.

The page is a list of sections, each headed by a folder in backticks (### `tasks/store/`), whose entries
(- `core.py` — …) are paths relative to that folder. A package's __init__.py is named by its folder's heading.
Checked: every *.py under orchestrator/, tasks/, analysis/ and benchmarks/, every folder directly under tests/ and
every file of configs/, docker/ and .ci/ is named; every folder heading and every entry exists.
"""
from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PAGE = REPO / "docs" / "layout.md"
HEADING = re.compile(r"^#{2,4} `([^`]+/)`\s*$")
ENTRY = re.compile(r"^- `([^`]+)`")
SKIP = {"__pycache__"}


def named_paths() -> set[str]:
    """Every path the page names (repo-relative, folders with a trailing /), in the order it names them."""
    names: set[str] = set()
    folder = None
    for line in PAGE.read_text(encoding="utf-8").splitlines():
        if line.startswith("```"):
            continue
        if m := HEADING.match(line):
            folder = m.group(1)
            names.add(folder)
        elif (m := ENTRY.match(line)) and folder is not None:
            names.add(folder + m.group(1))
    return names


def _files(top: str, pattern: str) -> list[Path]:
    return [p for p in (REPO / top).rglob(pattern) if p.is_file() and not SKIP & set(p.parts)]


def test_every_module_is_named():
    names = named_paths()
    missing = []
    for top in ("orchestrator", "tasks", "analysis", "benchmarks"):
        for p in _files(top, "*.py"):
            rel = p.relative_to(REPO).as_posix()
            parent = p.parent.relative_to(REPO).as_posix() + "/"
            if rel not in names and not (p.name == "__init__.py" and parent in names):
                missing.append(rel)
    assert not missing, f"docs/layout.md does not name: {sorted(missing)}"


def test_every_tests_folder_and_deploy_file_is_named():
    names = named_paths()
    want = {p.relative_to(REPO).as_posix() + "/" for p in (REPO / "tests").iterdir()
            if p.is_dir() and p.name not in SKIP}
    want |= {p.relative_to(REPO).as_posix() for top in ("configs", "docker", ".ci") for p in _files(top, "*")}
    assert not want - names, f"docs/layout.md does not name: {sorted(want - names)}"


def test_every_named_path_exists():
    names = named_paths()
    assert len(names) > 150
    gone = sorted(n for n in names if not (REPO / n).exists() or (n.endswith("/") and not (REPO / n).is_dir()))
    assert not gone, f"docs/layout.md names paths that do not exist: {gone}"


def test_orchestrator_is_by_concern():
    """orchestrator/ holds sub-packages by concern; at its top level only the package face and the CLI entry
    (issue 35): a new module goes into the sub-package of its concern, and the layers contract in pyproject.toml
    names every sub-package."""
    top = sorted(p.name for p in (REPO / "orchestrator").glob("*.py"))
    assert top == ["__init__.py", "cli.py"], top
    subs = {p.name for p in (REPO / "orchestrator").iterdir() if (p / "__init__.py").is_file()}
    contract = (REPO / "pyproject.toml").read_text(encoding="utf-8").split('containers = ["orchestrator"]')[1]
    layers = re.search(r"layers = \[(.*?)\]", contract).group(1)
    named = {w for w in re.findall(r"[a-z_]+", layers)}
    assert subs <= named, (subs - named)
