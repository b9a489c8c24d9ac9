"""The ResNet-50 recipe's dry run (configs/resnet50_imagenet_starfish.yaml: torchvision ResNet-50, magnitude and LAMP
at 0.5-0.8, STARFISH and CR+BN), every stage through ``healsweep run --dry-run`` at 224 px on the CPU; the helpers
and the DeiT recipe are in test_recipes.py. A file of its own so that pytest-xdist's ``--dist loadfile`` (.ci/test)
runs the two long dry runs on different workers."""
from __future__ import annotations

import pytest

from tasks.pruning import MaskStore
from tests.e2e.test_recipes import _dry_run, _shapes

pytestmark = pytest.mark.e2e


@pytest.mark.long
@pytest.mark.timeout(1200)
def test_resnet50_recipe_dry_run(tmp_path):
    out, trials = _dry_run("resnet50_imagenet_starfish", tmp_path)
    stages = {1: (256, 56), 2: (512, 28), 3: (1024, 14), 4: (2048, 7)}
    expect = {f"layer{s}.{b}": [c, hw, hw, ] for s, (c, hw) in stages.items() for b in range((3, 4, 6, 3)[s - 1])}
    assert _shapes(out, trials[0]) == {**expect, "logits": [1000]}  # 16 bottleneck blocks at 224 px
    assert {(r.data.params["pruner"], float(r.data.params["sparsity"]), r.data.params["healer"]) for r in trials} == {
        (p, s, h) for p in ("magnitude", "lamp") for s in (0.5, 0.6, 0.7, 0.8) for h in ("starfish", "crbn")}
    masks = MaskStore(out / "store" / "masks")
    for r in trials:
        s, m = float(r.data.params["sparsity"]), masks.load(r.data.tags["mask_key"])
        assert "conv1.weight" not in m and len(m) == 52  # scope conv: every conv but the stem (52 of 53)
        pruned, total = sum(int((~v).sum()) for v in m.values()), sum(v.numel() for v in m.values())
        assert abs(pruned - s * total) <= 0.5 * len(m)  # exact up to one rounding per tensor
        if r.data.params["pruner"] == "magnitude":  # layer-uniform: every tensor at the target
            assert all(abs(int((~v).sum()) - s * v.numel()) <= 0.5 for v in m.values())
