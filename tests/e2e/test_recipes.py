"""The GPU recipes as a user with ImageNet would run them (issue 33, part 4): configs/deit_imagenet_starfish.yaml
(DeiT-T/S/B, CORP masks on three scopes, CORP / STARFISH / CORP then STARFISH) and
configs/resnet50_imagenet_starfish.yaml (torchvision ResNet-50, magnitude and LAMP at 0.5-0.8, STARFISH and
CR+BN) pass ``healsweep validate`` offline, with empty weight caches, and their every stage runs through
``healsweep run --dry-run`` (orchestrator/spec/dry_run.py): the real architectures at 224 px with random-init
weights, a generated image folder, one trial per cell, on the CPU. Nothing is downloaded."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from mlflow import MlflowClient

from orchestrator.spec.dry_run import DRY_CALIB
from tasks.pruning import MaskStore
from tasks.store import TargetStore
from tests.orchestrator.run_cli import healsweep

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.e2e
# recipe -> (cells, trials of its real run, cells of its dry run)
RECIPES = {"deit_imagenet_starfish": (81, 189, 27), "resnet50_imagenet_starfish": (16, 32, 16)}
DEIT_WIDTH = {"deit_tiny": 192, "deit_small": 384, "deit_base": 768}


def _offline(tmp: Path) -> dict:
    """No network and empty weight caches: a recipe that wanted the hub or a download would fail here."""
    return {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "HF_HOME": str(tmp / "hf"),
            "TORCH_HOME": str(tmp / "torch"), "HEALSWEEP_CHECK_CACHE": "off"}


def _nothing_cached(tmp: Path) -> None:
    for d in ("hf", "torch"):
        assert not [p for p in (tmp / d).rglob("*") if p.is_file()], f"{d} cache written"


@pytest.mark.timeout(180)
@pytest.mark.parametrize("recipe", RECIPES)
def test_gpu_recipe_validates_offline(recipe, tmp_path):
    cells, trials, _ = RECIPES[recipe]
    proc = healsweep("validate", REPO / "configs" / f"{recipe}.yaml", cwd=tmp_path, timeout=170, **_offline(tmp_path))
    assert proc.returncode == 0, proc.stderr
    assert f"ok: {cells} cells, {trials} trials" in proc.stdout
    _nothing_cached(tmp_path)


def _trials(out: Path) -> list:
    client = MlflowClient(f"sqlite:///{out / 'mlflow.db'}")
    runs = client.search_runs([client.get_experiment_by_name("healsweep").experiment_id])
    assert sum(r.data.tags.get("healsweep.role") == "sweep" for r in runs) == 1
    return [r for r in runs if r.data.tags.get("healsweep.role") == "trial"]


def _dry_run(recipe: str, tmp: Path, cpus: int = 2) -> tuple[Path, list]:
    """``healsweep run RECIPE --dry-run`` -> (run dir, trial runs); every trial finished, its masks kept."""
    out = tmp / "run"
    proc = healsweep("run", REPO / "configs" / f"{recipe}.yaml", "--dry-run", "--out", out, "--num-cpus", str(cpus),
                     "--quiet", cwd=tmp, timeout=1700, **_offline(tmp))
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    n = RECIPES[recipe][2]
    assert f"{n} trials finished, 0 failed" in proc.stdout, proc.stdout
    trials = _trials(out)
    assert len(trials) == n and all(r.info.status == "FINISHED" for r in trials)
    report = (out / "report.md").read_text()
    for r in trials:
        assert r.data.metrics["mask_violations"] == 0 and r.data.metrics["changed_outside_scope"] == 0
        assert r.data.params["calib_size"] == str(DRY_CALIB) and f"### {r.data.params['model']} — grid `main`" in report
    _nothing_cached(tmp)
    from PIL import Image

    pngs = sorted((out / "data").rglob("*.png"))  # the generated stand-in: 10 classes at the models' input size
    assert len({p.parent.name for p in pngs}) == 10 and Image.open(pngs[0]).size == (224, 224)
    return out, trials


def _shapes(out: Path, run) -> dict:
    man = TargetStore(out / "store" / "targets").manifest(run.data.tags["store_key"])
    assert man["num_rows"] == DRY_CALIB
    return {k: list(v) for k, v in man["block_shapes"].items()}


@pytest.mark.long
@pytest.mark.timeout(1800)
def test_deit_recipe_dry_run(tmp_path):
    # One trial at a time: a DeiT-B trial process peaks at 4-5 GB on the CPU (weights, the dense copy CORP and
    # STARFISH need, AdamW state, 224-px activations) and keeps up to 4 models cached; two side by side came
    # within Ray's memory limit of a 23 GB machine shared with other work.
    out, trials = _dry_run("deit_imagenet_starfish", tmp_path, cpus=1)
    assert {(r.data.params["model"], r.data.params["healer"]) for r in trials} == {
        (f"{arch}-{scope}", h) for arch in DEIT_WIDTH for scope in ("mlp", "qk", "qk_mlp")
        for h in ("corp", "starfish", "corp+starfish")}
    masks = MaskStore(out / "store" / "masks")
    for r in trials:
        arch, scope = r.data.params["model"].split("-")
        width = DEIT_WIDTH[arch]  # 12 blocks of 197 tokens (14 x 14 patches + CLS) at 224 px, ImageNet's 1000 logits
        assert _shapes(out, r) == {**{f"blocks.{i}": [197, width] for i in range(12)}, "logits": [1000]}
        assert r.data.params["scope"] == scope and r.data.metrics["achieved_sparsity"] == pytest.approx(0.5, abs=1e-6)
        m = masks.load(r.data.tags["mask_key"])
        for i in range(12):  # CORP's structure: whole MLP neurons, matching Q and K dimensions
            if "mlp" in scope:
                rows = m[f"blocks.{i}.mlp.fc1.weight"].all(1)  # (4 * width,) kept neurons
                assert torch.equal(rows, m[f"blocks.{i}.mlp.fc2.weight"].all(0)) and int(rows.sum()) == 2 * width
            if "qk" in scope:
                qkv = m[f"blocks.{i}.attn.qkv.weight"].all(1)  # (3 * width,): Q, K, V rows
                q, k, v = qkv[:width], qkv[width:2 * width], qkv[2 * width:]
                assert torch.equal(q, k) and bool(v.all()) and int(q.sum()) == width // 2
