"""Resource overrides from the command line: run a GPU spec on a CPU-only machine without editing it."""
from __future__ import annotations

import math
from dataclasses import replace

from orchestrator.spec import SpecError, SweepSpec

KEYS = {"cpu": "cpus_per_trial", "gpu": "gpus_per_trial", "dense_cpu": "cpus_per_dense_task",
        "dense_gpu": "gpus_per_dense_task"}


def parse_override(text: str) -> dict[str, float]:
    """'cpu=1,gpu=0' -> {"cpus_per_trial": 1.0, "gpus_per_trial": 0.0}."""
    out = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        k, sep, v = part.partition("=")
        if not sep or k.strip() not in KEYS:
            raise SpecError("--resources", f"expected KEY=NUMBER with KEY in {', '.join(KEYS)}, got {part!r}")
        try:
            x = float(v)
        except ValueError:
            raise SpecError("--resources", f"{k.strip()} must be a number, got {v[:40]!r}") from None
        if not math.isfinite(x) or x > 1e6:
            raise SpecError("--resources", f"{k.strip()}={v[:40]} is not a finite number <= 1e6")
        if x < 0 or (k.strip() in ("cpu", "dense_cpu") and x == 0) or (x > 1 and x != int(x) and "gpu" in k):
            raise SpecError("--resources", f"{k.strip()}={v} is not allowed (cpu > 0; gpu a fraction < 1 or whole)")
        out[KEYS[k.strip()]] = x
    return out


def override_resources(spec: SweepSpec, text: str | None = None, cpu_only: bool = False) -> SweepSpec:
    """The spec with its resources overridden; ``cpu_only`` zeroes every GPU request and makes a ``device: cuda``
    spec compute on the CPU (every task runs there). SpecError for an override that leaves ``device: cuda`` with no
    GPU per trial (the spec's own check refuses the same)."""
    changes = parse_override(text) if text else {}
    if cpu_only:
        changes.update(gpus_per_trial=0.0, gpus_per_dense_task=0.0)
        if spec.resources.device == "cuda":
            changes["device"] = "cpu"
    elif changes.get("gpus_per_trial") == 0 and spec.resources.device == "cuda":
        raise SpecError("--resources", "gpu=0 leaves the spec's resources.device cuda without a GPU per trial; "
                                       "use --cpu-only to run every task on the CPU")
    return replace(spec, resources=replace(spec.resources, **changes)) if changes else spec


# ------------------------------------------------------------------------------------------ devices
def trial_device(res) -> str:
    """The device every trial computes on (``resources.device``): cuda when asked, or under auto when a trial asks
    Ray for GPUs (Ray then sets CUDA_VISIBLE_DEVICES to the GPU it gave, shared when the request is a fraction)."""
    if res.device == "cuda" or (res.device == "auto" and res.gpus_per_trial > 0):
        return "cuda"
    return "cpu"


def task_gpus(res) -> float:
    """GPUs per dense-target, mask or diagnostics task: the dense tasks' request, else the trials' (a GPU spec
    computes its dense targets and masks on a GPU too); none when every device is the CPU."""
    if res.device == "cpu":
        return res.gpus_per_dense_task
    return res.gpus_per_dense_task or res.gpus_per_trial


def task_device(setting: str, gpu_ids) -> str:
    """Inside a Ray task: cuda when the task was given a GPU (``ray.get_gpu_ids()``) and ``resources.device`` is
    not cpu; else cpu."""
    return "cuda" if setting != "cpu" and len(gpu_ids) > 0 else "cpu"


_REMOTE: dict = {}  # (function, given a GPU) -> its Ray remote function, made once per process


def ray_task(fn, cpus: float, gpus: float):
    """``fn`` as a Ray task asking for ``cpus`` and ``gpus``. A task given a GPU runs in a worker process of its own,
    which exits after it (``max_calls=1``: Ray's default for ``@ray.remote(num_gpus=...)``, which ``.options(num_gpus=
    ...)`` on a function made remote without GPUs does not carry: ``max_calls`` is fixed when the function is made
    remote). A reused worker would keep its CUDA context, the model and the allocator's cache on the GPU the trials
    use, and on a node with several GPUs compute on the GPU its CUDA first saw, not the one Ray now gives it (CUDA
    reads ``CUDA_VISIBLE_DEVICES`` once). CPU tasks reuse their workers (a warm worker skips the imports)."""
    import ray

    key = (fn, gpus > 0)
    if key not in _REMOTE:
        _REMOTE[key] = ray.remote(max_calls=1)(fn) if gpus > 0 else ray.remote(fn)
    return _REMOTE[key].options(num_cpus=cpus, num_gpus=gpus)
