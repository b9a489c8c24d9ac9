"""RR diagnostics of a sweep (read back from MLflow artifacts) -> RR curves, allocations, CTS.

Contract (written by the sweep): the parent run holds ``diagnostics/<model>.parquet`` with columns
model, layer, n_weights, shape (JSON list), sparsity (candidate grid), D_raw, D_repair, R.
Allocations come from ``tasks.allocation_rules`` (numbers alone, no torch): RR = greedy on R, ERK from the layer
shapes. LAMP needs the weights, which the analysis side never loads: the sweep logs LAMP's per-layer allocations
at the CTS targets as ``diagnostics/<model>.lamp.json`` ({target "0.9500": {layer: s}}), read back here.
"""
from __future__ import annotations

import json
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
from mlflow.tracking import MlflowClient

from .cts import CTSSettings, compute_cts
from tasks.allocation_rules import erk_sparsities, greedy_allocate

__all__ = ["RRCurves", "curves_from_frame", "load_diagnostics", "load_lamp", "allocations", "model_cts", "jrr_table"]

DIAG_DIR = "diagnostics"
DIAG_COLUMNS = ("model", "layer", "n_weights", "shape", "sparsity", "D_raw", "D_repair", "R")


@dataclass(frozen=True)
class RRCurves:
    model: str
    layers: list[str]  # in table order (the model's parameter order)
    grid: list[float]  # ascending candidate sparsities
    r: np.ndarray  # (L, K) R_ℓ(s_k)
    sizes: dict[str, int]
    shapes: dict[str, tuple[int, ...]]


def curves_from_frame(df: pd.DataFrame) -> RRCurves:
    """One model's diagnostics table -> RR matrix; every layer must cover the same grid."""
    missing = [c for c in DIAG_COLUMNS if c not in df.columns]
    if missing:
        raise ValueError(f"diagnostics: missing columns {missing}")
    models = df["model"].unique().tolist()
    if len(models) != 1:
        raise ValueError(f"diagnostics: expected one model, got {models}")
    layers = list(dict.fromkeys(df["layer"].tolist()))
    grid = sorted({float(x) for x in df["sparsity"]})
    piv = df.pivot_table(index="layer", columns="sparsity", values="R", aggfunc="mean")
    piv = piv.reindex(index=layers, columns=grid)
    if piv.isna().any().any():
        raise ValueError("diagnostics: some layer lacks R at some grid sparsity")
    first = df.drop_duplicates("layer").set_index("layer")
    sizes = {ly: int(first.loc[ly, "n_weights"]) for ly in layers}
    shapes = {ly: tuple(int(v) for v in json.loads(first.loc[ly, "shape"])) for ly in layers}
    return RRCurves(str(models[0]), layers, grid, piv.to_numpy(dtype=np.float64), sizes, shapes)


def load_diagnostics(tracking_uri: str, parent_run_id: str | None) -> dict[str, pd.DataFrame]:
    """``{model: diagnostics frame}`` from the parent run's ``diagnostics/`` artifacts ({} if none)."""
    if not parent_run_id:
        return {}
    client = MlflowClient(tracking_uri)
    try:
        arts = client.list_artifacts(parent_run_id, DIAG_DIR)
    except Exception:  # noqa: BLE001 - no artifact repository / nothing logged: no diagnostics
        return {}
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        for a in arts:
            if a.is_dir or not a.path.endswith(".parquet"):
                continue
            local = client.download_artifacts(parent_run_id, a.path, tmp)
            df = pd.read_parquet(local)
            out[Path(a.path).stem if df.empty else str(df["model"].iloc[0])] = df
    return out


def load_lamp(tracking_uri: str, parent_run_id: str | None) -> dict[str, dict[float, dict[str, float]]]:
    """``{model: {target: {layer: sparsity}}}`` from the parent run's ``diagnostics/*.lamp.json`` ({} if none)."""
    if not parent_run_id:
        return {}
    client = MlflowClient(tracking_uri)
    try:
        arts = client.list_artifacts(parent_run_id, DIAG_DIR)
    except Exception:  # noqa: BLE001 - nothing logged
        return {}
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        for a in arts:
            if a.path.endswith(".lamp.json"):
                raw = json.loads(Path(client.download_artifacts(parent_run_id, a.path, tmp)).read_text())
                out[Path(a.path).name[: -len(".lamp.json")]] = {float(t): al for t, al in raw.items()}
    return out


def jrr_table(c: RRCurves, lamp: dict[float, dict[str, float]], targets) -> list[dict[str, float]]:
    """J_RR of the RR, ERK and LAMP allocations at each target (LAMP where the sweep logged it)."""
    from .cts import j_rr

    cost = {ly: c.r[i].tolist() for i, ly in enumerate(c.layers)}
    rows = []
    for t in targets:
        row = {"target": float(t),
               "RR": j_rr(c.r, c.grid, c.layers, greedy_allocate(cost, c.sizes, c.grid, _reachable(c, t))),
               "ERK": j_rr(c.r, c.grid, c.layers, erk_sparsities(c.shapes, t))}
        key = min(lamp, key=lambda x: abs(x - t), default=None)
        if key is not None and abs(key - t) < 1e-9:
            row["LAMP"] = j_rr(c.r, c.grid, c.layers, lamp[key])
        rows.append(row)
    return rows


def _reachable(c: RRCurves, target: float) -> float:
    """The target, capped at the global sparsity of every layer at the top of the grid (float-exact)."""
    top = sum(n * c.grid[-1] for n in c.sizes.values()) / sum(c.sizes.values())
    return min(float(target), top)


def allocations(c: RRCurves, target: float) -> dict[str, dict[str, float]]:
    """``{"RR": {layer: s}, "ERK": {layer: s}}`` at a global target sparsity."""
    cost = {ly: c.r[i].tolist() for i, ly in enumerate(c.layers)}
    return {"RR": dict(greedy_allocate(cost, c.sizes, c.grid, _reachable(c, target))),
            "ERK": dict(erk_sparsities(c.shapes, _reachable(c, target)))}


def model_cts(c: RRCurves, st: CTSSettings = CTSSettings()) -> dict:
    """CTS of one model (targets restricted to the grid's range, where greedy RR is defined)."""
    cost = {ly: c.r[i].tolist() for i, ly in enumerate(c.layers)}
    targets = tuple(x for x in st.targets if c.grid[0] <= x <= c.grid[-1] + 1e-12)
    st = CTSSettings(**{**st.to_dict(), "targets": targets})
    out = compute_cts(c.r, c.grid, c.layers,
                      lambda x: greedy_allocate(cost, c.sizes, c.grid, _reachable(c, x)),
                      lambda x: erk_sparsities(c.shapes, x), st)
    out["model"] = c.model
    return out
