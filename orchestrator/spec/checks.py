"""``SpecError`` and the field checkers every section parser uses (a leaf module: imports nothing of the project).

Each checker takes the value and its dotted path and either returns the value (converted) or raises a
``SpecError`` whose one-line message names the path and what is allowed. Messages quote at most a short
excerpt of the offending value (``excerpt``): a spec can be large or hostile (docs/methods.md is not involved).
"""
from __future__ import annotations

import math
import os
import re
from pathlib import Path
from typing import Any, Mapping

# Bounds of a spec (a larger grid is a typo or an attack, not a sweep; say so before any work starts).
MAX_LIST = 1_000  # items of any list (sparsities, calib_sizes, seeds, pruners, healers, models, grids)
MAX_TRIALS_PER_CELL = 10_000
MAX_EPOCHS = 10_000
MAX_STEPS = 10_000_000
MAX_LR = 10.0  # search.lr: a learning rate, not a typo (1e300 validated, and every trial diverged)
# Search objectives and their direction (docs/methods.md#search); analysis/runs.py OBJECTIVE_MODES mirrors it
# (analysis may not import orchestrator; tests/orchestrator/test_search_spec.py holds the two equal).
OBJECTIVES = {"selection_acc": "max", "heldout_align": "min"}
MAX_WIDEN_ROUNDS = 10
MAX_WIDEN_FACTOR = 1e6  # search.widen.factor and refine --widen-factor
# Search designs (orchestrator/search registers them; the spec is checked without importing it) and their bounds.
DESIGNS = ("shared", "tpe", "grid")
# heal.precision: the names of tasks.healing.precision.PRECISIONS, here so that checking a spec imports no torch
# (tests/orchestrator/test_gpu_settings.py::test_precision_names_are_the_tasks_registry holds the two equal)
PRECISIONS = ("fp32", "tf32", "bf16")
# heal.compile: tasks.healing.compiled.COMPILE_MODES (held equal by tests/orchestrator/test_gpu_settings.py)
COMPILE_MODES = ("off", "blocks")
GRAPH_MODES = ("off", "step")  # heal.graph: tasks.healing.graphed.GRAPH_MODES (the same test holds them equal)
DEVICES = ("auto", "cpu", "cuda")  # resources.device
MAX_REEVALUATE = 8  # fresh healing seeds per winner
MAX_LATTICE = 64  # points on one lattice axis
MAX_TRIALS = 100_000  # trials of the whole sweep (all grids); the environment's HEALSWEEP_MAX_TRIALS overrides it
MAX_SEED = 2**32 - 1  # numpy / torch seeds are unsigned 32-bit
MAX_NAME = 64  # sweep, grid and experiment names become directory names and MLflow names
NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]*\Z")
EXCERPT = 60  # characters of a value quoted in an error message
MAX_MESSAGE = 300  # characters of an error message (after its path)


class SpecError(ValueError):
    """A spec the sweep cannot run: ``path`` names the field ('' for the whole spec), ``message`` says why."""

    def __init__(self, path: str, message: str) -> None:
        message = " ".join(str(message).split())  # one line, whatever the value quoted in it contained
        if len(message) > MAX_MESSAGE:  # e.g. a method's own check quoting a long settings value
            message = message[: MAX_MESSAGE - 3] + "..."
        super().__init__(f"{path}: {message}" if path else message)
        self.path, self.message = path, message


def max_trials() -> int:
    """MAX_TRIALS, or a deliberate larger (or smaller) bound from the HEALSWEEP_MAX_TRIALS environment variable."""

    v = os.environ.get("HEALSWEEP_MAX_TRIALS", "")
    return int(v) if v.isdigit() else MAX_TRIALS


def excerpt(v: Any, limit: int = EXCERPT) -> str:
    """``repr(v)`` cut to ``limit`` characters (never expands a huge or deeply nested value in full)."""
    text = _short_repr(v, limit + 1, 3)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _short_repr(v: Any, budget: int, depth: int) -> str:
    """repr of at most about ``budget`` characters: containers show their first items only (aliases in YAML
    can make a small document a huge value: never build its full repr)."""
    if isinstance(v, (list, tuple, dict)):
        if depth == 0:
            return f"<{type(v).__name__} of {len(v)} items>"
        if isinstance(v, dict):
            parts = [f"{_short_repr(k, budget, 0)}: {_short_repr(x, budget, depth - 1)}" for k, x in list(v.items())[:4]]
        else:
            parts = [_short_repr(x, budget, depth - 1) for x in list(v)[:4]]
        more = ", ..." if len(v) > 4 else ""
        open_, close = ("{", "}") if isinstance(v, dict) else ("[", "]") if isinstance(v, list) else ("(", ")")
        return (open_ + ", ".join(parts) + more + close)[: budget + 3]
    if isinstance(v, str):
        return repr(v[:budget])
    if isinstance(v, int) and not isinstance(v, bool) and abs(v) > 10**budget:
        return f"<int of about {v.bit_length() * 3 // 10} digits>"
    try:
        return repr(v)[:budget]
    except (ValueError, RecursionError):
        return f"<{type(v).__name__}>"


def join(path: str, key: Any) -> str:
    """``path.key``; a key that is not a short string is quoted as an excerpt."""
    key = key if isinstance(key, str) and len(key) <= 40 and key.isprintable() else excerpt(key, 40)
    return f"{path}.{key}" if path else key


