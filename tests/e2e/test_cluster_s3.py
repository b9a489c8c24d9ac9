"""The target store on an S3 endpoint with enforced auth, credentials only in the driver's environment, on a
two-node Ray cluster whose nodes were started without them: the sweep completes (workers get the credentials
through the job's runtime_env) and a rerun computes 0 dense images."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.cluster_fixtures import add_node

pytestmark = pytest.mark.e2e
REPO = Path(__file__).resolve().parents[2]
CACHE = os.environ.get("HEALSWEEP_TEST_CACHE", str(REPO / ".healsweep" / "models"))
EXE = os.path.join(os.path.dirname(sys.executable), "healsweep")


def test_s3_store_on_a_two_node_cluster_with_credentials_only_in_the_driver(tmp_path, aws_env, ray_cluster):
    import pyarrow.fs as pafs

    add_node(ray_cluster, num_cpus=1)
    uri = f"s3://{aws_env['bucket']}/targets?endpoint_override={aws_env['host']}&scheme=http"
    raw = {"name": "s3", "models": ["vit_digits"], "sparsities": [0.9], "calib_sizes": [64], "pruners": ["magnitude"],
           "healers": ["starfish"], "store": {"uri": uri, "shard_size": 16},
           "search": {"trials_per_cell": 2, "lr": [1e-3, 3e-3], "epochs": [1, 1]}}
    (tmp_path / "spec.yaml").write_text(yaml.safe_dump(raw))
    env = {**os.environ, "RAY_ADDRESS": ray_cluster.address, "MLFLOW_TRACKING_URI": ""}

    def run(out):
        p = subprocess.run([EXE, "run", str(tmp_path / "spec.yaml"), "--address", "auto", "--out", str(tmp_path / out),
                            "--cache", CACHE, "--store", str(tmp_path / "store"), "--quiet", "--no-report"],
                           capture_output=True, text=True, timeout=600, env=env)
        assert p.returncode == 0, p.stderr[-4000:]
        return p

    first = run("a")
    # --address auto says which cluster it joined
    assert re.search(rf"joined Ray cluster \S*:{ray_cluster.address.rsplit(':', 1)[1]} .*2 nodes", first.stderr)
    assert "2 trials finished, 0 failed, dense forward images 64" in first.stdout
    fs, path = pafs.FileSystem.from_uri(uri)  # written on the endpoint (the test process has the credentials)
    names = [i.base_name for i in fs.get_file_info(pafs.FileSelector(path, recursive=True))]
    assert sum(n.startswith("shard-") and n.endswith(".arrow") for n in names) == 4, names  # 64 rows / 16
    # masks follow the store URI (<store>/masks), none on the driver's local store root
    masks = fs.get_file_info(pafs.FileSelector(f"{path}/masks"))
    assert [i.extension for i in masks] == ["safetensors"] and not (tmp_path / "store" / "masks").exists()
    assert "2 trials finished, 0 failed, dense forward images 0" in run("b").stdout
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
