"""Does a search design keep a big cluster busy? A discrete-event simulation of the default sweep on N trial slots.

The real ``DesignSearcher`` (the Ray Tune adapter the sweep uses) is driven with a virtual clock: whenever a slot
is free the searcher is asked for a trial, and each trial "runs" for the duration its cell's trials took in a
finished sweep (``--from``: run directories; the median recorded ``trial_seconds`` of the model x healer at that
length, else a fit a + b x optimizer steps), then is told the objective that sweep measured at that configuration (the nearest
configuration tried in that cell when this design asks for one the recorded runs never tried; re-evaluations on
a new seed: the recorded re-evaluations' values in turn). Prints the share of slot-seconds busy from the first
trial's start to the last trial's end, the makespan and the trial count, for the spec as it is (``fixed``: the
authors' fixed trial count) and with ``search.converge`` (``converge``).

This is not a Ray run: Tune's own overheads (its 1 s wait when a searcher has nothing to suggest, scheduling
latency) are left out; what it measures is the design's waits (waves, re-evaluations after the search).
benchmarks/bench_slots_ray.py runs the same replay on a local Ray Tune (sleeping trials) and prints both figures.

    python benchmarks/bench_slots.py --from runs/retest/A runs/retest/B --slots 64
"""
from __future__ import annotations

import argparse
import ast
import heapq
import json
import math
import sys
import tempfile
from pathlib import Path

import numpy as np
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks._sweeps import REPO  # noqa: E402


def load_records(dirs: list[Path]) -> list[dict]:
    out = []
    for d in dirs:
        for line in (d / "trials.jsonl").read_text().splitlines():
            r = json.loads(line)
            if r.get("kind") == "trial" and r.get("mlflow", {}).get("metrics", {}).get("trial_seconds") is not None:
                out.append(r)
    return out


def cells_of(records: list[dict]) -> list[dict]:
    cells = {}
    for r in records:
        p = r["mlflow"]["params"]
        c = {"cell_id": r["cell_id"], "model": p["model"], "healer": p["healer"], "grid": p.get("grid", "main"),
             "healer_settings": ast.literal_eval(p.get("healer_settings") or "{}"), "pruner": p.get("pruner"),
             "calib_size": int(p["calib_size"]), "batch_size": int(p.get("batch_size", 32)), "seed": int(p["seed"]),
             "pattern": p.get("pattern", "")}
        cells.setdefault(r["cell_id"], c)
    return list(cells.values())


def steps_of(cfg: dict) -> float:
    if cfg.get("steps") is not None:
        return float(cfg["steps"])
    return float(cfg.get("epochs") or 0) * math.ceil(int(cfg["calib_size"]) / int(cfg.get("batch_size", 32)))


