"""The dense stage's compute (orchestrator/sweep/dense.py decides what is missing): Ray tasks over runs of missing
target shards (one shard per CPU task, several per GPU task; the model loaded once per worker process), the same
shards in this process when the work is small, a calibration row's dataset index and bytes. Imports torch and the
models; dense.py imports this module only when a key lacks shards or a store budget is priced, so the dense stage
over a warm store imports neither."""
from __future__ import annotations

import json
from pathlib import Path

import ray
import torch
from tqdm.auto import tqdm

from orchestrator.raytune.resources import ray_task, task_device, task_gpus
from tasks.data import load_dataset, redraw_calibration
from tasks.healing import dense_targets
from tasks.models import MODELS, get_adapter, load_model, load_model_shared
from tasks.store import TargetStore

# Dense work up to this many (images x model parameters) runs in the driver: starting tasks (a process and a
# model load each, seconds) costs more than the forward passes themselves (128 images of vit_digits: 0.03 s).
LOCAL_MAX_IMAGE_PARAMS = 5e9
DENSE_BATCH = {"cpu": 64, "cuda": 256}  # images per forward pass of a dense task (a GPU wants larger batches)
_LOADED: dict = {}  # per worker process: the last model a dense task loaded (Ray reuses worker processes)


def _loaded(model: str, cache_dir: str, data_seed: int, load_kw: dict, device: str):
    """(model, calibration images, blocks, loaded now?) of ``model``, loaded once per process (one model kept)."""
    k = (model, cache_dir, data_seed, json.dumps(load_kw, sort_keys=True, default=str), device)
    fresh = k not in _LOADED
    if fresh:
        _LOADED.clear()
        lm = load_model(model, cache_dir, data_seed=data_seed, progress=False, **load_kw)  # kept here, on its device
        lm.model.to(device)
        _LOADED[k] = (lm.model, lm.dataset["calibration"].images, get_adapter(lm.model).blocks(lm.model))
    return (*_LOADED[k], fresh)


def dense_shard(store_uri: str, key: str, index: int, start: int, stop: int, dtype: str, model: str,
                cache_dir: str, data_seed: int, threads: int, load_kw: dict, device_setting: str = "auto"
                ) -> tuple[dict, str, bool]:
    """Calibration rows [start, stop) of ``model`` written as one shard, with the model loaded once per process
    (``_loaded``). -> (shard info, Ray node id, whether this call loaded the model)."""
    torch.set_num_threads(max(1, threads))
    device = task_device(device_setting, ray.get_gpu_ids())  # a GPU only when the task was given one
    net, images, blocks, fresh = _loaded(model, cache_dir, data_seed, load_kw or {}, device)
    targets = dense_targets(net, blocks, images[start:stop].to(device), dtype=getattr(torch, dtype),
                            batch_size=DENSE_BATCH[device])
    info = TargetStore(store_uri).write_shard(key, index, start, {k: v.cpu() for k, v in targets.items()})
    return info, ray.get_runtime_context().get_node_id(), fresh


def dense_shard_run(store_uri: str, key: str, shards: list[tuple[int, int, int]], *args):
    """One Ray task (a generator: each shard is reported as soon as it is written) over a run of shards. Tasks,
    not a fixed actor pool, so queued runs go to whatever node has room, including nodes that join mid-stage. A
    CPU task's run is one shard (its worker process is reused and keeps the model); a GPU task's worker exits
    after it (orchestrator/raytune/resources.py ``ray_task``), so a GPU run is several shards (``shard_runs``)
    and loads the model, and reads its dataset, once for all of them."""
    for index, start, stop in shards:
        yield dense_shard(store_uri, key, index, start, stop, *args)


