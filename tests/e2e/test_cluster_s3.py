"""One S3 URI, no shared file system: the target store, masks, RR diagnostics, SnapViT rankings and the model
cache on an S3 endpoint with enforced auth, credentials only in the driver's environment, on a two-node Ray
cluster whose nodes were started without them (workers get the credentials through the job's runtime_env)."""
from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest

from orchestrator.spec import parse_spec
from tests.cluster_fixtures import add_node, make_cluster

pytestmark = pytest.mark.e2e
REPO = Path(__file__).resolve().parents[2]
CACHE = Path(os.environ.get("HEALSWEEP_TEST_CACHE", REPO / ".healsweep" / "models"))


@pytest.fixture
def cpu0_head_cluster(monkeypatch):
    """A head with CPU: 0 (as on Kubernetes): every task and trial must run on a worker node."""
    yield from make_cluster(monkeypatch, 0)


def _objects(fs, path: str) -> dict[str, float]:
    import pyarrow.fs as pafs

    return {i.path[len(path) + 1:]: i.mtime for i in fs.get_file_info(pafs.FileSelector(path, recursive=True))
            if i.type == pafs.FileType.File}


def test_one_s3_uri_and_no_shared_file_system_on_a_two_node_cluster(tmp_path, aws_env, cpu0_head_cluster,
                                                                     monkeypatch, capfd):
    """Credentials only in the driver; the worker node has its own model directory (no access to the driver's
    --cache or run directory); the head has no CPU, so models, dense shards, masks and trials run on the worker.
    The sweep completes; a rerun computes 0 dense images, 0 masks and trains 0 models; everything a worker needs
    is under the bucket prefix; the masks' provenance names the worker node."""
    import shutil

    import pyarrow.fs as pafs
    from mlflow import MlflowClient
    from safetensors import safe_open

    from orchestrator.sweep import run_sweep

    worker_models = tmp_path / "worker-node-models"  # the worker's own local disk
    worker = add_node(cpu0_head_cluster, num_cpus=2, env_vars={"HEALSWEEP_MODEL_MIRROR": str(worker_models)})
    driver_cache = tmp_path / "driver" / "cache"  # the driver's --cache: holds the trained reference model
    driver_cache.mkdir(parents=True)
    for f in CACHE.glob("vit_digits-*.safetensors"):
        shutil.copy(f, driver_cache / f.name)
    monkeypatch.chdir(tmp_path / "driver")  # the driver's cwd: nothing the worker node is started from
    uri = f"s3://{aws_env['bucket']}/one?endpoint_override={aws_env['host']}&scheme=http"
    spec = parse_spec({"name": "s3", "models": ["vit_digits"], "sparsities": [0.9], "calib_sizes": [64],
                       "pruners": ["magnitude"], "healers": ["starfish"], "store": {"uri": uri, "shard_size": 16},
                       "search": {"trials_per_cell": 2, "lr": [1e-3, 3e-3], "epochs": [1, 1]}})
    monkeypatch.setenv("RAY_ADDRESS", cpu0_head_cluster.address)  # what --address auto follows
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)

    def run(out):  # the driver: this process, the only one with the credentials
        res = run_sweep(spec, tmp_path / "driver" / out, tmp_path / "driver" / "store", driver_cache,
                        address="auto", progress=False, report=False)
        client = MlflowClient(res.tracking_uri)
        return res, client.get_run(res.parent_run_id).data

    first, data = run("a")
    port = cpu0_head_cluster.address.rsplit(":", 1)[1]
    assert re.search(rf"joined Ray cluster \S*:{port} .*2 nodes", capfd.readouterr().err)
    assert (first.trials_finished, first.trials_failed, first.dense_forward_images) == (2, 0, 64)
    assert (data.metrics["models_trained"], data.metrics["masks_computed"]) == (0, 1)
    fs, path = pafs.FileSystem.from_uri(uri)
    objs = _objects(fs, path)
    ckpt = [k for k in objs if k.startswith("models/vit_digits-") and k.endswith(".safetensors")]
    assert len(ckpt) == 1, objs  # the model cache on the store (seeded from the driver's --cache)
    assert sum(k.split("/")[-1].startswith("shard-") and k.endswith(".arrow") for k in objs) == 4  # 64 rows / 16
    masks = [k for k in objs if k.startswith("masks/") and k.endswith(".safetensors")]
    assert len(masks) == 1 and not (tmp_path / "driver" / "store").exists()  # nothing on the driver's disk
    # the worker read the checkpoint from the bucket into its own directory (it cannot see the driver's)
    assert [p.name for p in worker_models.iterdir()] == [ckpt[0].split("/")[-1]]
    # masks were computed by a Ray task on the worker node: provenance in the mask file and the parent run
    raw = fs.open_input_stream(f"{path}/{masks[0]}").read()
    (tmp_path / "m.safetensors").write_bytes(raw)
    with safe_open(str(tmp_path / "m.safetensors"), framework="pt") as f:
        prov = json.loads(f.metadata()["meta"])["provenance"]
    assert prov["node_id"] == worker.node_id != cpu0_head_cluster.head_node.node_id
    assert (data.tags["mask_placement_0"], data.tags["mask_nodes_0"]) == ("tasks", worker.node_id)

    second, data2 = run("b")
    assert (second.trials_finished, second.trials_failed, second.dense_forward_images) == (2, 0, 0)
    assert (data2.metrics["models_trained"], data2.metrics["masks_computed"]) == (0, 0)
    again = _objects(fs, path)
    assert {k: again[k] for k in [*ckpt, *masks]} == {k: objs[k] for k in [*ckpt, *masks]}  # nothing rewritten