class Replay:
    """Durations and objective values of a finished sweep, for configurations it tried or their nearest."""

    def __init__(self, records: list[dict], per_cell: bool = False) -> None:
        self.per_cell = per_cell
        self.seen: dict[str, list[tuple[float, float, float, float]]] = {}  # cell -> (log lr, steps, value, secs)
        fits: dict[tuple, list[tuple[float, float]]] = {}
        self.again: dict[str, list[float]] = {}
        self.by_length: dict[tuple, list[float]] = {}
        self.dense: dict[str, float] = {}  # cell -> the dense model's selection accuracy its trials reported
        for r in records:
            p, m = r["mlflow"]["params"], r["mlflow"]["metrics"]
            if m.get("dense_selection_acc") is not None:
                self.dense[r["cell_id"]] = float(m["dense_selection_acc"])
            cfg = {**p, "steps": p.get("steps")}
            s = steps_of(cfg)
            fits.setdefault((p["model"], p["healer"]), []).append((s, float(m["trial_seconds"])))
            self.by_length.setdefault((p["model"], p["healer"], s), []).append(float(m["trial_seconds"]))
            hist = r["mlflow"].get("history", {}).get("selection_acc") or []
            m = {**m, "selection_acc": m.get("selection_acc", hist[-1][1] if hist else None)}
            if m["selection_acc"] is None:
                continue
            if p.get("heal_seed") is not None:  # a re-evaluation (``stage`` is a tag, not a param)
                self.again.setdefault(r["cell_id"], []).append(float(m["selection_acc"]))
            lr = float(p.get("lr") or 0)
            self.seen.setdefault(r["cell_id"], []).append(
                (math.log10(lr) if lr > 0 else 0.0, s, float(m["selection_acc"]), float(m["trial_seconds"])))
        self.fit = {}
        for k, v in fits.items():
            x, y = np.array(v).T
            b = np.polyfit(x, y, 1) if len(set(x)) > 1 else np.array([0.0, float(np.mean(y))])
            self.fit[k] = (float(b[1]), max(float(b[0]), 0.0))

    def duration(self, cfg: dict) -> float:
        """The median recorded duration of the model x healer's trials of this length (robust to the outliers a
        loaded 2-core machine adds); else the model x healer fit a + b x steps."""
        s = steps_of(cfg)
        if self.per_cell:  # --durations cell: the cell's own recorded trials of this length (outliers included)
            mine = [t[3] for t in self.seen.get(cfg["cell_id"], []) if t[1] == s]
            if mine:
                return sum(mine) / len(mine)
        same = self.by_length.get((cfg["model"], cfg["healer"], s))
        if same:
            return float(np.median(same))
        a, b = self.fit.get((cfg["model"], cfg["healer"]), (5.0, 0.1))
        return max(0.5, a + b * s)

    def result(self, cfg: dict) -> dict:
        """The final result a trial of ``cfg`` reports to Tune: the objective, and the dense model's selection
        accuracy when the recorded sweep logged it (converge's rule 0 reads it)."""
        top = {"dense_selection_acc": self.dense[cfg["cell_id"]]} if cfg["cell_id"] in self.dense else {}
        return {"selection_acc": self.value(cfg), "final": True, "epoch": cfg["epochs"], **top}

    def value(self, cfg: dict) -> float:
        seen = self.seen.get(cfg["cell_id"]) or [(0.0, 0.0, 0.5, 1.0)]
        lr = float(cfg.get("lr") or 0)
        x, s = (math.log10(lr) if lr > 0 else 0.0), steps_of(cfg)
        near = min(seen, key=lambda t: (abs(t[0] - x) / 0.25 + abs(math.log2(max(t[1], 1) / max(s, 1))), t))
        d = abs(near[0] - x) / 0.25 + abs(math.log2(max(near[1], 1) / max(s, 1)))
        v = near[2] - 0.005 * d  # an untried configuration: its nearest tried one, a little worse with distance
        if cfg.get("stage") == "reevaluate":
            again = self.again.get(cfg["cell_id"]) or [v]
            v = again[(int(cfg.get("heal_seed") or 0) // 1000) % len(again)] + (v - near[2])
        return v


def design_searcher(spec, cells: list[dict], journal: Path):
    """The sweep's searcher (``DesignSearcher``) over ``cells`` with the spec's per-grid budgets and, with
    search.calib_draws, its other draws: draw j holds the cells a draw can change whose grid re-evaluates more than j
    times (the sweep's ``redrawn_cell`` and ``cells_of_draw``), each marked with the draw's index only (the store and
    mask keys a real draw adds change nothing here), so closed-form cells heal once on each draw as in the sweep.
    Tells run at once."""
    from orchestrator.search import budget_of, make_searcher
    from orchestrator.search.records import redrawn_cell
    from orchestrator.spec.grids import MAIN, views
    from orchestrator.spec.plan import grid_searches

    grids = {g: budget_of(s) for g, s in grid_searches(spec).items()}
    budgets = {c["cell_id"]: grids.get(c["grid"], grids["main"]) for c in cells}
    most = {name: view.search.max_reevaluations for name, view in views(spec)}
    draws = [{c["cell_id"]: {"calib_draw": j} for c in cells if redrawn_cell(c) and most.get(c["grid"] or MAIN, 0) > j}
             for j in range(int(spec.search.calib_draws or 0))]
    return make_searcher(cells, budgets, spec.search.design or "shared", spec.search.sampler_seed, journal,
                         draws=draws)


def simulate(spec, records: list[dict], slots: int, per_cell: bool = False, cell_records=None) -> dict:
    """``records``: every recorded trial (values, durations); ``cell_records``: those whose cells are simulated
    (the first run directory: runs with shifted seeds hold other cells)."""
    replay, cells = Replay(records, per_cell), cells_of(cell_records or records)
    with tempfile.TemporaryDirectory() as tmp:
        s = design_searcher(spec, cells, Path(tmp) / "journal")
        t, live, busy, n, first, i = 0.0, [], 0.0, 0, None, 0
        while True:
            finished = False
            while len(live) < slots:
                cfg = s.suggest(f"t{i}")
                if cfg == "FINISHED":
                    finished = True
                    break
                if cfg is None:
                    break
                dur = replay.duration(cfg)
                heapq.heappush(live, (t + dur, i, cfg))
                busy, n, first, i = busy + dur, n + 1, t if first is None else first, i + 1
            if not live:
                if not finished:
                    raise RuntimeError("the design waits with nothing running")
                break
            t, k, cfg = heapq.heappop(live)
            s.on_trial_complete(f"t{k}", replay.result(cfg))
    span = t - (first or 0.0)
    return {"trials": n, "makespan_s": round(span, 1), "work_s": round(busy, 1),
            "busy_share": busy / (slots * span) if span else math.nan}


def main(argv=None) -> int:
    from orchestrator.spec import parse_spec

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--from", dest="runs", nargs="+", required=True,
                    help="finished run directories (trials.jsonl); the first one's cells are simulated")
    ap.add_argument("--spec", nargs="+", default=[f"converge={REPO / 'configs' / 'default.yaml'}"],
                    help="NAME=PATH: the specs (search settings) simulated, e.g. fixed=old.yaml converge=new.yaml")
    ap.add_argument("--slots", type=int, default=64)
    ap.add_argument("--durations", choices=["median", "cell"], default="median",
                    help="median: per model x healer x length (default); cell: the cell's own recorded trials")
    ap.add_argument("--out", default=None, help="write the figures as JSON here")
    a = ap.parse_args(argv)
    records = load_records([Path(d) for d in a.runs])
    res = {}
    for item in a.spec:
        name, path = item.split("=", 1)
        res[name] = r = simulate(parse_spec(yaml.safe_load(Path(path).read_text())), records, a.slots,
                                  a.durations == "cell", load_records([Path(a.runs[0])]))
        print(f"{name}: {r['trials']} trials ({r['work_s']:.0f} trial-seconds) on {a.slots} slots, makespan "
              f"{r['makespan_s']:.0f} s (simulated), "
              f"slots busy {100 * r['busy_share']:.1f} % from the first trial to the last", flush=True)
    if a.out:
        Path(a.out).write_text(json.dumps({"slots": a.slots, "runs": a.runs, "specs": a.spec, "durations": a.durations, **res}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
