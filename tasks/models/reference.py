"""Model sources: the embedded reference models, trained by the project on first use and cached.

A model source is registered by name (the name used in configs, MLflow params and reports). The reference
models are trained once per content key (architecture, recipe, dataset digest, seed) and stored as
safetensors; a second request with the same settings loads the checkpoint and never retrains.
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
from safetensors.torch import load_file, save_file

from tasks._io import atomic_write
from tasks.data.splits import DatasetSplits, load_dataset
from tasks.evaluate import accuracy
from tasks.models.base import MODELS, LoadedModel, ReferenceModel, TrainRecipe
from tasks.store.format import content_key


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

    Runs with exactly TRAIN_THREADS torch threads: CPU kernels partition their reductions by thread count, so
    the same seed gives bit-identical weights (and the same content-addressed checkpoint) on every machine."""
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
    bar = tqdm(range(recipe.epochs), desc=f"training {name} (first use, then cached)", unit="epoch",
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


def _atomic_save(tensors: dict[str, torch.Tensor], path: Path, meta: dict) -> None:
    data = {k: v.contiguous() for k, v in tensors.items()}
    atomic_write(path, lambda tmp: save_file(data, tmp, metadata={"meta": json.dumps(meta)}))


def weights_digest(state: dict[str, torch.Tensor]) -> str:
    """Content digest of a state dict (names, dtypes, shapes, bytes): the reference model's identity in every
    content key. The checkpoint file itself also holds training metadata (seconds), so its bytes are not used."""
    h = hashlib.sha256()
    for k in sorted(state):
        t = state[k].detach().cpu().contiguous().reshape(-1)  # 0-dim buffers (num_batches_tracked) too
        h.update(f"{k}:{t.dtype}:{tuple(state[k].shape)}:".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()[:16]


REQUIRE_CACHED_ENV = "HEALSWEEP_REQUIRE_CACHED_MODELS"  # set for cluster workers by orchestrator/cluster.py
MIRROR_ENV = "HEALSWEEP_MODEL_MIRROR"  # a node's local copy of a remote model cache (never passed to workers)
_MIRROR: list[Path] = []  # set by the driver (set_local_mirror): its --cache directory


def set_local_mirror(path: str | os.PathLike | None) -> None:
    """This process's local directory for checkpoints of a remote model cache (the driver's --cache)."""
    _MIRROR[:] = [Path(path)] if path else []


def is_remote_cache(cache: str | os.PathLike) -> bool:
    s = os.fspath(cache)
    return "://" in s and not s.startswith("file://")


def local_mirror() -> Path:
    """Where this node keeps checkpoints of a remote model cache: set_local_mirror's, else $HEALSWEEP_MODEL_MIRROR,
    else <tmp>/healsweep-models-<uid>."""
    if _MIRROR:
        return _MIRROR[0]
    env = os.environ.get(MIRROR_ENV)
    import tempfile

    return Path(env) if env else Path(tempfile.gettempdir()) / f"healsweep-models-{os.getuid()}"


def _checkpoint(cache_dir: str | os.PathLike, fname: str) -> tuple[Path, object | None]:
    """(local path, remote StoreFS or None). A remote cache (``<store.uri>/models``) is read through a local
    mirror: a checkpoint missing locally is downloaded once; one trained here is uploaded."""
    s = os.fspath(cache_dir)
    if not is_remote_cache(s):
        return Path(s[len("file://"):] if s.startswith("file://") else s) / fname, None
    from tasks.store._fs import StoreFS

    remote = StoreFS(s)
    local = local_mirror() / fname
    if not local.exists():
        raw = remote.read_bytes(fname)
        if raw is not None:
            atomic_write(local, lambda tmp: Path(tmp).write_bytes(raw))
    return local, remote


def has_checkpoint(name: str, cache_dir: str | os.PathLike, *, data_seed: int = 0, train_seed: int = 0) -> bool:
    """Whether the model cache (local directory or remote URI) holds ``name``'s checkpoint; nothing downloaded."""
    fname = _checkpoint_name(name, data_seed, train_seed)
    s = os.fspath(cache_dir)
    if not is_remote_cache(s):
        return _checkpoint(s, fname)[0].exists()
    from tasks.store._fs import StoreFS

    return StoreFS(s).size(fname) is not None


def publish_checkpoint(name: str, cache_uri: str, *, data_seed: int = 0, train_seed: int = 0) -> bool:
    """Seed a remote model cache from this node's local mirror: upload ``name``'s checkpoint when the mirror has it
    and the remote lacks it (the driver's --cache already holds a trained model: no worker retrains it).
    -> True when uploaded."""
    if not is_remote_cache(cache_uri):
        return False
    from tasks.store._fs import StoreFS

    fname, remote = _checkpoint_name(name, data_seed, train_seed), StoreFS(cache_uri)
    local = local_mirror() / fname
    if remote.size(fname) is not None or not local.is_file():
        return False
    remote.write_atomic(fname, local.read_bytes())
    return True


def _model_key(name: str, dataset_digest: str, train_seed: int) -> str:
    src = MODELS.get(name)
    return content_key({"model": name, "arch": src.arch, "recipe": asdict(src.recipe), "dataset": dataset_digest,
                        "seed": train_seed})


def _checkpoint_name(name: str, data_seed: int, train_seed: int) -> str:
    data = load_dataset(MODELS.get(name).dataset, seed=data_seed)
    return f"{name}-{_model_key(name, data.digest, train_seed)}.safetensors"


def reference_checkpoint(name: str, cache_dir: str | os.PathLike, *, data_seed: int = 0, train_seed: int = 0
                         ) -> Path:
    """Where a reference model's checkpoint lives in a local model cache (it may not exist yet); no model built."""
    return _checkpoint(cache_dir, _checkpoint_name(name, data_seed, train_seed))[0]


def load_reference(name: str, cache_dir: str | os.PathLike, *, data_seed: int = 0, train_seed: int = 0,
                   progress: bool = True, train: bool | None = None) -> LoadedModel:
    """A registered reference model with its dataset splits, trained and cached on first use
    (content-addressed by architecture, recipe, dataset digest and seed). ``cache_dir``: a local directory or
    a remote URI (``s3://.../models``: read through :func:`local_mirror`, a model trained here is uploaded).
    ``train``: whether a missing checkpoint may be trained here (default: unless $HEALSWEEP_REQUIRE_CACHED_MODELS
    is 1, as on cluster workers, where one Ray task trains it for everyone)."""
    src = MODELS.get(name)
    data = load_dataset(src.dataset, seed=data_seed)
    key = _model_key(name, data.digest, train_seed)
    path, remote = _checkpoint(cache_dir, f"{name}-{key}.safetensors")
    torch.manual_seed(train_seed)
    model = src.build(src.arch)
    if train is None:
        train = os.environ.get(REQUIRE_CACHED_ENV) != "1"
    if path.exists():
        model.load_state_dict(load_file(path))
        with open(path, "rb") as f:  # safetensors header: 8-byte length + JSON
            header_len = int.from_bytes(f.read(8), "little")
            meta = json.loads(json.loads(f.read(header_len))["__metadata__"]["meta"])
    elif not train:  # a cluster worker: one task trained it into the shared cache; never retrain here
        where = cache_dir if remote is not None else path
        raise FileNotFoundError(f"reference model {name} is not in the model cache {where} on this node: the cache "
                                "(--cache) must be on a file system every node mounts, or give store.uri")
    else:
        import time

        t0 = time.perf_counter()
        train_classifier(model, data, src.recipe, seed=train_seed, progress=progress, name=name)
        ev = data["evaluation"]
        meta = {"model": name, "key": key, "train_seconds": round(time.perf_counter() - t0, 2),
                "dense_eval_acc": accuracy(model, ev.images, ev.labels)}
        _atomic_save(model.state_dict(), path, meta)
        if remote is not None:
            remote.write_atomic(path.name, path.read_bytes())
        meta = {**meta, "trained_now": True}  # not in the file: tells the caller this call trained it
    model.eval()
    return LoadedModel(name, model, weights_digest(model.state_dict()), data, meta)
