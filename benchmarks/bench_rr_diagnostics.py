"""Cost of RR diagnostics (docs/methods.md#relative-repairability-crbn-rr) for the ResNet reference model, and how it
scales with layers × candidates.

Per layer: one dense forward to capture the layer's input (fixed cost), then per candidate sparsity one
pruned layer application, one CR (γ) and one BN re-estimation (per-candidate cost). The figures are in-process
and single-threaded (``tasks.pruning.rr.model_diagnostics``); ``--ray`` also times the cached Ray stage end to end
(model loading in every task included) on a fresh diagnostics root, then its rerun (must compute nothing).

    python benchmarks/bench_rr_diagnostics.py --cache .healsweep/models [--images 128] [--ray]
"""
from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

from tasks.models import get_adapter, load_model
from tasks.pruning.allocation_math import CANDIDATE_GRID
from tasks.pruning.rr import model_diagnostics


def timed(fn, repeats: int = 3) -> float:
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="resnet_digits")
    ap.add_argument("--cache", default=".healsweep/models")
    ap.add_argument("--images", type=int, default=128)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--ray", action="store_true", help="also time the cached Ray stage and its rerun")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    lm = load_model(a.model, a.cache, progress=False)
    entries = get_adapter(lm.model).scope(lm.model, "conv")
    images = lm.dataset["calibration"].images[: a.images]
    rows = []
    for n_layers in sorted({1, len(entries) // 2, len(entries)}):
        for n_cand in (1, 3, len(CANDIDATE_GRID)):
            grid = CANDIDATE_GRID[:n_cand]
            s = timed(lambda: model_diagnostics(lm.model, entries[:n_layers], images, grid))
            rows.append({"layers": n_layers, "candidates": n_cand, "seconds": round(s, 4)})
            print(json.dumps(rows[-1]), flush=True)
    # least squares: seconds ≈ a·layers + b·layers·candidates (per-layer forward + per-candidate work)
    X = torch.tensor([[r["layers"], r["layers"] * r["candidates"]] for r in rows], dtype=torch.float64)
    y = torch.tensor([r["seconds"] for r in rows], dtype=torch.float64)
    coef = torch.linalg.lstsq(X, y.unsqueeze(1)).solution.flatten()
    full = next(r for r in rows if r["layers"] == len(entries) and r["candidates"] == len(CANDIDATE_GRID))
    out = {"model": a.model, "layers": len(entries), "candidates": len(CANDIDATE_GRID), "images": a.images,
           "threads": a.threads, "full_seconds": full["seconds"], "per_layer_seconds": round(float(coef[0]), 5),
           "per_layer_candidate_seconds": round(float(coef[1]), 5)}
    if a.ray:
        out.update(ray_stage(a.model, a.cache, a.images))
    print(json.dumps(out, indent=1))


def ray_stage(model: str, cache: str, images: int) -> dict:
    import ray

    from orchestrator.sweep.diagnostics import diagnostics_stage
    from orchestrator.spec.plan import Cell
    from orchestrator.sweep.model_facts import ModelInfo

    lm = load_model(model, cache, progress=False)
    info = ModelInfo(model, lm.digest, 0.0, "conv", (), "0" * 32, lm.dataset.split_digest("calibration"))
    cells = [Cell(model, "rr", {"diag_images": images}, 0.9, "0.9", "conv", 256, "crbn", {}, 0, cell_id="c")]
    ray.init(include_dashboard=False, log_to_driver=False)
    try:
        with tempfile.TemporaryDirectory() as d:
            first = diagnostics_stage(cells, {model: info}, Path(d), Path(cache), 0)
            second = diagnostics_stage(cells, {model: info}, Path(d), Path(cache), 0)
    finally:
        ray.shutdown()
    return {"ray_stage_seconds": round(first.seconds, 3), "ray_layers_computed": first.computed_layers,
            "ray_rerun_seconds": round(second.seconds, 3), "ray_rerun_layers_computed": second.computed_layers}


if __name__ == "__main__":
    main()
