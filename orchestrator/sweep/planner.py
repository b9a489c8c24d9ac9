"""``store.targets``: whether each model's trials stream dense targets from the store or recompute them.

- ``store`` / ``recompute``: as the spec says (a store budget may still force recompute: orchestrator/sweep/dense.py).
- ``auto`` (default): on CPU trials the store, without a probe (a healing step costs about three forward passes
  and the reader overlaps it: recomputing adds a forward pass per step; benchmarks/gpu_check.py measures both on
  the CPU too). On GPU trials one Ray task per model, with a trial's resources, times a few real healing steps
  each way (tasks/healing/planner.py) on the GPU Ray gives it and picks the faster. The result is cached under
  ``<store dir>/planner/`` by model digest, GPU name, torch version, batch size, precision and store dtype, so a
  machine type is measured once.
"""
from __future__ import annotations

import json
import os
import platform
from pathlib import Path
from typing import Any, Mapping

from orchestrator.raytune.resources import ray_task, task_device, trial_device

CPU_REASON = "CPU trials: the store (a recompute adds a forward pass per step; no probe)"


def _probe_task(model: str, cache: str, data_seed: int, load_kw: dict, scope: str, batch: int, precision: str,
                dtype: str, device_setting: str, digest: str, cache_dir: str) -> dict[str, Any]:
    """On the worker: the cached decision for this GPU, or a new measurement (then cached)."""
    import ray
    import torch

    from tasks.healing.planner import pick, time_target_modes
    from tasks.models import get_adapter, load_model
    from tasks.store import content_key

    device = task_device(device_setting, ray.get_gpu_ids())
    name = torch.cuda.get_device_name() if device == "cuda" else platform.processor() or "cpu"
    ident = {"model_digest": digest, "device": name, "torch": torch.__version__, "batch": batch,
             "precision": precision, "dtype": dtype, "scope": scope}
    path = Path(cache_dir) / f"{content_key(ident)}.json"
    if path.exists():
        return {**json.loads(path.read_text()), "cached": True}
    lm = load_model(model, cache, data_seed=data_seed, progress=False, **load_kw)
    dense = lm.model.to(device)
    secs = time_target_modes(dense, get_adapter(dense), scope, lm.dataset["calibration"].images, batch,
                             precision=precision, dtype=getattr(torch, dtype))
    out = {**ident, "pick": pick(secs), "seconds_per_step": secs}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(out, indent=1))
        os.replace(tmp, path)
    except OSError:  # a read-only or unshared store dir: measured again next time
        pass
    return {**out, "cached": False}


def plan_target_modes(spec, models: Mapping, modes: dict[str, str], cache: str, store_dir: Path
                      ) -> dict[str, dict[str, Any]]:
    """Update ``modes`` ({model: "store" | "recompute"}, the budget's) by ``store.targets``; -> {model: decision}
    (pick, why, and the probe's seconds per step when one ran)."""
    res, wanted = spec.resources, spec.store.targets
    decisions: dict[str, dict[str, Any]] = {}
    probes = {}
    for m in modes:
        if modes[m] == "recompute":
            decisions[m] = {"pick": "recompute", "why": "store.budget_gb (on_budget: recompute)"}
        elif wanted != "auto":
            modes[m] = wanted
            decisions[m] = {"pick": wanted, "why": f"store.targets: {wanted}"}
        elif trial_device(res) == "cpu":
            decisions[m] = {"pick": "store", "why": CPU_REASON}
        else:
            probes[m] = m
    if probes:
        import ray

        task = ray_task(_probe_task, res.cpus_per_trial, res.gpus_per_trial)
        refs = {m: task.remote(m, str(cache), spec.data_seed, spec.load_kwargs(m), models[m].scope,
                               spec.heal.batch_size, spec.heal.precision, spec.store.dtype, res.device,
                               models[m].digest, str(Path(store_dir) / "planner")) for m in probes}
        for m, ref in refs.items():
            out = ray.get(ref)
            modes[m] = out["pick"]
            decisions[m] = {**out, "why": "measured on " + out["device"] + (" (cached)" if out["cached"] else "")}
    return decisions


def decision_line(model: str, d: Mapping[str, Any]) -> str:
    """'vit_digits: store (measured on NVIDIA H100: store 0.012 s/step, recompute 0.015 s/step)'."""
    secs = d.get("seconds_per_step")
    timing = f": store {secs['store']:.4g} s/step, recompute {secs['recompute']:.4g} s/step" if secs else ""
    return f"{model}: {d['pick']} ({d['why']}{timing})"
