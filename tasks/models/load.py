"""One entry point for every model a spec can name: reference models (trained and cached on first use) and
external ones (timm, torchvision, checkpoints)."""
from __future__ import annotations

import os

from tasks.models.base import LoadedModel
from tasks.models.external import load_external
from tasks.models.reference import load_reference


def load_model(name: str, cache_dir: str | os.PathLike, *, data_seed: int = 0, train_seed: int = 0,
               progress: bool = True, source: dict | None = None, dataset: dict | None = None,
               train: bool | None = None) -> LoadedModel:
    """Load a model with its dataset splits. Without ``source`` (or with source ``reference``): a registered
    reference model, trained and cached on first use (content-addressed). Otherwise ``source`` is a
    ``tasks.models.ModelRef`` as a dict (timm, torchvision, checkpoint) and ``dataset`` {name, settings...}.
    ``cache_dir``: a local directory or a remote URI (``<store.uri>/models``); ``train``: see load_reference."""
    if source and source.get("source", "reference") != "reference":
        return load_external(source, dataset or {"name": "digits"}, data_seed)
    return load_reference(name, cache_dir, data_seed=data_seed, train_seed=train_seed, progress=progress, train=train)
