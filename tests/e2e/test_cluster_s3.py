"""The target store on an S3 endpoint with enforced auth, credentials only in the driver's environment, on a
two-node Ray cluster whose nodes were started without them: the sweep completes (workers get the credentials
through the job's runtime_env) and a rerun computes 0 dense images."""
from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from orchestrator.spec import parse_spec
from tests.cluster_fixtures import add_node

pytestmark = pytest.mark.e2e
REPO = Path(__file__).resolve().parents[2]
CACHE = Path(os.environ.get("HEALSWEEP_TEST_CACHE", REPO / ".healsweep" / "models"))


def test_s3_store_on_a_two_node_cluster_with_credentials_only_in_the_driver(tmp_path, aws_env, ray_cluster,
                                                                             monkeypatch, capfd):
    import pyarrow.fs as pafs

    from orchestrator.sweep import run_sweep

    add_node(ray_cluster, num_cpus=1)
    uri = f"s3://{aws_env['bucket']}/targets?endpoint_override={aws_env['host']}&scheme=http"
    spec = parse_spec({"name": "s3", "models": ["vit_digits"], "sparsities": [0.9], "calib_sizes": [64],
                       "pruners": ["magnitude"], "healers": ["starfish"], "store": {"uri": uri, "shard_size": 16},
                       "search": {"trials_per_cell": 2, "lr": [1e-3, 3e-3], "epochs": [1, 1]}})
    monkeypatch.setenv("RAY_ADDRESS", ray_cluster.address)  # what --address auto follows
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)

    def run(out):  # the driver: this process, the only one with the credentials
        return run_sweep(spec, tmp_path / out, tmp_path / "store", CACHE, address="auto", progress=False,
                         report=False)

    first = run("a")
    # --address auto says which cluster it joined
    port = ray_cluster.address.rsplit(":", 1)[1]
    assert re.search(rf"joined Ray cluster \S*:{port} .*2 nodes", capfd.readouterr().err)
    assert (first.trials_finished, first.trials_failed, first.dense_forward_images) == (2, 0, 64)
    fs, path = pafs.FileSystem.from_uri(uri)  # written on the endpoint (the test process has the credentials)
    names = [i.base_name for i in fs.get_file_info(pafs.FileSelector(path, recursive=True))]
    assert sum(n.startswith("shard-") and n.endswith(".arrow") for n in names) == 4, names  # 64 rows / 16
    # masks follow the store URI (<store>/masks), none on the driver's local store root
    masks = fs.get_file_info(pafs.FileSelector(f"{path}/masks"))
    assert [i.extension for i in masks] == ["safetensors"] and not (tmp_path / "store" / "masks").exists()
    second = run("b")
    assert (second.trials_finished, second.trials_failed, second.dense_forward_images) == (2, 0, 0)
    again = fs.get_file_info(pafs.FileSelector(f"{path}/masks"))
    assert [(i.path, i.mtime) for i in again] == [(i.path, i.mtime) for i in masks]  # 0 masks recomputed


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
