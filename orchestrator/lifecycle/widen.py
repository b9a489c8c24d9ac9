"""Widening rounds (``search.widen: {rounds, factor}``, or ``healsweep refine DIR --widen``): cells whose
winning trial sits on the search-space boundary get more trials in a box that reaches past the edge they hit,
as a continuation of the same sweep (docs/methods.md#search).

"On the boundary" is the report's definition (analysis/findings.py ``edges``; the report tags such winners
``search_boundary``). Per grid, the round's box is the box the grid's boundary cells were searched in (a cell
widened before: its last widened box; several: their union) shifted by ``factor`` past the edges they hit
(``widened_box``: lr cap -> [lo·g, hi·g] with g = min(f, 10 / hi), 10 being the spec's lr bound; floor ->
[lo/f, hi/f]; epochs or steps cap -> up to hi·f; a grid whose box does not move gets no round), so the round
explores past the edge instead of resampling the old box. Each cell's Optuna study goes on in the new space
(same journal and study: TPE still sees the first round's trials). Each widened cell's study is brought to (its
most trials among the round's cells) + trials_per_cell trials: ``trials_per_cell`` more per cell when every cell
had the same count. Same sweep id, parent run, store and journal (``run_sweep(resume=True)``); targets and masks
are content-addressed and reused.

Recorded: sweep.json ``widenings`` (round, factor, cell id -> box; the report reads it to name the widened cells
and to judge their winners against the widened box), parent-run tags ``widen_rounds`` and ``widened_cells``
(comma-separated cell ids) and the artifact ``widen_<round>/cells.json``.
"""
from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

from orchestrator.lifecycle.continuation import RefineError, read_run
from orchestrator.lifecycle.resume import prepare_resume
from orchestrator.rundir.files import JOURNAL_FILE, lock_run_dir, write_sweep
from orchestrator.spec.checks import MAX_LR
from orchestrator.sweep.end import told_counts


def widened_box(bounds: dict, hit: set[str], factor: float, max_length: int, max_lr: float = MAX_LR) -> dict:
    """``bounds`` {"lr": [lo, hi], "epochs" | "steps": [lo, hi]} shifted by ``factor`` past the edges in ``hit``:
    lr cap -> [lo·g, hi·g] with g = min(f, max_lr / hi) (the spec's lr bound: a box at it stays); lr floor ->
    [lo/f, hi/f]; both -> [lo/f, hi·g]; epochs (steps) cap -> [min(hi, ceil(lo·f)), ceil(hi·f)] (at most
    ``max_length``). Edges not hit stay."""
    key = "steps" if bounds.get("steps") else "epochs"
    (lo, hi), (elo, ehi) = bounds["lr"], bounds[key]
    g = max(1.0, min(factor, max_lr / hi))  # rounds compounding past the cap: [x, 5] x 4 asked for lr 80
    cap, floor = "lr_cap" in hit, "lr_floor" in hit
    lr = [lo / factor if floor else lo * g if cap else lo, hi * g if cap else hi / factor if floor else hi]
    if "length_cap" in hit:
        elo, ehi = min(ehi, math.ceil(elo * factor)), min(max_length, math.ceil(ehi * factor))
    return {"lr": [float(x) for x in lr], key: [int(elo), int(ehi)]}


def union_box(boxes: list[dict]) -> dict:
    key = "steps" if boxes[0].get("steps") else "epochs"
    return {"lr": [min(b["lr"][0] for b in boxes), max(b["lr"][1] for b in boxes)],
            key: [min(b[key][0] for b in boxes), max(b[key][1] for b in boxes)]}


