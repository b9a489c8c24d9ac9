"""End to end: a tiny coarse sweep, then `healsweep refine` continues it inside the transition band."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import yaml
from mlflow import MlflowClient

from orchestrator.cli import main as cli_main

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.e2e
SPEC = {"name": "refinetiny", "models": ["resnet_digits"], "sparsities": [0.5, 0.9, 0.99], "calib_sizes": [64],
        "pruners": ["magnitude"], "seeds": [0],
        # refine mechanics, not BatchNorm: a 1–2 epoch heal on 64 images in train-mode BN (the default) moves the
        # running statistics only partly, so the frozen loop keeps the band labels of this test stable
        "healers": [{"name": "starfish", "settings": {"bn": "frozen"}}],
        "search": {"trials_per_cell": 1, "lr": [1.0e-3, 3.0e-3], "epochs": [1, 2], "reevaluate": 0}}


def test_refine_continues_the_same_sweep(tmp_path):
    cache = os.environ.get("HEALSWEEP_TEST_CACHE", str(REPO / ".healsweep" / "models"))
    (tmp_path / "spec.yaml").write_text(yaml.safe_dump(SPEC))
    run_dir, store = tmp_path / "run", tmp_path / "store"
    common = ["--num-cpus", "1", "--quiet"]
    assert cli_main(["run", str(tmp_path / "spec.yaml"), "--out", str(run_dir), "--store", str(store),
                     "--cache", cache, *common]) == 0
    before = json.loads((run_dir / "bands.json").read_text())["models"]["resnet_digits"]["bands"][0]
    labels = {p["sparsity"]: p["label"] for p in before["points"]}
    # magnitude pruning of the digits ResNet: recovers at 0.5, collapses at 0.99 (measured: 0.9 collapses too)
    assert labels[0.5] == "recoverable" and labels[0.99] == "collapse"
    masks_before = set(os.listdir(store / "masks"))
    assert cli_main(["refine", str(run_dir), "--step", "0.2", *common]) == 0

    meta = json.loads((run_dir / "sweep.json").read_text())
    (ref,) = meta["refinements"]
    assert ref["round"] == 1 and ref["trials_finished"] == 1 and ref["sparsities"] == [0.7]
    client = MlflowClient(meta["tracking_uri"])
    exp = client.get_experiment_by_name("healsweep")
    runs = client.search_runs([exp.experiment_id], f"tags.sweep_id = '{meta['sweep_id']}'")
    parents = [r for r in runs if r.data.tags["healsweep.role"] == "sweep"]
    trials = [r for r in runs if r.data.tags["healsweep.role"] == "trial"]
    assert len(parents) == 1 and len(trials) == 4  # one sweep, one parent, 3 coarse + 1 fine trial
    assert {r.data.tags["mlflow.parentRunId"] for r in trials} == {parents[0].info.run_id}
    hist = client.get_metric_history(parents[0].info.run_id, "dense_forward_images_session")
    assert sorted((m.step, m.value) for m in hist)[1] == (1, 0.0)  # targets reused: no dense forward pass
    total = client.get_metric_history(parents[0].info.run_id, "dense_forward_images")
    first = sorted((m.step, m.value) for m in hist)[0][1]
    assert sorted((m.step, m.value) for m in total) == [(0, first), (1, first)]  # total over both sessions
    assert len(set(os.listdir(store / "masks")) - masks_before) == 1  # only the new sparsity's mask
    after = json.loads((run_dir / "bands.json").read_text())["models"]["resnet_digits"]["bands"][0]
    assert [p["sparsity"] for p in after["points"]] == [0.5, 0.7, 0.9, 0.99]
    md = (run_dir / "report.md").read_text()
    assert "Repairability bands: magnitude" in md and "Seed statistics per healer" in md
