"""Fractional GPUs through Ray Tune, on a CPU machine: Ray's logical GPU resources (one "GPU" on a local instance)
pack trials by ``resources.gpus_per_trial`` while ``resources.device: cpu`` makes them compute on the CPU. With a
quarter of a GPU each, four trials run at once and never five; with half, two. Dense-target and mask tasks ask for
the GPU share too (placement only here). Measured from each trial's own clock: [finished_at - trial_seconds,
finished_at], read back from MLflow. The trials heal with ``heal.graph: step`` (the optimizer of a captured step;
nothing to capture on the CPU), logged as the param ``graph``."""
from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

import pytest
from mlflow import MlflowClient

from orchestrator.spec import parse_spec
from orchestrator.sweep.run import run_sweep

REPO = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.e2e, pytest.mark.timeout(420)]
SPEC = {"name": "packing", "models": ["vit_digits"], "sparsities": [0.5, 0.9], "calib_sizes": [64, 128],
        "pruners": ["magnitude"], "healers": ["starfish"],
        "search": {"trials_per_cell": 3, "lr": [1e-3, 3e-3], "epochs": [6, 8], "reevaluate": 0},
        "heal": {"graph": "step"},
        "resources": {"cpus_per_trial": 0.25, "cpus_per_dense_task": 0.5, "gpus_per_dense_task": 0.25,
                      "device": "cpu"}}


def max_overlap(intervals: list[tuple[float, float]]) -> int:
    """Most intervals open at one instant (an interval's end before another's start at the same time)."""
    events = sorted([(a, 1) for a, _ in intervals] + [(b, -1) for _, b in intervals], key=lambda e: (e[0], e[1]))
    best = now = 0
    for _, step in events:
        now += step
        best = max(best, now)
    return best


def test_max_overlap():
    assert max_overlap([(0, 2), (1, 3), (2.5, 4)]) == 2 and max_overlap([(0, 1), (1, 2)]) == 1


def _intervals(run_dir: Path) -> tuple[list[tuple[float, float]], set[tuple[str, str]]]:
    c = MlflowClient(f"sqlite:///{run_dir / 'mlflow.db'}")
    runs = c.search_runs([e.experiment_id for e in c.search_experiments()], "tags.`healsweep.role` = 'trial'")
    iv = [(r.data.metrics["finished_at"] - r.data.metrics["trial_seconds"], r.data.metrics["finished_at"]) for r in runs]
    return iv, {(r.data.params["device"], r.data.params["graph"]) for r in runs}


@pytest.mark.parametrize("share,most", [(0.25, 4), (0.5, 2)])
def test_trials_pack_by_their_gpu_share(tmp_path, share, most):
    import ray

    cache = Path(os.environ.get("HEALSWEEP_TEST_CACHE", REPO / ".healsweep" / "models"))
    spec = parse_spec(SPEC)
    spec = replace(spec, resources=replace(spec.resources, gpus_per_trial=share))
    ray.init(address="local", num_cpus=2, num_gpus=1, include_dashboard=False, log_to_driver=False)
    try:
        res = run_sweep(spec, tmp_path / "run", tmp_path / "store", cache, progress=False, report=False)
    finally:
        ray.shutdown()
    assert res.trials_finished == 12 and res.trials_failed == 0
    iv, devices = _intervals(tmp_path / "run")
    assert len(iv) == 12 and devices == {("cpu", "step")}
    got = max_overlap(iv)
    assert got <= most  # Ray never placed more trials than the logical GPU holds
    assert got >= most - (1 if most > 2 else 0), f"only {got} trials ran at once with a GPU share of {share}"


def _worker() -> tuple[int, list]:
    import ray

    return os.getpid(), list(ray.get_gpu_ids())


@pytest.mark.timeout(180)
def test_a_task_given_a_gpu_runs_in_a_worker_of_its_own():
    """orchestrator/raytune/resources.py ``ray_task``: a task given a (logical) GPU runs in a fresh worker process,
    which exits after it (a reused one would keep its CUDA context and the GPU its CUDA first saw); a CPU task's
    worker is reused. One task at a time, each waited for, so that an idle worker is always there to be reused."""
    import ray

    from orchestrator.raytune.resources import ray_task

    # address="local": a new instance even while another test's cluster runs on this machine (ray.init() alone
    # would join that one, and refuse num_cpus)
    ray.init(address="local", num_cpus=2, num_gpus=1, include_dashboard=False, log_to_driver=False)
    try:
        gpu = [ray.get(ray_task(_worker, 1, 0.5).remote()) for _ in range(4)]
        cpu = [ray.get(ray_task(_worker, 1, 0).remote()) for _ in range(4)]
    finally:
        ray.shutdown()
    assert len({pid for pid, _ in gpu}) == 4 and all(ids == [0] for _, ids in gpu), gpu
    assert len({pid for pid, _ in cpu}) <= 2 and all(ids == [] for _, ids in cpu), cpu