def plan_widening(run_dir: Path, factor: float) -> dict:
    """{"meta", "round", "cells": {cell id: grid}, "boxes": {grid: widened box}, "parent_run_id",
    "tracking_uri"}; ``cells`` is empty when no winner sits on the boundary."""
    from analysis.findings import edges
    from analysis.runs import grid_names, quoted_per_cell
    from analysis.search_space import search_bounds, widened_cells
    from orchestrator.spec.checks import MAX_EPOCHS, MAX_STEPS, MAX_WIDEN_FACTOR

    if not 1 < factor <= MAX_WIDEN_FACTOR:  # 1e300 ran a round of lr ~1e297 whose every trial failed
        raise RefineError(f"widen factor must be > 1 and <= {MAX_WIDEN_FACTOR:g}, got {factor:g}")
    meta, uri, info, trials = read_run(run_dir)
    best = quoted_per_cell(trials, info["objective"])  # the configuration the report quotes
    search, before = search_bounds(meta["spec"]), widened_cells(meta)
    cells, hits, current = {}, {}, {}
    for (_, row), grid in zip(best.iterrows(), grid_names(best)):
        box = before.get(row["cell_id"]) or search.get(grid) or search["main"]
        hit = set(edges(row, box))
        if hit:
            cells[row["cell_id"]] = grid
            hits.setdefault(grid, set()).update(hit)
            current.setdefault(grid, []).append({k: v for k, v in box.items() if k != "round"})
    boxes = {}
    for grid, hit in hits.items():
        base = union_box(current[grid])
        box = widened_box(base, hit, factor, MAX_STEPS if base.get("steps") else MAX_EPOCHS)
        if box != base:  # else every edge it hit is a bound of the spec's (lr 10, the longest healing): no round
            boxes[grid] = box
    cells = {c: grid for c, grid in cells.items() if grid in boxes}
    return {"meta": meta, "round": len(meta.get("widenings", [])) + 1, "cells": cells, "boxes": boxes,
            "parent_run_id": info["run_id"], "tracking_uri": uri}


def widen_spec(spec, plan: dict, existing: dict[str, int]):
    """The sweep's spec restricted to the widened cells (``SweepSpec.cells``), each grid searching its widened
    box; ``existing``: cell id -> trials its study holds already."""
    from orchestrator.spec.checks import MAX_REEVALUATE, MAX_TRIALS_PER_CELL

    def search_of(grid: str, base):
        box = plan["boxes"].get(grid)
        if box is None:  # no widened cell in this grid: its cells are filtered out anyway
            return {}
        have = max(existing.get(c, 0) for c, g in plan["cells"].items() if g == grid)
        key = "steps" if "steps" in box else "epochs"
        other = "epochs" if key == "steps" else "steps"
        # re-evaluations run again after the round, on the cell's winner then (the report counts only those that
        # repeat the final winner: analysis/reported.py)
        again = min(MAX_REEVALUATE, base.reevaluate * (plan["round"] + 1))
        return {"lr": tuple(box["lr"]), key: tuple(box[key]), other: None,
                "trials_per_cell": min(MAX_TRIALS_PER_CELL, have + base.trials_per_cell), "reevaluate": again}

    grids = []
    for g in spec.grids:
        gsearch = replace(spec.search, **dict(g.search))
        over = search_of(g.name, gsearch)
        grids.append(replace(g, search={**dict(g.search), **over}) if over else g)
    main = search_of("main", spec.search)
    return replace(spec, cells=tuple(plan["cells"]), grids=tuple(grids),
                   search=replace(spec.search, **main) if main else spec.search)


def round_spec(meta: dict, plan: dict, existing: dict[str, int]):
    """The widening round's spec: the sweep's spec with every sparsity its refinement rounds added (a widened cell
    may be a refined one: it was named widened and never ran), restricted to the round's cells (``widen_spec``)."""
    from orchestrator.spec import SpecError, parse_spec

    try:
        spec = parse_spec(meta["spec"])
    except SpecError as e:
        raise RefineError(f"sweep.json spec: {e}") from None
    refined = {float(x) for r in meta.get("refinements") or [] for x in r.get("sparsities") or []}
    if refined - set(spec.sparsities):  # the main grid's sweep-wide list: cells of other grids keep their own
        spec = replace(spec, sparsities=tuple(sorted(set(spec.sparsities) | refined)))
    return widen_spec(spec, plan, existing)


