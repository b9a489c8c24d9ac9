"""Every model source through the whole sweep (issue 33, part 4): timm (a ViT and a CNN), torchvision and a
local checkpoint, on an image folder, a Parquet image table and a local Hugging Face dataset, each run by the real
``healsweep run`` (a subprocess) end to end: models, dense targets, masks, Ray Tune trials, MLflow, report. The
images are generated at 224 px (tasks/data/synthetic.py); every model is random-init (nothing downloaded).

Sizes are tiny so the file runs in a few minutes on 2 cores: 8 calibration, 8 selection and 8 evaluation images,
one sparsity, one trial per cell with one epoch, no re-evaluation. The DeiT is shrunk to 2 blocks through its
builder arguments (``model_args: {depth: 2}``): its tokens (197 at 224 px) and width (192) are DeiT-T's."""
from __future__ import annotations

import copy
import hashlib
from pathlib import Path

import pytest
import torch
import yaml
from mlflow import MlflowClient

from tasks.data.synthetic import write_hf_dataset, write_image_folder, write_image_table
from tasks.models import get_adapter
from tasks.pruning import MaskStore, mask_digest
from tasks.store import TargetStore
from tests.orchestrator.run_cli import healsweep

pytestmark = pytest.mark.e2e
SIZES = {"train": 0, "calibration": 8, "selection": 8, "evaluation": 8}  # 24 of the 30 generated images
VIT = {"name": "deit_t2", "source": "timm", "arch": "deit_tiny_patch16_224", "pretrained": False,
       "num_classes": 10, "model_args": {"depth": 2}}
CNN = {"name": "resnet18_timm", "source": "timm", "arch": "resnet18", "pretrained": False, "num_classes": 10}
TV = {"name": "resnet18_tv", "source": "torchvision", "arch": "resnet18", "num_classes": 10}
BASE = {"sparsities": [0.5], "calib_sizes": [8], "pruners": ["magnitude"], "healers": ["starfish"],
        "search": {"trials_per_cell": 1, "lr": [1.0e-3, 1.0e-3], "epochs": [1, 1], "reevaluate": 0},
        "heal": {"batch_size": 8}, "store": {"shard_size": 8}}


def _sweep(tmp: Path, name: str, dataset: dict, models: list[dict], cwd: Path | None = None) -> tuple[Path, Path, str]:
    """Write the spec to ``tmp``, run ``healsweep run`` on it from ``cwd`` (default ``tmp``) -> (run dir, store
    dir, stdout)."""
    spec = {"name": name, "dataset": {**dataset, "sizes": SIZES}, "models": models, **copy.deepcopy(BASE)}
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    cwd = cwd or tmp
    cwd.mkdir(exist_ok=True)
    check = healsweep("validate", path, cwd=cwd, timeout=300)
    n = len(models)
    assert check.returncode == 0 and f"ok: {n} cell{'s' * (n != 1)}, {n} trial{'s' * (n != 1)}" in check.stdout, \
        check.stderr
    out, store = tmp / "run", tmp / "store"
    proc = healsweep("run", path, "--out", out, "--store", store, "--cache", tmp / "cache", "--num-cpus", "2",
                     "--quiet", cwd=cwd, timeout=600, HEALSWEEP_CHECK_CACHE="off")
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    n = len(models)
    assert f"{n} trial{'s' if n != 1 else ''} finished, 0 failed" in proc.stdout, proc.stdout
    return out, store, proc.stdout


def _trial_runs(out: Path) -> tuple[MlflowClient, list, list]:
    """(client, trial child runs, sweep parent runs) of the run directory's MLflow store."""
    client = MlflowClient(f"sqlite:///{out / 'mlflow.db'}")
    exp = client.get_experiment_by_name("healsweep")
    runs = client.search_runs([exp.experiment_id])
    role = lambda r: r.data.tags.get("healsweep.role")  # noqa: E731
    return client, [r for r in runs if role(r) == "trial"], [r for r in runs if role(r) == "sweep"]


def _check_sweep(out: Path, store: Path, models: list[dict]) -> dict:
    """What every sweep here must show -> {model name: its trial run}."""
    _, trials, parents = _trial_runs(out)
    assert len(parents) == 1 and len(trials) == len(models)  # one run per trial under one parent per sweep
    by_model = {r.data.params["model"]: r for r in trials}
    assert set(by_model) == {m["name"] for m in models}
    report = (out / "report.md").read_text()
    for name, run in by_model.items():
        assert run.info.status == "FINISHED" and run.data.tags["mlflow.parentRunId"] == parents[0].info.run_id
        m = run.data.metrics
        assert m["mask_violations"] == 0 and m["changed_outside_scope"] == 0
        assert m["achieved_sparsity"] == pytest.approx(0.5, abs=1e-4)
        assert 0.0 <= m["healed_acc"] <= 1.0 and m["rows_streamed"] == SIZES["calibration"]
        masks = MaskStore(store / "masks").load(run.data.tags["mask_key"])
        for param, mask in masks.items():  # magnitude is layer-uniform: half of every scoped tensor, exactly
            assert abs(int((~mask).sum()) - 0.5 * mask.numel()) <= 0.5, param
        assert run.data.params["mask_digest"] == mask_digest(masks)  # what the trial pruned, logged
        assert m["seeded_mask"] == 0.0  # magnitude's mask does not depend on the seed (the report's noise line)
        assert f"## {name}" in report and f"### {name} — grid `main`" in report
        assert f"`{run.info.run_id}`" in report  # the report links the trial's MLflow run
    assert (out / "report.html").is_file()
    return by_model


