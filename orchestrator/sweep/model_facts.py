"""What the driver derives from a reference model, cached, so that a sweep over a warm model cache and store never
builds the model in the driver.

The models stage loads every model to derive its ``ModelInfo`` (weights digest, dense accuracy, blocks, target-store
key, calibration digest, default granularity). Building one imports timm, and through it torchvision and
torch._dynamo: ~2 CPU-s of a tiny sweep's start-up on 2 cores. When the targets and masks are already in the store,
nothing else in the driver needs the model (each trial loads its own), so the facts are cached like the spec's
compatibility verdicts (orchestrator/spec/verdicts.py), in the same directory (``.healsweep/checks``,
``HEALSWEEP_CHECK_CACHE``; ``off`` disables both).

``ModelInfo`` is a pure function of the checkpoint's bytes, the data seed, the store dtype, the model's scope
and the code that loads, hashes and names things; the key is made of exactly those: the shipped weights' sha256
(tasks/models/weights, verified by every load that builds the model; its copy in tasks/catalog.py is read here, so a
hit imports no torch), the spec values, and ``verdicts.code_digest()`` (every source file under ``tasks/`` and
``orchestrator/spec/`` and the torch, timm and torchvision versions). Only reference models' shipped weights are
cached; other checkpoints, external models (timm pretrained, checkpoints) and specs with plugins are loaded as before.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Callable

from orchestrator.spec.verdicts import cache_dir, code_digest, write_entry
from tasks.catalog import SHIPPED_SHA256


@dataclass(frozen=True)
class ModelInfo:
    """What the driver derives from one model of a sweep (orchestrator.sweep.stages.model_info)."""
    name: str
    digest: str
    dense_acc: float
    scope: str
    blocks: tuple[str, ...]
    store_key: str
    calib_digest: str
    default_granularity: str = "example"  # its adapter's (the trials' default alignment granularity)


def cached_model_info(spec, name: str, compute: Callable[[], ModelInfo]) -> ModelInfo:
    """``compute()`` (stages.model_info) unless the facts of the same weights and settings are cached; a
    computed one is cached."""
    root = cache_dir()
    if root is None or spec.plugins or "source" in spec.load_kwargs(name) or name not in SHIPPED_SHA256:
        return compute()
    path = root / f"model-{_key(spec, name, SHIPPED_SHA256[name])}.json"
    hit = _read(path)
    if hit is not None:
        return hit
    info = compute()
    write_entry(path, asdict(info))
    return info


def _key(spec, name: str, sha256: str) -> str:
    draw = {"calib_seed": spec.calib_seed} if spec.calib_seed else {}  # 0: the keys of sweeps before it existed
    blob = json.dumps({"model": name, "data_seed": spec.data_seed, "dtype": spec.store.dtype,
                       "scope": spec.scope.get(name), "weights": sha256, "code": code_digest(), **draw}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()


def _read(path: Path) -> ModelInfo | None:
    """The cached ModelInfo, or None when the file is missing, unreadable or not exactly ModelInfo's fields."""
    try:
        v = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    names = {f.name for f in fields(ModelInfo)}
    if not isinstance(v, dict) or set(v) != names:
        return None
    return ModelInfo(**{**v, "blocks": tuple(v["blocks"])})