def test_diagnostics_and_model_cache_on_s3(tmp_path, aws_env, monkeypatch):
    """RR diagnostics tables under <store.uri>/diagnostics (written once, reused: 0 layers the second time), read
    by Ray tasks whose model comes from <store.uri>/models through a node-local copy; a missing checkpoint on a
    cluster worker is one clear error, never a retraining."""
    import ray

    from orchestrator.cluster import store_subdir
    from orchestrator.diagnostics import diagnostics_stage, load_table, read_table
    from orchestrator.plan import expand_cells
    from orchestrator.stages import prepare_models
    from tasks.models.reference import REQUIRE_CACHED_ENV, load_reference, set_local_mirror

    from tasks.models import load_model

    load_model("resnet_digits", CACHE, progress=False)  # the driver's --cache has it (a fresh clone trains it here)
    uri = f"s3://{aws_env['bucket']}/diag?endpoint_override={aws_env['host']}&scheme=http"
    models_uri, diag_uri = store_subdir(uri, "models"), store_subdir(uri, "diagnostics")
    monkeypatch.setenv(REQUIRE_CACHED_ENV, "1")
    monkeypatch.setenv("HEALSWEEP_MODEL_MIRROR", str(tmp_path / "node"))
    with pytest.raises(FileNotFoundError, match="not in the model cache s3://"):
        load_reference("resnet_digits", models_uri, progress=False)  # empty bucket: refuses, does not train
    spec = parse_spec({"name": "d", "models": ["resnet_digits"], "sparsities": [0.5], "calib_sizes": [64],
                       "pruners": [{"name": "rr", "settings": {"grid": [0.25, 0.5], "diag_images": 16}}],
                       "healers": ["starfish"], "store": {"uri": uri}})
    set_local_mirror(CACHE)  # the driver: its --cache seeds the bucket's model cache
    try:
        models = prepare_models(spec, models_uri, progress=False)
    finally:
        set_local_mirror(None)
    cells = expand_cells(spec, {m: i.scope for m, i in models.items()})
    ray.init(address="local", num_cpus=1, include_dashboard=False, log_to_driver=False)
    try:
        first = diagnostics_stage(cells, models, diag_uri, models_uri, spec.data_seed)
        second = diagnostics_stage(cells, models, diag_uri, models_uri, spec.data_seed)
    finally:
        ray.shutdown()
    (key,) = set(first.keys.values())
    n_layers = len(set(load_table(diag_uri, key)["layer"]))
    assert first.computed_layers == n_layers > 1 and second.computed_layers == 0
    assert len(load_table(diag_uri, key)["layer"]) == 2 * n_layers  # every layer x both grid points
    meta = read_table(diag_uri, key).schema.metadata
    assert len(json.loads(meta[b"healsweep.nodes"])) == 1  # the (one) node that computed it
    assert [p.name for p in (tmp_path / "node").iterdir()] == [next(CACHE.glob("resnet_digits-*")).name]


def test_mask_store_on_s3_round_trip(aws_env):
    import torch

    from orchestrator.cluster import store_subdir
    from tasks.pruning import MaskStore
    from tasks.store import StoreError

    uri = store_subdir(f"s3://{aws_env['bucket']}/rt?endpoint_override={aws_env['host']}&scheme=http", "masks")
    ms, key = MaskStore(uri), "a" * 32
    m = {"blocks.0.w": torch.tensor([[True, False], [False, True]])}
    assert not ms.has(key)
    ms.save(key, m, {"k": 1})
    assert ms.has(key) and torch.equal(MaskStore(uri).load(key)["blocks.0.w"], m["blocks.0.w"])
    with pytest.raises(StoreError):
        ms.load("b" * 32)
    with pytest.raises(StoreError):
        ms.has("../x")