def shard_runs(plan: list[tuple[int, int, int]], slots: int) -> list[list[tuple[int, int, int]]]:
    """``plan`` cut into runs of consecutive shards: one shard each without GPU slots (``slots`` 0), else at most
    2 x ``slots`` runs of near-equal length (twice the slots: a node joining mid-stage still finds runs queued)."""
    if slots < 1:
        return [[p] for p in plan]
    n = min(len(plan), 2 * slots)
    cuts = [i * len(plan) // n for i in range(n + 1)] if n else [0]
    return [plan[a:b] for a, b in zip(cuts, cuts[1:])]


def gpu_slots(gpus: float) -> int:
    """How many dense tasks asking for ``gpus`` each the cluster's GPUs hold at once now (0 without a request)."""
    if gpus <= 0:
        return 0
    return max(1, int(ray.cluster_resources().get("GPU", 0) / gpus + 1e-9))


def run_shards(plan, *, in_driver: bool | None, n_rows: int, **kw):
    """Called by ensure_targets only when shards are missing: small work in this process, else Ray tasks."""
    local = in_driver
    if local is None:
        spec = kw["spec"]
        lm = load_model_shared(kw["model"], kw["cache_dir"], data_seed=spec.data_seed, progress=False,
                        **spec.load_kwargs(kw["model"]))
        size = n_rows * sum(p.numel() for p in lm.model.parameters())
        local = task_gpus(spec.resources) == 0 and size <= LOCAL_MAX_IMAGE_PARAMS
    yield from (_local_shards if local else _task_shards)(plan, **kw)


def _local_shards(plan, *, spec, model, key, store_uri, cache_dir, cpus, max_workers, progress, report):
    """The shards of ``plan`` computed one after another in this process (same code as ``dense_shard``)."""
    lm = load_model_shared(model, cache_dir, data_seed=spec.data_seed, progress=False, **spec.load_kwargs(model))
    blocks, images, store = get_adapter(lm.model).blocks(lm.model), lm.dataset["calibration"].images, \
        TargetStore(store_uri)
    threads = torch.get_num_threads()
    torch.set_num_threads(max(1, int(spec.resources.cpus_per_dense_task)))  # as a dense task: same numbers
    try:
        with tqdm(total=sum(b - a for _, a, b in plan), desc=f"dense targets {model} (in-process)", unit="img",
                  disable=not progress, leave=False) as bar:
            for index, start, stop in plan:
                targets = dense_targets(lm.model, blocks, images[start:stop], dtype=getattr(torch, spec.store.dtype))
                shard = store.write_shard(key, index, start, targets)
                bar.update(stop - start)
                yield shard
    finally:
        torch.set_num_threads(threads)


def _task_shards(plan, *, spec, model, key, store_uri, cache_dir, cpus, max_workers, progress, report):
    """The shards of ``plan`` as Ray tasks (``dense_shard_run``): every run is queued at once (at most
    ``max_workers`` in flight when given), so the stage uses every node present while it runs and an autoscaler
    sees the demand; shards come back in completion order, each as soon as it is written."""
    per_task, gpus = spec.resources.cpus_per_dense_task, task_gpus(spec.resources)
    task = ray_task(dense_shard_run, per_task, gpus)  # on a GPU, a worker process per task (ray_task)
    args = (spec.store.dtype, model, str(cache_dir), spec.data_seed, max(1, int(per_task)), spec.load_kwargs(model),
            spec.resources.device)
    todo, running = shard_runs(list(plan), gpu_slots(gpus)), []
    limit = max_workers or len(todo)
    with tqdm(total=sum(b - a for _, a, b in plan), desc=f"dense targets {model} (Ray tasks)", unit="img",
              disable=not progress, leave=False) as bar:
        while todo or running:
            while todo and len(running) < limit:
                running.append(task.remote(store_uri, key, todo.pop(0), *args))
            ready, running = ray.wait(running, num_returns=1)
            try:
                ref = next(ready[0])  # the run's next shard (ready), or its end
            except StopIteration:
                continue
            running.append(ready[0])
            shard, node, fresh = ray.get(ref)
            report.nodes[node] = report.nodes.get(node, 0) + 1
            report.loads[model] = report.loads.get(model, 0) + fresh
            bar.update(shard["row_stop"] - shard["row_start"])
            yield shard


def calibration_rows(model: str, cache_dir: Path, data_seed: int, load_kw: dict | None = None) -> list[int]:
    """Dataset index of each calibration item (row i of the store = calibration item i). A reference model's
    dataset (shipped weights or a checkpoint) is loaded without the model (no timm import): the same splits
    load_model gives it. An external model (timm, torchvision, checkpoint) is loaded as its spec entry says
    (``load_kw``: ``spec.load_kwargs(model)``): its dataset is the spec's, preprocessed its way."""
    source = (load_kw or {}).get("source") or {}
    if model in MODELS and source.get("source", "reference") == "reference":
        data = redraw_calibration(load_dataset(MODELS.get(model).dataset, seed=data_seed),
                                  (load_kw or {}).get("calib_seed", 0))
    else:
        data = load_model_shared(model, cache_dir, data_seed=data_seed, progress=False, **(load_kw or {})).dataset
    return [int(i) for i in data["calibration"].indices]


def row_bytes(model: str, cache_dir: Path, data_seed: int, dtype: str, load_kw: dict | None = None) -> int:
    """Bytes of one calibration row of dense targets (every block + logits)."""
    lm = load_model_shared(model, cache_dir, data_seed=data_seed, progress=False, **(load_kw or {}))
    t = dense_targets(lm.model, get_adapter(lm.model).blocks(lm.model), lm.dataset["calibration"].images[:1],
                      dtype=getattr(torch, dtype))
    return sum(v[0].numel() * v.element_size() for v in t.values())
