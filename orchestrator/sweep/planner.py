"""``store.targets``: whether each model's trials stream dense targets from the store or recompute them.

- ``store`` / ``recompute``: as the spec says (a store budget may still force recompute: orchestrator/sweep/dense.py).
- ``auto`` (default): on CPU trials the store, without a probe (a healing step costs about three forward passes
  and the reader overlaps it: recomputing adds a forward pass per step; benchmarks/gpu_check.py measures both on
  the CPU too). On GPU trials one Ray task per model, with a trial's resources, times a few real healing steps
  each way (tasks/healing/planner.py) on the GPU Ray gives it and picks the faster. The result is cached under
  ``<store dir>/planner/`` by model digest, calibration images (their digest covers size and preprocessing: a
  model entry's ``input_size``), GPU name, torch version, batch size, heal precision, compile, graph and
  channels_last, and store dtype (``probe_identity``), so a machine type is measured once per configuration.
"""
from __future__ import annotations

import json
import os
import platform
from pathlib import Path
from typing import Any, Mapping

from orchestrator.raytune.resources import ray_task, task_device, trial_device

CPU_REASON = "CPU trials: the store (a recompute adds a forward pass per step; no probe)"


def probe_identity(digest: str, calib_digest: str, device: str, torch_version: str, batch: int,
                   heal: Mapping[str, Any], dtype: str, scope: str) -> dict[str, Any]:
    """What a cached decision holds for: the model's weights, its calibration images (their size: a model entry's
    ``input_size`` changes the step's cost), the GPU, torch, and every setting that changes a step's cost (batch,
    heal.precision, heal.compile, heal.graph, heal.channels_last, store dtype, scope)."""
    return {"model_digest": digest, "calibration": calib_digest, "device": device, "torch": torch_version,
            "batch": batch, "precision": heal["precision"], "compile": heal["compile"], "graph": heal["graph"],
            "channels_last": heal["channels_last"], "dtype": dtype, "scope": scope}


def _probe_task(model: str, cache: str, data_seed: int, load_kw: dict, scope: str, batch: int, heal: dict,
                dtype: str, device_setting: str, digest: str, calib_digest: str, cache_dir: str) -> dict[str, Any]:
    """On the worker: the cached decision for this GPU, or a new measurement (then cached). ``heal``: precision,
    compile, graph and channels_last, as the trials run them."""
    import ray
    import torch

    from tasks.healing.planner import pick, time_target_modes
    from tasks.models import get_adapter, load_model
    from tasks.store import content_key
    from tasks.trial import memory_format, on_device

    device = task_device(device_setting, ray.get_gpu_ids())
    name = torch.cuda.get_device_name() if device == "cuda" else platform.processor() or "cpu"
    ident = probe_identity(digest, calib_digest, name, torch.__version__, batch, heal, dtype, scope)
    path = Path(cache_dir) / f"{content_key(ident)}.json"
    if path.exists():
        return {**json.loads(path.read_text()), "cached": True}
    lm = load_model(model, cache, data_seed=data_seed, progress=False, **load_kw)
    fmt = memory_format(heal["channels_last"], device, lm.model)  # as the trial lays its model and images out
    dense = lm.model.to(device, memory_format=fmt)
    images = on_device(lm.dataset["calibration"].images, device, fmt)
    secs = time_target_modes(dense, get_adapter(dense), scope, images, batch, precision=heal["precision"],
                             dtype=getattr(torch, dtype), compile=heal["compile"], graph=heal["graph"])
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
                               spec.heal.batch_size, heal_settings(spec.heal), spec.store.dtype, res.device,
                               models[m].digest, models[m].calib_digest, str(Path(store_dir) / "planner"))
                for m in probes}
        for m, ref in refs.items():
            out = ray.get(ref)
            modes[m] = out["pick"]
            decisions[m] = {**out, "why": "measured on " + out["device"] + (" (cached)" if out["cached"] else "")}
    return decisions


def heal_settings(heal) -> dict[str, Any]:
    """The spec's heal settings a probe runs with (and its cached decision is keyed by)."""
    return {"precision": heal.precision, "compile": heal.compile, "graph": heal.graph,
            "channels_last": heal.channels_last}


def decision_line(model: str, d: Mapping[str, Any]) -> str:
    """'vit_digits: store (measured on NVIDIA H100: store 0.012 s/step, recompute 0.015 s/step)'."""
    secs = d.get("seconds_per_step")
    timing = f": store {secs['store']:.4g} s/step, recompute {secs['recompute']:.4g} s/step" if secs else ""
    return f"{model}: {d['pick']} ({d['why']}{timing})"