def test_snapvit_rankings_on_s3_are_reused(tmp_path, aws_env, monkeypatch):
    """The mask stage with a remote store: the SnapViT ranking is written to <store.uri>/rankings and read back
    from there (not recomputed) when the masks must be made again on a node with an empty process cache."""
    import pyarrow.fs as pafs

    import tasks.pruning.snapvit as snapvit_pruner
    import tasks.pruning.snapvit_math as snapvit
    from orchestrator.cluster import store_subdir
    from orchestrator.plan import expand_cells
    from orchestrator.stages import mask_stage, prepare_models, store_paths

    uri = f"s3://{aws_env['bucket']}/rank?endpoint_override={aws_env['host']}&scheme=http"
    calls = []
    real = snapvit.compute_ranking
    monkeypatch.setattr(snapvit, "compute_ranking", lambda *a, **k: calls.append(1) or real(*a, **k))
    spec = parse_spec({"name": "r", "models": ["vit_digits"], "sparsities": [0.25, 0.5], "calib_sizes": [32],
                       "pruners": [{"name": "snapvit", "settings": {"iterations": 2, "fitness_images": 16}}],
                       "healers": ["starfish"], "store": {"uri": uri}})
    paths = store_paths(uri, tmp_path / "store", CACHE)
    try:
        models = prepare_models(spec, paths["cache"], progress=False)
        cells = expand_cells(spec, {m: i.scope for m, i in models.items()})

        def masks(root):
            return mask_stage(cells, models, root, paths["cache"], spec.data_seed, ranking_dir=paths["rankings"])

        first = masks(paths["masks"])
        snapvit_pruner.clear_memory_cache()  # another process: only the bucket remembers the ranking
        second = masks(store_subdir(uri, "masks-again"))
    finally:
        store_paths(None, tmp_path / "store", CACHE)  # back to a local model cache for later tests
    assert len(first.computed) == len(second.computed) == 2 and calls == [1]
    fs, path = pafs.FileSystem.from_uri(paths["rankings"])
    assert [i.extension for i in fs.get_file_info(pafs.FileSelector(path))] == ["safetensors"]
    assert dict(first) == dict(second)  # same keys: the same masks from the stored ranking


def test_cold_model_cache_is_trained_once_by_a_task_on_the_worker(tmp_path, aws_env, cpu0_head_cluster):
    """An empty bucket and an empty driver --cache on a cluster: one Ray task on the worker trains the reference
    model (bit-identical to the one trained elsewhere with the same seed) and uploads it to <store.uri>/models;
    the driver trains nothing; asked again, nobody trains."""
    import pyarrow.fs as pafs

    from orchestrator import cluster
    from orchestrator.stages import prepare_models, store_paths
    from tasks.models import load_model

    worker = add_node(cpu0_head_cluster, num_cpus=1, env_vars={"HEALSWEEP_MODEL_MIRROR": str(tmp_path / "w")})
    uri = f"s3://{aws_env['bucket']}/cold?endpoint_override={aws_env['host']}&scheme=http"
    spec = parse_spec({"name": "c", "models": ["resnet_digits"], "sparsities": [0.5], "calib_sizes": [64],
                       "pruners": ["magnitude"], "healers": ["starfish"], "store": {"uri": uri}})
    paths = store_paths(uri, tmp_path / "store", tmp_path / "driver-cache")
    try:
        cluster.connect(cpu0_head_cluster.address, announce=lambda _: None)  # workers get the credentials
        first = prepare_models(spec, paths["cache"], progress=False, on_workers=True)["resnet_digits"]
        second = prepare_models(spec, paths["cache"], progress=False, on_workers=True)["resnet_digits"]
    finally:
        store_paths(None, tmp_path / "store", CACHE)
    assert (first.trained, second.trained) == (True, False)
    assert first.digest == load_model("resnet_digits", CACHE, progress=False).digest  # same seed, same weights
    fs, path = pafs.FileSystem.from_uri(paths["cache"])
    (ckpt,) = [i.base_name for i in fs.get_file_info(pafs.FileSelector(path))]
    assert [p.name for p in (tmp_path / "w").iterdir()] == [ckpt]  # trained on the worker, its copy kept there
    assert not (tmp_path / "driver-cache").exists() or not any((tmp_path / "driver-cache").iterdir())
    assert worker.node_id  # the only node with CPUs: the task can only have run there
