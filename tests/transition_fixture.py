"""A tiny MLflow sweep for the transition report: parent run with an RR diagnostics artifact, trials
for two healers x two seeds x five sparsities with known bands, and reference allocation solvers
(installed as ``tasks.allocation`` until the real module is merged)."""
from __future__ import annotations

import json
import sys
import time
import types

import numpy as np
import pandas as pd
from mlflow import MlflowClient
from mlflow.entities import Metric, Param

SWEEP = "sw-trans"
GRID = (0.70, 0.80, 0.85, 0.90, 0.925, 0.95, 0.975)
LAYERS = {"conv1.weight": (8, 1, 3, 3), "layer1.conv.weight": (16, 8, 3, 3), "fc.weight": (10, 16)}
# R per layer on GRID: the big conv repairs well until 0.9 then resists; non-monotone first layer
R = {"conv1.weight": (0.60, 0.55, 0.65, 0.70, 0.80, 0.90, 0.95),
     "layer1.conv.weight": (0.10, 0.12, 0.15, 0.20, 0.40, 0.70, 0.95),
     "fc.weight": (0.30, 0.35, 0.40, 0.45, 0.50, 0.60, 0.70)}
DENSE, N_EVAL = 0.9, 400
SPARS = (0.5, 0.7, 0.8, 0.9, 0.95)
HEALED = {"starfish": (0.88, 0.85, 0.70, 0.40, 0.12), "none": (0.86, 0.80, 0.13, 0.11, 0.10)}


def greedy_allocate(cost, sizes, grid, target):
    """Reference greedy (SPEC §5): promote the smallest q until the global sparsity reaches target."""
    k = {ly: 0 for ly in cost}
    total = sum(sizes.values())
    while sum(sizes[ly] * grid[k[ly]] for ly in cost) / total < target - 1e-12:
        cand = [((cost[ly][k[ly] + 1] - cost[ly][k[ly]]) / ((grid[k[ly] + 1] - grid[k[ly]]) * sizes[ly]), i, ly)
                for i, ly in enumerate(cost) if k[ly] + 1 < len(grid)]
        if not cand:
            break
        k[min(cand)[2]] += 1
    return {ly: float(grid[k[ly]]) for ly in cost}


def erk_sparsities(shapes, target, floor=0.025, cap=1.0):
    """Reference ERK by bisection on the scale: density = clip(c * sum(dims)/prod(dims), floor, cap)."""
    n = {ly: int(np.prod(s)) for ly, s in shapes.items()}
    raw = {ly: sum(s) / n[ly] for ly, s in shapes.items()}
    want = (1 - target) * sum(n.values())
    lo, hi = 0.0, 1e6
    for _ in range(200):
        c = (lo + hi) / 2
        kept = sum(n[ly] * min(cap, max(floor, c * raw[ly])) for ly in shapes)
        lo, hi = (c, hi) if kept < want else (lo, c)
    return {ly: 1 - min(cap, max(floor, lo * raw[ly])) for ly in shapes}


def install_reference_allocation(monkeypatch) -> None:
    mod = types.ModuleType("tasks.allocation")
    mod.greedy_allocate, mod.erk_sparsities = greedy_allocate, erk_sparsities
    monkeypatch.setitem(sys.modules, "tasks.allocation", mod)


def diagnostics_frame(model: str) -> pd.DataFrame:
    rows = []
    for ly, shape in LAYERS.items():
        for s, r in zip(GRID, R[ly]):
            rows.append(dict(model=model, layer=ly, n_weights=np.int64(np.prod(shape)), shape=json.dumps(list(shape)),
                             sparsity=float(s), D_raw=1.0, D_repair=float(r), R=float(r)))
    return pd.DataFrame(rows)


def build_store(root, model: str = "resnet_digits") -> dict:
    uri = f"sqlite:///{root / 'mlflow.db'}"
    client = MlflowClient(uri)
    exp = client.create_experiment("healsweep", artifact_location=(root / "art").as_uri())
    parent = client.create_run(exp, tags={"sweep_id": SWEEP, "healsweep.role": "sweep",
                                          f"diagnostics_key.{model}": "k0"}, run_name="trans").info.run_id
    diag = root / f"{model}.parquet"
    diagnostics_frame(model).to_parquet(diag)
    client.log_artifact(parent, str(diag), "diagnostics")
    ids = {}
    ts = int(time.time() * 1000)
    for healer, accs in HEALED.items():
        for s, acc in zip(SPARS, accs):
            for seed, d in ((0, -0.01), (1, 0.01)):
                cell = f"{healer}-{s}-{seed}"
                run = client.create_run(exp, run_name=cell, tags={
                    "mlflow.parentRunId": parent, "sweep_id": SWEEP, "cell_id": cell, "trial_id": "t0",
                    "healsweep.role": "trial", "pattern": str(s)})
                rid = run.info.run_id
                params = dict(model=model, pruner="magnitude", scope="conv", sparsity=str(s), calib_size="64",
                              healer=healer, granularity="example", seed=str(seed), lr="1e-3", epochs="2",
                              batch_size="32")
                h = acc + d
                final = dict(dense_acc=DENSE, pruned_acc=0.1, healed_acc=h, retention=h / DENSE, heal_seconds=1.0,
                             achieved_sparsity=s, selection_acc=h, n_eval=N_EVAL, num_classes=10)
                client.log_batch(rid, params=[Param(k, v) for k, v in params.items()],
                                 metrics=[Metric(k, float(v), ts, 2) for k, v in final.items()])
                client.set_terminated(rid, "FINISHED")
                ids[cell] = rid
    return {"uri": uri, "parent": parent, "ids": ids, "exp": exp}


def write_sweep_json(run_dir, uri: str) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "sweep.json").write_text(json.dumps(
        {"sweep_id": SWEEP, "name": "trans", "tracking_uri": uri, "experiment": "healsweep", "spec": {}}))
