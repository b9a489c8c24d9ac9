"""A trial's saved files, ``<run dir>/trials/<trial_id>/``: ``healed.safetensors`` (what healing changed) and
``trial.json`` (its parameters and final results), written by tasks/export.py ``save_healed``. Their names, the
one safe way from a trial key to its directory, and a check that both are whole, without torch: ``healsweep
doctor`` and the resume read every finished trial's headers (orchestrator/lifecycle/).
"""
from __future__ import annotations

import json
import re
import time
from pathlib import Path

HEALED = "healed.safetensors"
TRIAL_JSON = "trial.json"
# A trial key is "<cell id>-<optuna trial number>": one path component, never "." or "..", no separators.
TRIAL_KEY_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")


def trial_dir(run_dir: Path, trial_id: str) -> Path:
    """``run_dir/trials/<trial_id>``; ValueError when the key (e.g. an MLflow tag) is not a plain trial key."""
    if not isinstance(trial_id, str) or not TRIAL_KEY_RE.match(trial_id) or ".." in trial_id:
        raise ValueError(f"trial_id {str(trial_id)[:80]!r}: not a trial key (expected <cell id>-<number>, "
                         f"matching {TRIAL_KEY_RE.pattern})")
    root = (Path(run_dir) / "trials").resolve()
    d = (root / trial_id).resolve()
    if d.parent != root:  # e.g. a symlink planted under trials/
        raise ValueError(f"trial_id {trial_id!r}: resolves outside {root}")
    return d


def healed_problem(trial_dir: Path) -> str | None:
    """Why a finished trial's saved files are not whole, or None: both present, trial.json a JSON object, and the
    weights' safetensors framing sound (8-byte header length, JSON header, the last tensor ending at the file's
    end: what a truncated copy or a write cut short breaks). Reads headers only, not the values."""
    w, t = Path(trial_dir) / HEALED, Path(trial_dir) / TRIAL_JSON
    try:
        if not Path(trial_dir).is_dir():
            return "its directory is missing"
        if not w.is_file():
            return f"{HEALED} missing"
        if why := _framing_problem(w):
            return f"{HEALED} {why}"
        if not isinstance(json.loads(t.read_bytes()), dict):
            return f"{TRIAL_JSON} is not a JSON object"
    except FileNotFoundError as e:
        return f"{Path(e.filename or t).name} missing"
    except OSError as e:  # permissions, an I/O error
        return f"{Path(e.filename or w).name} unreadable ({e.strerror or type(e).__name__})"
    except (ValueError, RecursionError) as e:
        return f"{TRIAL_JSON} unreadable ({type(e).__name__})"
    return None


def weights_seen(run_dir: Path, trial_id: str) -> str:
    """Where a just finished trial's healed weights are, as the driver sees them: "saved" (whole in its run
    directory) or "elsewhere" (not there: the trial ran on a node that does not share the run directory, or the
    key is not a plain trial key). The trial line records it; only "saved" weights can later be lost."""
    try:
        return "elsewhere" if healed_problem(trial_dir(run_dir, trial_id)) else "saved"
    except (ValueError, OSError, RuntimeError):  # not a plain key; a symlink loop
        return "elsewhere"


def sees_run_dir(run_dir: str | Path, sweep_id: str, tries: int = 3) -> bool:
    """Whether this process sees the driver's run directory: its ``sweep.json`` names ``sweep_id``. A trial on a
    node that does not share it (a cluster sharing only the store URI) sees no such file, or another sweep's. A
    read error other than a missing file (a stale NFS handle while the driver replaces the file) is asked again,
    ``tries`` times in all, 0.2 s apart."""
    for attempt in range(tries):
        try:
            meta = json.loads((Path(run_dir) / "sweep.json").read_bytes())
            break
        except (FileNotFoundError, NotADirectoryError, ValueError, RecursionError):
            return False
        except OSError:
            if attempt == tries - 1:
                return False
            time.sleep(0.2)
    return isinstance(meta, dict) and bool(sweep_id) and meta.get("sweep_id") == sweep_id


def _framing_problem(path: Path) -> str | None:
    """Why ``path`` is not a whole safetensors file (its framing only), or None."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        n = int.from_bytes(head, "little") if len(head) == 8 else -1
        if n < 2 or 8 + n > size:
            return f"truncated ({size} bytes, header not whole)"
        try:
            header = json.loads(f.read(n))
            end = max((int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"), default=0)
        except (ValueError, TypeError, KeyError, IndexError, AttributeError, RecursionError) as e:
            return f"header unreadable ({type(e).__name__})"
    if 8 + n + end != size:
        return f"{'truncated' if 8 + n + end > size else 'overlong'} ({size} bytes, its header says {8 + n + end})"
    return None
