"""The embedded reference models: architectures and recipes, registered by name (the name used in configs,
MLflow params and reports), loaded from the weights shipped in the repository (tasks/models/weights/) or from a
checkpoint ``healsweep models train`` wrote.

A reference model is identified by the sha256 of its checkpoint file (first 16 hex: ``LoadedModel.digest``), the
model's identity in every content key (dense targets, masks, diagnostics) and in the trials' ``model_digest``
MLflow param. Loading never trains: training is an explicit command that writes a new file named by its own
digest into the model cache, never over the shipped weights.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
from dataclasses import asdict
from pathlib import Path

import torch
import torch.nn as nn

from tasks.atomic import atomic_write_bytes
from tasks.data.splits import DatasetSplits, load_dataset
from tasks.evaluate import accuracy
from tasks.models.base import MODELS, LoadedModel, ModelSourceError, ReferenceModel, TrainRecipe
from tasks.models.checkpoint_file import DIGEST_LEN, checkpoint_meta, fit_problem, read_state_dict, verify
from tasks.models.weights import DATA_SEED, SHIPPED


def _build_vit(arch: dict) -> nn.Module:
    from timm.models.vision_transformer import VisionTransformer

    return VisionTransformer(**arch)


def _build_resnet(arch: dict) -> nn.Module:
    from timm.models.resnet import BasicBlock, ResNet

    model = ResNet(block=BasicBlock, layers=tuple(arch["layers"]), channels=tuple(arch["channels"]),
                   in_chans=arch["in_chans"], num_classes=arch["num_classes"])
    # CIFAR-style stem for 16x16 inputs: one 3x3 stride-1 conv (timm's stem width, 64), no max-pool.
    model.conv1 = nn.Conv2d(arch["in_chans"], model.bn1.num_features, 3, 1, 1, bias=False)
    model.maxpool = nn.Identity()
    return model


for _src in (
    ReferenceModel(
        name="vit_digits", dataset="digits",
        arch=dict(img_size=16, patch_size=4, in_chans=1, num_classes=10, embed_dim=64, depth=6,
                  num_heads=4, mlp_ratio=4.0),
        build=_build_vit,
        recipe=TrainRecipe(epochs=80, lr=2e-3, weight_decay=0.05, batch_size=64, max_shift=2,
                           label_smoothing=0.1),
    ),
    ReferenceModel(
        name="resnet_digits", dataset="digits",
        arch=dict(layers=[1, 1, 1, 1], channels=[16, 32, 64, 128], in_chans=1,
                  num_classes=10),
        build=_build_resnet,
        recipe=TrainRecipe(epochs=30, lr=3e-3, weight_decay=5e-4, batch_size=64, max_shift=2),
    ),
):
    MODELS.register(_src.name)(_src)


def random_shift(x: torch.Tensor, max_shift: int, gen: torch.Generator) -> torch.Tensor:
    """Translate each image by up to ``max_shift`` pixels, padding with the background value -1. (B,C,H,W)."""
    if max_shift <= 0:
        return x
    b, _, h, w = x.shape
    pad = torch.nn.functional.pad(x, (max_shift,) * 4, value=-1.0)  # (B, C, H+2s, W+2s)
    dy = torch.randint(0, 2 * max_shift + 1, (b,), generator=gen)
    dx = torch.randint(0, 2 * max_shift + 1, (b,), generator=gen)
    return torch.stack([pad[i, :, dy[i] : dy[i] + h, dx[i] : dx[i] + w] for i in range(b)])


def train_classifier(model: nn.Module, data: DatasetSplits, recipe: TrainRecipe, seed: int,
                     progress: bool = True, name: str = "dense model") -> None:
    """Supervised training on the ``train`` split only (AdamW, cosine schedule).

    Runs with exactly TRAIN_THREADS torch threads: CPU kernels partition their reductions by thread count, so the
    same seed gives bit-identical weights on one machine; another CPU type (other kernels) gives other weights,
    which is why the reference weights are shipped rather than retrained."""
    from tqdm.auto import tqdm

    threads = torch.get_num_threads()
    torch.set_num_threads(TRAIN_THREADS)
    try:
        _train(model, data, recipe, seed, progress, tqdm, name)
    finally:
        torch.set_num_threads(threads)


TRAIN_THREADS = 2


def _train(model: nn.Module, data: DatasetSplits, recipe: TrainRecipe, seed: int, progress: bool, tqdm,
           name: str) -> None:
    gen = torch.Generator().manual_seed(seed)
    train = data["train"]
    n = len(train)
    steps_per_epoch = math.ceil(n / recipe.batch_size)
    opt = torch.optim.AdamW(model.parameters(), lr=recipe.lr, weight_decay=recipe.weight_decay)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=recipe.lr, total_steps=recipe.epochs * steps_per_epoch,
                                                pct_start=0.1)
    loss_fn = nn.CrossEntropyLoss(label_smoothing=recipe.label_smoothing)
    model.train()
    bar = tqdm(range(recipe.epochs), desc=f"training {name}", unit="epoch",
               disable=not progress, leave=False)
    for _ in bar:
        perm = torch.randperm(n, generator=gen)
        for i in range(0, n, recipe.batch_size):
            idx = perm[i : i + recipe.batch_size]
            x = random_shift(train.images[idx], recipe.max_shift, gen)
            loss = loss_fn(model(x), train.labels[idx])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
        bar.set_postfix(loss=f"{loss.item():.3f}")
    model.eval()


def train_reference(name: str, cache_dir: str | os.PathLike, *, data_seed: int = 0, train_seed: int = 0,
                    progress: bool = True) -> tuple[Path, str, float]:
    """Train reference model ``name`` with its recipe and write ``<cache_dir>/<name>-<sha256[:16]>.safetensors``
    (named by its own digest: a file of that name already holds these exact bytes and is left as it is; the
    shipped weights are never touched). -> (path, full sha256, evaluation accuracy)."""

    from safetensors.torch import save

    src = MODELS.get(name)
    data = load_dataset(src.dataset, seed=data_seed)
    torch.manual_seed(train_seed)
    model = src.build(src.arch)
    train_classifier(model, data, src.recipe, seed=train_seed, progress=progress, name=name)
    ev = data["evaluation"]
    acc = accuracy(model, ev.images, ev.labels)
    meta = {"model": name, "arch": src.arch, "recipe": asdict(src.recipe), "dataset": data.digest,
            "data_seed": data_seed, "train_seed": train_seed, "torch": torch.__version__, "dense_eval_acc": acc}
    raw = save({k: v.contiguous() for k, v in model.state_dict().items()}, metadata={"meta": json.dumps(meta)})
    sha = hashlib.sha256(raw).hexdigest()
    path = Path(cache_dir) / f"{name}-{sha[:DIGEST_LEN]}.safetensors"
    if not path.is_file():
        atomic_write_bytes(path, raw)
    return path, sha, acc


def check_shipped_seed(name: str, data_seed: int) -> None:
    """The shipped weights of ``name`` serve only DATA_SEED: they were trained on its train split, which other
    seeds' calibration and evaluation splits overlap. Otherwise a one-line ModelSourceError saying what to do."""
    if data_seed != DATA_SEED:
        raise ModelSourceError(f"model {name!r}: the shipped weights were trained on data_seed {DATA_SEED}'s train "
                               f"split; for data_seed {data_seed} train one (healsweep models train {name} "
                               f"--data-seed {data_seed}) and give it as {{name: {name}, path: FILE}}")


