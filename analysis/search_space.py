"""The search space a sweep searched, as the report reads it back: each grid's bounds (from sweep.json's spec),
the boxes of widening rounds (sweep.json ``widenings``, written by orchestrator/lifecycle/widen.py), and the
``search_boundary`` flag on winners whose lr or training length sits on the edge of that space
(``analysis.findings.boundary``)."""
from __future__ import annotations

import contextlib
from typing import Iterable

import pandas as pd

from .findings import edges
from .runs import grid_names
from .search_stops import RECOVERED


def flag_boundary(best: pd.DataFrame, search: dict | None, tracking_uri: str | None = None,
                  widened: dict | None = None, explored: dict | None = None, tagged: Iterable[str] = ()
                  ) -> pd.DataFrame:
    """Add ``search_boundary`` ('' or the reason) to each winner; with ``tracking_uri``, tag every gradient
    winner's MLflow run ``search_boundary`` = "true"/"false" (+ ``search_boundary_reason``), and set "false" on the
    runs of ``tagged`` (run ids a report tagged "true" before) that are no winner's now: a resume, a refine round
    or a widening found a better trial (the old tag said a non-winner sat on the boundary). ``widened``: cell
    id -> its widened search box, which replaces its grid's. ``explored``: cell id -> (lowest, highest) lr its
    search tried (``search_stops.explored_lr``): an lr edge the search tried past is no edge (``searched_edges``).
    A winner whose search stopped "recovered" (``search_stop``: at the dense model's accuracy, within the noise
    floor) is not flagged: nothing better lies past its edge beyond the noise."""
    if not search or best.empty:  # nothing can sit on a boundary: every earlier "true" is stale
        if tracking_uri and (stale := sorted(set(tagged))):
            _untag(tracking_uri, stale)
        return best.assign(search_boundary="")
    grids, widened = grid_names(best), widened or {}
    reasons = ["" if str(r.get("search_stop", "")).startswith(RECOVERED) else
               "; ".join(searched_edges(r, widened.get(r["cell_id"]) or search.get(g) or search.get("main"),
                                        (explored or {}).get(r["cell_id"])).values())
               for (_, r), g in zip(best.iterrows(), grids)]
    best = best.assign(search_boundary=reasons)
    if tracking_uri:
        from mlflow.tracking import MlflowClient

        client = MlflowClient(tracking_uri)
        for r in best.itertuples(index=False):
            if pd.to_numeric(r.lr, errors="coerce") > 0:  # a gradient winner (NaN: compares False)
                client.set_tag(r.run_id, "search_boundary", "true" if r.search_boundary else "false")
                if r.search_boundary:
                    client.set_tag(r.run_id, "search_boundary_reason", r.search_boundary)
        _untag(client, sorted(set(tagged) - set(best["run_id"])))
    return best


def _untag(client, run_ids: list[str]) -> None:
    """``search_boundary`` = "false" on ``run_ids`` and their reason removed (``client``: an MlflowClient or a
    tracking URI)."""
    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient

    client = MlflowClient(client) if isinstance(client, str) else client
    for run_id in run_ids:
        client.set_tag(run_id, "search_boundary", "false")
        with contextlib.suppress(MlflowException):  # no reason tag: nothing to remove (no get_run per run)
            client.delete_tag(run_id, "search_boundary_reason")


def searched_edges(row, box: dict | None, explored: tuple[float, float] | None) -> dict[str, str]:
    """``findings.edges`` of the winner ``row`` against ``box``, less an lr edge its search tried past: an lr
    below the box's floor for a floor winner, above its cap for a cap winner (``explored`` = (lowest, highest) lr
    tried). A converging search (orchestrator/search/converge.py) walks past a winning edge, and a winner with worse
    results beyond it is not on the edge of what was searched; a trial inside the box nearer its edge than the
    winner (TPE's draws) is no search past it."""
    out = edges(row, box)
    lo, hi = (box or {}).get("lr") or (0.0, float("inf"))
    if explored and "lr_cap" in out and explored[1] > max(float(row["lr"]), hi) * (1 + 1e-9):
        out.pop("lr_cap")
    if explored and "lr_floor" in out and explored[0] < min(float(row["lr"]), lo) * (1 - 1e-9):
        out.pop("lr_floor")
    return out


def _bounds(s: dict) -> dict:
    key = "steps" if s.get("steps") else "epochs"
    return {"lr": list(s["lr"]), key: list(s[key])}


def _box(b: dict) -> str:
    """'round 1: lr 1e-04–1.2e-02, epochs 1–32'"""
    key = "steps" if b.get("steps") else "epochs"
    return (f"round {b.get('round', 1)}: lr {b['lr'][0]:.2g}–{b['lr'][1]:.2g}, "
            f"{key} {b[key][0]}–{b[key][1]}")


def search_bounds(spec: dict | None) -> dict | None:
    """``{grid: {"lr", "epochs" or "steps"}}`` from a sweep.json spec (``search`` and each ``grids[i].search``)."""
    if not spec or "search" not in spec:
        return None
    main = spec["search"]
    out = {"main": _bounds(main)}
    for g in spec.get("grids") or []:
        over = {k: v for k, v in (g.get("search") or {}).items() if v is not None}
        if "steps" in over or "epochs" in over:  # a grid's own length replaces the top level's
            main = {k: v for k, v in spec["search"].items() if k not in ("steps", "epochs")}
        else:
            main = spec["search"]
        out[str(g["name"])] = _bounds({**main, **over})
    return out


def widened_cells(meta: dict) -> dict:
    """cell id -> {"round", "lr", "epochs"/"steps"}: the last widening round of each cell (sweep.json
    ``widenings``, written by orchestrator/lifecycle/widen.py)."""
    out = {}
    for w in meta.get("widenings") or []:
        for cid, box in (w.get("cells") or {}).items():
            out[cid] = {"round": w.get("round"), **box}
    return out