def check_keys(d: Any, path: str, allowed: set[str], required: set[str] = frozenset(),
               hidden: set[str] = frozenset()) -> dict:
    """A mapping with only ``allowed`` or ``hidden`` keys (strings) and every ``required`` key; an unknown key's
    message lists ``allowed`` (``hidden``: keys the tool writes for itself, accepted but not offered)."""
    if not isinstance(d, Mapping):
        raise SpecError(path or "spec", f"must be a mapping, got {type(d).__name__}")
    for k in d:
        if not isinstance(k, str):
            raise SpecError(path or "spec", f"keys must be strings, got {excerpt(k)}")
    unknown = sorted(set(d) - set(allowed) - set(hidden))
    if unknown:
        raise SpecError(join(path, unknown[0]), f"unknown key; allowed: {', '.join(sorted(allowed))}")
    missing = sorted(required - set(d))
    if missing:
        raise SpecError(join(path, missing[0]), "required key is missing")
    return dict(d)


def check_num(v: Any, path: str, kind: type = float, lo: float | None = None, hi: float | None = None,
              lo_open: bool = False, hi_open: bool = False) -> Any:
    """A finite number (``kind=int``: an integer) within [lo, hi] (open ends with ``lo_open``/``hi_open``)."""
    ok = isinstance(v, (int, float)) and not isinstance(v, bool) and (kind is float or isinstance(v, int))
    if not ok or (isinstance(v, float) and not math.isfinite(v)):
        raise SpecError(path, f"must be {'an integer' if kind is int else 'a number'}, got {excerpt(v)}")
    if lo is not None and (v < lo or (lo_open and v == lo)):
        raise SpecError(path, f"must be {'>' if lo_open else '>='} {lo}, got {excerpt(v)}")
    if hi is not None and (v > hi or (hi_open and v == hi)):
        raise SpecError(path, f"must be {'<' if hi_open else '<='} {hi}, got {excerpt(v)}")
    if kind is float and isinstance(v, int) and abs(v) > 1e300:
        raise SpecError(path, f"must be a number of sane size, got {excerpt(v)}")
    return kind(v)


def check_list(v: Any, path: str, limit: int = MAX_LIST) -> list:
    """A non-empty list of at most ``limit`` items."""
    if not isinstance(v, list) or not v:
        raise SpecError(path, f"must be a non-empty list, got {excerpt(v)}")
    if len(v) > limit:
        raise SpecError(path, f"has {len(v)} items; at most {limit} are allowed")
    return v


def check_unique(values: tuple, path: str) -> tuple:
    """``values`` (checked items of the list at ``path``) with no value twice: a repeat would run nothing more
    (cells are keyed by value) and is most often a typo for another value."""
    first: dict = {}
    for j, v in enumerate(values):
        if v in first:
            raise SpecError(f"{path}[{j}]", f"{v!r} is listed twice (also at [{first[v]}]); list each value once")
        first[v] = j
    return values


def check_bool(v: Any, path: str) -> bool:
    if not isinstance(v, bool):
        raise SpecError(path, f"must be true or false, got {excerpt(v)}")
    return v


def check_name(v: Any, path: str) -> str:
    """A name used in paths and MLflow: letters, digits, '-' or '_' (not first), at most MAX_NAME characters."""
    if not isinstance(v, str) or not NAME_RE.match(v):
        raise SpecError(path, f"must be letters, digits, '-' or '_' (starting with a letter or digit), got {excerpt(v)}")
    if len(v) > MAX_NAME:
        raise SpecError(path, f"must be at most {MAX_NAME} characters, got {len(v)}")
    return v


def check_str(v: Any, path: str, limit: int = 4096) -> str:
    """A non-empty string without control characters, at most ``limit`` characters."""
    if not isinstance(v, str) or not v.strip():
        raise SpecError(path, f"must be a non-empty string, got {excerpt(v)}")
    if len(v) > limit:
        raise SpecError(path, f"must be at most {limit} characters, got {len(v)}")
    if any(ord(c) < 32 or c == "\x7f" for c in v):
        raise SpecError(path, f"must not contain control characters, got {excerpt(v)}")
    return v


def check_choice(v: Any, path: str, allowed: tuple[str, ...]) -> str:
    if not isinstance(v, str) or v not in allowed:
        raise SpecError(path, f"must be {' or '.join(allowed) if len(allowed) < 3 else 'one of ' + ', '.join(allowed)}, "
                              f"got {excerpt(v)}")
    return v


def check_pair(v: Any, path: str, kind: type, lo: float, lo_open: bool = False, hi: float | None = None) -> tuple:
    """[low, high] with lo <(=) low <= high <= hi."""
    if not (isinstance(v, (list, tuple)) and len(v) == 2):
        raise SpecError(path, f"must be [low, high], got {excerpt(v)}")
    a = check_num(v[0], f"{path}[0]", kind, lo, hi, lo_open=lo_open)
    return a, check_num(v[1], f"{path}[1]", kind, a, hi)


def local_path(v: str, base_dir: str | os.PathLike | None) -> str:
    """A spec's local path made absolute: ``~`` expanded, a relative path taken from ``base_dir`` (the spec
    file's directory; the working directory for a spec given as a mapping). Trials run in their own working
    directories (Ray Tune's trial directories) and on other nodes, so a relative path would name another file."""
    return os.path.abspath(os.path.join(base_dir or os.getcwd(), os.path.expanduser(v)))


def not_a_dir(value) -> str | None:
    """Why ``value`` cannot be (or be created as) a directory: it, or the nearest of its parents that exists, is
    a file; None otherwise (a path under a file failed only when the first write reached it: after Ray had
    started, the models were loaded, or ``models train`` had trained)."""
    p = Path(value).absolute()
    for q in (p, *p.parents):
        if q.exists():
            return None if q.is_dir() else (f"{value} is a file, not a directory" if q == p else
                                              f"{value} is under {q}, which is a file, not a directory")
    return None