def check_checkpoint(name: str, path: str | os.PathLike, sha256: str | None, data_seed: int,
                     dataset_digest: str | None = None) -> tuple[str, dict]:
    """A reference checkpoint fit for ``name`` and ``data_seed``: verified (exists, sha256, complete safetensors)
    and made by ``healsweep models train`` for this model and data seed (its metadata says so). -> (full sha256,
    metadata); else a one-line ModelSourceError naming the file. Reads no tensor."""
    sha = verify(path, sha256)
    meta = checkpoint_meta(path)
    where = f"checkpoint {str(path)!r}"
    if meta.get("model") != name:
        raise ModelSourceError(f"{where}: not a {name} checkpoint written by healsweep models train "
                               f"(its metadata names {meta.get('model')!r})")
    if meta.get("data_seed") != data_seed or (dataset_digest is not None and meta.get("dataset") != dataset_digest):
        raise ModelSourceError(f"{where}: trained on data_seed {meta.get('data_seed')!r}'s train split, not on "
                               f"data_seed {data_seed}'s (its calibration and evaluation splits would overlap it)")
    return sha, meta


def load_reference(name: str, *, data_seed: int = 0, path: str | os.PathLike | None = None,
                   sha256: str | None = None) -> LoadedModel:
    """A registered reference model with its dataset splits: the shipped weights (verified against the sha256
    recorded in tasks/models/weights), or the checkpoint at ``path`` (verified against ``sha256`` when given).
    Never trains; a bad file is a one-line ModelSourceError naming it, before any tensor is loaded."""
    src = MODELS.get(name)
    if path is None:
        check_shipped_seed(name, data_seed)
        path, sha256 = SHIPPED[name].path, SHIPPED[name].sha256
    data = load_dataset(src.dataset, seed=data_seed)
    sha, meta = check_checkpoint(name, path, sha256, data_seed, data.digest)
    torch.manual_seed(0)
    model = src.build(src.arch)
    sd = read_state_dict(path, sha)
    try:
        model.load_state_dict(sd, strict=True)
    except RuntimeError:
        raise ModelSourceError(f"checkpoint {str(path)!r}: does not fit {name}: "
                               f"{fit_problem(model.state_dict(), sd)[:400]}") from None
    model.eval()
    return LoadedModel(name, model, sha[:DIGEST_LEN], data, {**meta, "sha256": sha, "path": str(path)})