def _block_shapes(store: Path, run) -> dict[str, list[int]]:
    """The dense targets' shapes per block, as the store's manifest records them (rows: the calibration size)."""
    man = TargetStore(store / "targets").manifest(run.data.tags["store_key"])
    assert man["num_rows"] == SIZES["calibration"]
    return {k: list(v) for k, v in man["block_shapes"].items()}


def _cnn_shapes(model: torch.nn.Module) -> dict[str, list[int]]:
    """Each block's output shape at 224 px, measured on the architecture itself (one image)."""
    shapes: dict[str, list[int]] = {}
    hooks = [mod.register_forward_hook(lambda _m, _i, o, n=n: shapes.__setitem__(n, list(o.shape[1:])))
             for n, mod in get_adapter(model).blocks(model)]
    with torch.no_grad():
        model.eval()(torch.zeros(1, 3, 224, 224))
    for h in hooks:
        h.remove()
    return shapes


@pytest.mark.timeout(240)
def test_timm_vit_and_cnn_on_an_image_folder(tmp_path):
    """The issue's scenario: timm DeiT and ResNet-18, pretrained off, 10 classes, on an image folder (it died in
    the dense stage: orchestrator/sweep/dense.py loaded the external model by its name alone)."""
    import timm

    root = write_image_folder(tmp_path / "folder", num_classes=10, per_class=3, size=224)
    out, store, _ = _sweep(tmp_path, "folder", {"name": "imagefolder", "root": str(root)}, [VIT, CNN])
    runs = _check_sweep(out, store, [VIT, CNN])
    vit = _block_shapes(store, runs["deit_t2"])
    assert vit == {"blocks.0": [197, 192], "blocks.1": [197, 192], "logits": [10]}  # 14 x 14 patches + CLS
    cnn = timm.create_model("resnet18", pretrained=False, num_classes=10)
    assert _block_shapes(store, runs["resnet18_timm"]) == {**_cnn_shapes(cnn), "logits": [10]}
    assert _block_shapes(store, runs["resnet18_timm"])["layer4.1"] == [512, 7, 7]
    assert runs["deit_t2"].data.params["granularity"] == "token"  # each adapter's default
    assert runs["resnet18_timm"].data.params["granularity"] == "example"


@pytest.mark.timeout(240)
def test_torchvision_model_on_a_parquet_image_table(tmp_path):
    from torchvision.models import resnet18

    write_image_table(tmp_path / "images.parquet", num_classes=10, per_class=3, size=224)
    # the path relative to the spec file, the sweep started elsewhere: trials (in their own Tune directories)
    # still find the table (before 2026-11-30 every trial failed: "image table 'images.parquet' does not exist")
    out, store, _ = _sweep(tmp_path, "table", {"name": "image_table", "path": "images.parquet"}, [TV],
                           cwd=tmp_path / "elsewhere")
    run = _check_sweep(out, store, [TV])["resnet18_tv"]
    assert _block_shapes(store, run) == {**_cnn_shapes(resnet18(num_classes=10)), "logits": [10]}


@pytest.mark.timeout(240)
def test_checkpoint_model_on_a_saved_hugging_face_dataset(tmp_path, monkeypatch):
    """A safetensors checkpoint (timm MobileNetV1 weights the test writes) on a ``save_to_disk`` dataset read as a
    stream (the ``imagenet1k`` preset's code path): the sweep's dense targets are that checkpoint's outputs, not a
    random init's, on the items the sweep's processes wrote once to the machine's stream cache."""
    import pyarrow as pa
    import timm
    from safetensors.torch import save_file

    from tasks.data.stream_cache import CACHE_ENV
    from tasks.models import load_model

    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "streams"))  # inherited by healsweep and its Ray workers

    torch.manual_seed(7)
    net = timm.create_model("mobilenetv1_100", pretrained=False, num_classes=10).eval()
    ckpt = tmp_path / "mobilenet.safetensors"
    save_file({k: v.contiguous() for k, v in net.state_dict().items()}, str(ckpt))
    digest = hashlib.sha256(ckpt.read_bytes()).hexdigest()
    entry = {"name": "mobilenet_ckpt", "source": "checkpoint", "arch": "mobilenetv1_100", "num_classes": 10,
             "path": ckpt.name, "sha256": digest}  # relative to the spec file, as the hub folder below
    saved = write_hf_dataset(tmp_path / "hf", num_classes=10, per_class=3, size=224)
    out, store, _ = _sweep(tmp_path, "hf", {"name": "hf", "path": "hf", "streaming": True, "buffer_size": 16}, [entry],
                           cwd=tmp_path / "elsewhere")
    dataset = {"name": "hf", "path": str(saved), "streaming": True, "buffer_size": 16}  # as the sweep resolved it
    run = _check_sweep(out, store, [entry])["mobilenet_ckpt"]
    assert run.data.params["model_digest"] == digest[:16]  # identified by the file's bytes
    shapes = _block_shapes(store, run)
    assert shapes == {**_cnn_shapes(net), "logits": [10]} and len(shapes) == 14  # 13 blocks + logits
    (cached,) = (tmp_path / "streams").glob("*.arrow")  # one hub split, streamed once for every process
    assert pa.ipc.open_file(str(cached)).read_all().num_rows == sum(SIZES.values())
    lm = load_model("mobilenet_ckpt", source={**entry, "path": str(ckpt)}, dataset={**dataset, "sizes": SIZES})
    assert lm.dataset["calibration"].images.table.source == "cache"
    with torch.no_grad():
        expected = net(lm.dataset["calibration"].images[:SIZES["calibration"]])  # (8, 10)
    with TargetStore(store / "targets").open(run.data.tags["store_key"]) as reader:
        stored = reader.load_all()["logits"].float()  # (8, 10), float16 in the store
    assert stored.shape == (8, 10) and torch.allclose(stored, expected, atol=2e-2, rtol=1e-2)
