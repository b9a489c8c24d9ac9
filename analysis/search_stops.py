"""Why each cell's search stopped, and the lr range it explored, read from the sweep's Optuna journal (the search
design writes them there: orchestrator/search/converge.py, ``search.converge``). Sweeps with a fixed trial count
(no ``converge``) have no such record: every searched cell ran ``trials_per_cell`` trials."""
from __future__ import annotations

import json
import tempfile
from pathlib import Path

from .runs import stage_of

JOURNAL = "optuna.journal"  # orchestrator/rundir/files.py JOURNAL_FILE
RECOVERED = "recovered"  # orchestrator/search/converge.py RECOVERED: a winner at the dense model's accuracy


def search_stops(run_dir: str | Path) -> dict[str, dict]:
    """cell id -> {"reason", "trials", "lr_range", "reevaluate_target"} for every cell whose search recorded a stop
    (empty without a journal or without ``search.converge``)."""
    path = Path(run_dir) / JOURNAL
    if not path.is_file():
        return {}
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    with tempfile.TemporaryDirectory(prefix="healsweep-stops-") as d:
        studies = _studies(path, Path(d) / JOURNAL)
    out: dict[str, dict] = {}
    for s in studies:
        attrs = s.user_attrs
        cid = attrs.get("cell_id", s.study_name)
        rec = out.setdefault(cid, {})
        if "stop_reason" in attrs:
            rec.update(reason=attrs["stop_reason"], trials=attrs.get("search_trials"), lr_range=attrs.get("lr_range"))
        if "reevaluate_target" in attrs:
            rec["reevaluate_target"] = attrs["reevaluate_target"]
    return {c: r for c, r in out.items() if "reason" in r}


def _studies(path: Path, scratch: Path) -> list:
    """Every study the journal replays: the file itself, or, when a line of it is damaged (torn, NUL bytes, not an
    Optuna operation: the report is read-only, ``healsweep doctor --repair`` mends the journal), a copy of its
    intact lines (``scratch``)."""
    import optuna

    def read(p: Path) -> list:
        return optuna.storages.JournalStorage(optuna.storages.journal.JournalFileBackend(str(p))).get_all_studies()

    errors = (ValueError, KeyError, TypeError, AttributeError, IndexError)  # json's errors are ValueErrors
    try:
        return read(path)
    except errors:
        scratch.write_bytes(b"".join(line for line in path.read_bytes().splitlines(keepends=True) if _operation(line)))
    try:
        return read(scratch)
    except errors:  # an intact operation that needs a lost one (its study's creation): no stop is known
        return []


def _operation(line: bytes) -> bool:
    """Whether ``line`` is one whole journal operation (a JSON object with an ``op_code``, ending in a newline)."""
    try:
        return line.endswith(b"\n") and isinstance(op := json.loads(line), dict) and "op_code" in op
    except (ValueError, TypeError):
        return False


def stop_summary(stops: dict[str, dict], cells) -> str:
    """'search stopped: 40 converged, 5 at the cap (12 trials), …; 2-9 trials per cell (mean 3.4)' over ``cells``."""
    mine = [stops[c] for c in cells if c in stops]
    if not mine:
        return ""
    kinds: dict[str, int] = {}
    for r in mine:
        k = str(r["reason"]).split(":")[0].split(" (")[0]
        kinds[k] = kinds.get(k, 0) + 1
    n = [int(r["trials"]) for r in mine if r.get("trials") is not None]
    span = f"; {min(n)}–{max(n)} search trials per cell (mean {sum(n) / len(n):.1f})" if n else ""
    return "Search stopped per cell: " + ", ".join(f"{v} {k}" for k, v in sorted(kinds.items())) + span


def attach(best, stops: dict[str, dict]):
    """``best`` with ``search_stop`` (why the cell's search stopped, '' when not recorded), ``search_trials`` and
    ``reevaluate_target`` columns."""
    cid = best["cell_id"]
    return best.assign(search_stop=cid.map(lambda c: stops.get(c, {}).get("reason", "")),
                       search_trials=cid.map(lambda c: stops.get(c, {}).get("trials")),
                       reevaluate_target=cid.map(lambda c: stops.get(c, {}).get("reevaluate_target")))


def stop_table(mb) -> tuple[list[str], list[list[str]]]:
    """(headers, rows): per searched cell of one model x grid, its search trials, why its search stopped and the
    re-evaluations it got; no rows when the sweep recorded no stops."""
    if "search_stop" not in mb.columns or not mb["search_stop"].astype(bool).any():
        return [], []
    heads = ["pruner", "healer", "sparsity", "calib", "seed", "search trials", "re-evaluations", "why the search stopped"]
    rows = []
    for r in mb[mb["search_stop"].astype(bool)].sort_values(["pruner", "healer", "pattern", "calib_size", "seed"]).itertuples():
        rows.append([str(r.pruner), str(r.healer), str(r.pattern), str(r.calib_size), str(r.seed),
                     "" if r.search_trials is None else str(int(r.search_trials)), str(int(r.n_reevaluated)),
                     str(r.search_stop)])
    return heads, rows


def explored_lr(trials) -> dict[str, tuple[float, float]]:
    """cell id -> (lowest, highest) lr its search trials tried (a converging search may go past the declared box:
    a winner with a tried lr beyond it is not on that edge)."""
    if trials is None or trials.empty or "lr" not in trials.columns:
        return {}
    t = trials[stage_of(trials) == "search"]
    lr = t.assign(_lr=t["lr"].astype(float))
    lr = lr[lr["_lr"] > 0]
    g = lr.groupby("cell_id")["_lr"]
    return {c: (float(lo), float(hi)) for c, lo, hi in zip(g.min().index, g.min().values, g.max().values)}