def study_sizes(journal: Path, cells) -> dict[str, int]:
    """cell id -> trials of its Optuna study (every state) in the sweep's journal."""
    from orchestrator.search import SEARCH, journal_cells, open_journal

    storage = open_journal(journal)
    ids = {c: st[SEARCH] for c, st in journal_cells(storage).items() if SEARCH in st}
    return {c: len(storage.get_all_trials(ids[c], deepcopy=False)) if c in ids else 0 for c in cells}


def run_widening(run_dir: Path, rounds: int = 1, factor: float = 4.0, *, address: str | None = None,
                 progress: bool = True, num_cpus: int | None = None, report: bool = True,
                 total: bool = False) -> list[dict]:
    """Up to ``rounds`` widening rounds (fewer when no winner is left on the boundary); rewrites the report.
    ``total``: ``rounds`` counts the rounds the sweep already ran (``search.widen`` of a resumed sweep: no round
    twice). -> one record per round run (what sweep.json ``widenings`` holds, plus the sweep result); the last
    one ``started: False`` (its result only) when a signal stopped the round before its trials."""
    from mlflow import MlflowClient

    from orchestrator.sweep.run import run_sweep

    run_dir, done = Path(run_dir), []
    if total:
        meta = json.loads((run_dir / "sweep.json").read_text(encoding="utf-8"))
        rounds -= len(meta.get("widenings") or [])
    for _ in range(rounds):
        plan = plan_widening(run_dir, factor)
        if not plan["cells"]:
            break
        spec = round_spec(plan["meta"], plan, study_sizes(run_dir / JOURNAL_FILE, plan["cells"]))
        lock_run_dir(run_dir)  # before its files are settled: no doctor --repair or second driver meanwhile
        prepare_resume(run_dir)  # damaged files: one line; torn last lines dropped; journal agrees with the record
        before = told_counts(run_dir / JOURNAL_FILE)  # the whole sweep's, so far
        res = run_sweep(spec, run_dir, Path(plan["meta"]["store"]), Path(plan["meta"]["cache"]), address=address,
                        progress=progress, report=False, num_cpus=num_cpus, resume=True)
        if res.interrupted is not None and not res.trials_planned:  # a signal before its trials: not recorded, so
            done.append({"round": plan["round"], "started": False, "result": res})  # the resume runs the round
            break
        rec = {"round": plan["round"], "factor": factor,
               "cells": {c: {**plan["boxes"][g]} for c, g in plan["cells"].items()},
               "trials_finished": res.trials_finished - before[0], "trials_failed": res.trials_failed - before[1]}
        meta = json.loads((run_dir / "sweep.json").read_text(encoding="utf-8"))  # run_sweep updated it
        meta.setdefault("widenings", []).append(rec)
        write_sweep(run_dir, meta)  # whole or not at all
        client = MlflowClient(res.tracking_uri or plan["tracking_uri"])
        every = sorted({c for w in meta["widenings"] for c in w["cells"]})
        # this round's (plan's came from before run_sweep, which settles stray parents); "" when a signal came first
        parent = res.parent_run_id or plan["parent_run_id"]
        client.set_tag(parent, "widen_rounds", str(plan["round"]))
        client.set_tag(parent, "widened_cells", ",".join(every)[:5000])
        client.log_text(parent, json.dumps(rec, indent=1), f"widen_{plan['round']}/cells.json")
        done.append({**rec, "result": res})
        if res.interrupted is not None:  # SIGINT/SIGTERM: no further round; the report below is marked partial
            break
    if report:
        from analysis.report import write_report

        paths = write_report(run_dir)
        for d in done:
            d["report"] = paths
    return done
