"""One entry point for every model a spec can name: reference models (the shipped weights, or a trained checkpoint
given by ``path``) and external ones (timm, torchvision, checkpoints)."""
from __future__ import annotations

import os

from tasks.models.base import LoadedModel
from tasks.models.external import load_external
from tasks.models.reference import load_reference


def load_model(name: str, cache_dir: str | os.PathLike | None = None, *, data_seed: int = 0, progress: bool = True,
               source: dict | None = None, dataset: dict | None = None) -> LoadedModel:
    """Load a model with its dataset splits. Without ``source``: a registered reference model's shipped weights.
    ``source`` is a ``tasks.models.ModelRef`` as a dict: a reference model with ``path`` (a checkpoint written by
    ``healsweep models train``, optional ``sha256`` pin), or timm / torchvision / checkpoint with ``dataset``
    {name, settings...}. Nothing is trained or downloaded into ``cache_dir`` (the model cache, where
    ``healsweep models train`` writes; kept in the signature for the callers that pass it); ``progress``: unused
    (loading is quick), kept likewise."""
    if source and source.get("source", "reference") != "reference":
        return load_external(source, dataset or {"name": "digits"}, data_seed)
    src = source or {}
    return load_reference(name, data_seed=data_seed, path=src.get("path"), sha256=src.get("sha256"))
