"""The dense stage's two paths write the same store: small work in the driver, real sizes on Ray actors."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from orchestrator.sweep.dense import DenseReport, dense_stage
from orchestrator.sweep.dense_work import LOCAL_MAX_IMAGE_PARAMS
from orchestrator.spec import load_spec
from orchestrator.sweep.stages import prepare_models
from tasks.models import load_model

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.e2e


def test_driver_and_actor_dense_paths_write_identical_shards(tmp_path):
    import ray

    cache = Path(os.environ.get("HEALSWEEP_TEST_CACHE", REPO / ".healsweep" / "models"))
    spec = load_spec(REPO / "configs" / "tiny.yaml")
    models = prepare_models(spec, cache, progress=False)
    rows = {"vit_digits": 128}  # two shards of 64
    n_params = sum(p.numel() for p in load_model("vit_digits", cache, progress=False).model.parameters())
    assert 128 * n_params <= LOCAL_MAX_IMAGE_PARAMS  # the default picks the driver for this size
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        out = {}
        for name, in_driver in (("driver", True), ("actors", False)):
            rep = DenseReport()
            done = dense_stage(spec, models, rows, tmp_path / name, cache, progress=False, report=rep,
                               in_driver=in_driver)
            assert done == {"vit_digits": 128} and rep.shards == {"vit_digits": 2}
            key_dir = tmp_path / name / models["vit_digits"].store_key
            out[name] = {p.name: p.read_bytes() for p in sorted(key_dir.glob("shard-*"))}
        assert sorted(out["driver"]) == ["shard-00000.arrow", "shard-00000.json", "shard-00001.arrow",
                                         "shard-00001.json"]
        assert out["driver"] == out["actors"]  # same bytes, same checksums
        # a second pass finds both shards: nothing computed, whichever path
        assert dense_stage(spec, models, rows, tmp_path / "driver", cache, progress=False) == {"vit_digits": 0}
    finally:
        ray.shutdown()
