"""The dense stage's paths write the same store: small work in the driver, real sizes on Ray tasks (CPU or GPU)."""
from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

import pytest

from orchestrator.sweep.dense import DenseReport, dense_stage
from orchestrator.sweep.dense_work import LOCAL_MAX_IMAGE_PARAMS
from orchestrator.spec import load_spec
from orchestrator.sweep.stages import prepare_models
from tasks.models import load_model
from tasks.store import TargetStore

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.e2e


def test_driver_cpu_task_and_gpu_task_dense_paths_write_identical_shards(tmp_path):
    """Eight shards of 16 rows, written in the driver, by CPU tasks (one shard each; workers reused, so fewer model
    loads than shards) and by tasks asking for half of a logical GPU (computing on the CPU: ``device: cpu``): two GPU
    slots, so four runs of two shards, each run one task and one model load (its worker exits after it)."""
    import ray

    cache = Path(os.environ.get("HEALSWEEP_TEST_CACHE", REPO / ".healsweep" / "models"))
    spec = load_spec(REPO / "configs" / "tiny.yaml")
    spec = replace(spec, store=replace(spec.store, shard_size=16))
    gpu_spec = replace(spec, resources=replace(spec.resources, gpus_per_dense_task=0.5, device="cpu"))
    models = prepare_models(spec, cache, progress=False)
    rows = {"vit_digits": 128}
    n_params = sum(p.numel() for p in load_model("vit_digits", cache, progress=False).model.parameters())
    assert 128 * n_params <= LOCAL_MAX_IMAGE_PARAMS  # the default picks the driver for this size
    ray.init(address="local", num_cpus=2, num_gpus=1, include_dashboard=False, log_to_driver=False)
    try:
        out, loads = {}, {}
        for name, sp, in_driver in (("driver", spec, True), ("cpu_tasks", spec, False), ("gpu_tasks", gpu_spec, False)):
            rep = DenseReport()
            done = dense_stage(sp, models, rows, tmp_path / name, cache, progress=False, report=rep,
                               in_driver=in_driver)
            assert done == {"vit_digits": 128} and rep.shards == {"vit_digits": 8}
            key_dir = tmp_path / name / models["vit_digits"].store_key
            out[name] = {p.name: p.read_bytes() for p in sorted(key_dir.glob("shard-*"))}
            loads[name] = rep.loads.get("vit_digits", 0)
        assert sorted(out["driver"]) == [f"shard-{i:05d}.{ext}" for i in range(8) for ext in ("arrow", "json")]
        assert out["driver"] == out["cpu_tasks"] == out["gpu_tasks"]  # same bytes, same checksums
        assert loads["driver"] == 0 and 1 <= loads["cpu_tasks"] < 8 and loads["gpu_tasks"] == 4, loads
        # a second pass finds every shard: nothing computed, whichever path
        assert dense_stage(spec, models, rows, tmp_path / "driver", cache, progress=False) == {"vit_digits": 0}
    finally:
        ray.shutdown()


@pytest.mark.timeout(240)
def test_a_gpu_dense_run_whose_worker_dies_mid_run_is_retried_without_a_lost_or_doubled_shard(tmp_path):
    """The same eight shards as runs of two on half a logical GPU; the worker of the first run is SIGKILLed as it
    starts its second shard (tests/faults/dense_kill.py), after its first was written and yielded. Ray retries the
    generator task (a fresh worker; it recomputes and rewrites the first shard, and Ray hands the caller each
    yielded index once): the stage reports each shard once, and the store's bytes equal the driver's."""
    import ray

    cache = Path(os.environ.get("HEALSWEEP_TEST_CACHE", REPO / ".healsweep" / "models"))
    spec = load_spec(REPO / "configs" / "tiny.yaml")
    spec = replace(spec, store=replace(spec.store, shard_size=16))
    gpu_spec = replace(spec, resources=replace(spec.resources, gpus_per_dense_task=0.5, device="cpu"))
    models = prepare_models(spec, cache, progress=False)
    rows, marks = {"vit_digits": 128}, tmp_path / "marks"
    marks.mkdir()
    dense_stage(spec, models, rows, tmp_path / "driver", cache, progress=False, in_driver=True)
    ray.init(address="local", num_cpus=2, num_gpus=1, include_dashboard=False, log_to_driver=False,
             runtime_env={"worker_process_setup_hook": "tests.faults.dense_kill.install",
                          "env_vars": {"HEALSWEEP_TEST_KILL_DIR": str(marks),
                                       "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}})
    try:
        rep = DenseReport()
        done = dense_stage(gpu_spec, models, rows, tmp_path / "gpu", cache, progress=False, report=rep,
                           in_driver=False)
    finally:
        ray.shutdown()
    assert (marks / "killed").exists()  # the kill happened
    assert done == {"vit_digits": 128} and rep.shards == {"vit_digits": 8}
    # Loads are counted from delivered shards: the retry's load came with its re-yield of shard 0, which Ray drops
    # (already delivered), so the count stays one per run although the killed run's model was loaded twice.
    assert rep.loads == {"vit_digits": 4}
    key = models["vit_digits"].store_key
    read = lambda name: {p.name: p.read_bytes() for p in sorted((tmp_path / name / key).glob("shard-*"))}  # noqa: E731
    assert read("gpu") == read("driver") and len(read("driver")) == 8 * 2  # shards and their checksums
    man = {n: TargetStore(tmp_path / n).manifest(key) for n in ("gpu", "driver")}
    assert man["gpu"]["num_rows"] == 128 and man["gpu"]["shards"] == man["driver"]["shards"]  # each shard once
