"""A tiny MLflow sweep for the transition report: parent run with an RR diagnostics artifact and trials for two
healers x two seeds x five sparsities with known bands. The report under test runs the real allocators
(tasks.pruning.allocation_math)."""
from __future__ import annotations

import json
import time

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


def diagnostics_frame(model: str) -> pd.DataFrame:
    rows = []
    for ly, shape in LAYERS.items():
        for s, r in zip(GRID, R[ly]):
            rows.append(dict(model=model, layer=ly, n_weights=np.int64(np.prod(shape)), shape=json.dumps(list(shape)),
                             sparsity=float(s), D_raw=1.0, D_repair=float(r), R=float(r)))
    return pd.DataFrame(rows)


def build_store(root, model: str = "resnet_digits", diagnostics: bool = True) -> dict:
    uri = f"sqlite:///{root / 'mlflow.db'}"
    client = MlflowClient(uri)
    exp = client.create_experiment("healsweep", artifact_location=(root / "art").as_uri())
    tags = {"sweep_id": SWEEP, "healsweep.role": "sweep"} | ({f"diagnostics_key.{model}": "k0"} if diagnostics else {})
    parent = client.create_run(exp, tags=tags, run_name="trans").info.run_id  # the tag: a sweep that logged them
    diag = root / f"{model}.parquet"
    if diagnostics:
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
    """The run directory's sweep.json, as a real sweep writes it (the parent run found by its sweep tag)."""
    client = MlflowClient(uri)
    exp = client.get_experiment_by_name("healsweep")
    parent = client.search_runs([exp.experiment_id], f"tags.sweep_id = '{SWEEP}' and tags.`healsweep.role` = 'sweep'")
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "sweep.json").write_text(json.dumps(
        {"sweep_id": SWEEP, "name": "trans", "tracking_uri": uri, "experiment": "healsweep", "spec": {},
         "parent_run_id": parent[0].info.run_id, "store": str(run_dir / "store"), "cache": str(run_dir / "models")}))
