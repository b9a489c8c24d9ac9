"""One place for laziness: every package face names the heavy libraries that may be imported inside a function
(``HEAVY``); every other import sits at the top of its file. An import inside a function must name a heavy library
or one of the project's modules whose own top-level imports reach one (through its packages' faces too): then the
import is real laziness (the driver stays light until the work starts), not habit.

The graph is read from the source (ast), so the test sees what a reader sees: ``if TYPE_CHECKING:`` blocks do not
count as imports."""
from __future__ import annotations

import ast
import importlib
from functools import lru_cache
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("orchestrator", "analysis", "tasks")
pytestmark = pytest.mark.timeout(120)


def heavy_roots() -> set[str]:
    roots: set[str] = set()
    for pkg in PACKAGES:
        roots |= set(importlib.import_module(pkg).HEAVY)
    return roots


def module_file(name: str) -> Path | None:
    base = REPO / name.replace(".", "/")
    if (base / "__init__.py").is_file():
        return base / "__init__.py"
    return base.with_suffix(".py") if base.with_suffix(".py").is_file() else None


def _is_type_checking(node: ast.If) -> bool:
    t = node.test
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or (
        isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING")


def _targets(node: ast.Import | ast.ImportFrom, here: str) -> list[str]:
    """The modules an import statement loads (``from a import b``: ``a.b`` when that is a module, else ``a``)."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    base = node.module or ""
    if node.level:  # relative: resolved against the importing module's package
        pkg = here.rsplit(".", node.level)[0] if module_file(here) and module_file(here).name != "__init__.py" \
            else here.rsplit(".", node.level - 1)[0] if node.level > 1 else here
        base = f"{pkg}.{base}" if base else pkg
    out = []
    for a in node.names:
        sub = f"{base}.{a.name}"
        out.append(sub if base.split(".")[0] in PACKAGES and module_file(sub) else base)
    return out


def imports(name: str) -> tuple[list[str], list[tuple[int, str]]]:
    """(top-level imports, [(line, module) imported inside a function]) of one module of the project."""
    tree = ast.parse(module_file(name).read_text(encoding="utf-8"))
    top: list[str] = []
    inner: list[tuple[int, str]] = []

    def walk(nodes, in_function: bool) -> None:
        for node in nodes:
            if isinstance(node, ast.If) and _is_type_checking(node):
                walk(node.orelse, in_function)
                continue
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                for t in _targets(node, name):
                    (inner.append((node.lineno, t)) if in_function else top.append(t))
                continue
            fn = isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            walk(ast.iter_child_nodes(node), in_function or fn)
    walk(tree.body, False)
    return top, inner


def _parents(name: str) -> list[str]:
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


@lru_cache(maxsize=None)
def reaches_heavy(name: str, roots: frozenset[str], seen: frozenset[str] = frozenset()) -> str | None:
    """The heavy library that importing ``name`` loads at module level (its faces included), or None."""
    root = name.split(".")[0]
    if root not in PACKAGES:
        return name if root in roots else None
    for mod in (*_parents(name), name):
        if mod in seen or module_file(mod) is None:
            continue
        for t in imports(mod)[0]:
            hit = reaches_heavy(t, roots, seen | {mod})
            if hit:
                return hit
    return None


def project_modules() -> list[str]:
    out = []
    for pkg in PACKAGES:
        for p in sorted((REPO / pkg).rglob("*.py")):
            rel = p.relative_to(REPO).with_suffix("")
            parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
            out.append(".".join(parts))
    return out


def test_every_face_names_its_heavy_imports():
    for pkg in PACKAGES:
        heavy = importlib.import_module(pkg).HEAVY
        assert heavy and all(isinstance(h, str) and "." not in h for h in heavy), pkg


def test_imports_inside_functions_are_heavy():
    roots = frozenset(heavy_roots())
    habit = []
    for mod in project_modules():
        for line, target in imports(mod)[1]:
            if reaches_heavy(target, roots) is None:
                habit.append(f"{module_file(mod).relative_to(REPO)}:{line} imports {target} inside a function")
    assert not habit, "light imports belong at the top of the file:\n" + "\n".join(habit)


def test_the_checker_tells_heavy_from_light():
    """The rule's own reading: a light module, a heavy library, and a project module heavy through its face."""
    roots = frozenset(heavy_roots())
    assert reaches_heavy("json", roots) is None
    assert reaches_heavy("orchestrator.rundir.records", roots) is None
    assert reaches_heavy("torch", roots) == "torch"
    assert reaches_heavy("orchestrator.search.lattice", roots) is not None  # its face imports Ray Tune's Searcher
