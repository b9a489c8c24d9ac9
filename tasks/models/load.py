"""One entry point for every model a spec can name: reference models (the shipped weights, or a trained checkpoint
given by ``path``) and external ones (timm, torchvision, checkpoints)."""
from __future__ import annotations

import copy
import json
import os
from dataclasses import replace
from typing import Any, Mapping

import torch

from tasks.data import redraw_calibration
from tasks.models.base import LoadedModel
from tasks.models.external import load_external
from tasks.models.reference import load_reference


def load_model(name: str, cache_dir: str | os.PathLike | None = None, *, data_seed: int = 0, progress: bool = True,
               source: dict | None = None, dataset: dict | None = None, calib_seed: int = 0) -> LoadedModel:
    """Load a model with its dataset splits. Without ``source``: a registered reference model's shipped weights.
    ``source`` is a ``tasks.models.ModelRef`` as a dict: a reference model with ``path`` (a checkpoint written by
    ``healsweep models train``, optional ``sha256`` pin), or timm / torchvision / checkpoint with ``dataset``
    {name, settings...}. Nothing is trained or downloaded into ``cache_dir`` (the model cache, where
    ``healsweep models train`` writes; kept in the signature for the callers that pass it); ``progress``: unused
    (loading is quick), kept likewise. ``calib_seed``: which draw of the calibration split its sizes take
    (tasks.data.redraw_calibration; 0: the data seed's order)."""
    if source and source.get("source", "reference") != "reference":
        lm = load_external(source, dataset or {"name": "digits"}, data_seed)
    else:
        src = source or {}
        lm = load_reference(name, data_seed=data_seed, path=src.get("path"), sha256=src.get("sha256"))
    return replace(lm, dataset=redraw_calibration(lm.dataset, calib_seed)) if calib_seed else lm


# ------------------------------------------------------------------------------------------ loaded once per process
_KEPT: dict[tuple, LoadedModel] = {}  # this process's loaded, verified models, never modified: callers get copies


def load_model_copy(name: str, cache_dir: str | os.PathLike | None = None, *, data_seed: int = 0, keep: int = 1,
                    source: dict | None = None, dataset: dict | None = None, calib_seed: int = 0) -> LoadedModel:
    """``load_model`` once per process and arguments (at most ``keep`` models kept; a checkpoint replaced on disk
    is loaded and verified again), then a deep copy of the model per call: callers may prune, heal or move it.
    The dataset splits are shared (nothing writes to them). torch's global RNG is left as it was (building seeds
    it): cached or not, no trace."""
    key = (name, data_seed, calib_seed, json.dumps(source, sort_keys=True, default=str),
           json.dumps(dataset, sort_keys=True, default=str), _file_stamp(source))
    if key not in _KEPT:
        if len(_KEPT) >= max(1, keep):
            _KEPT.clear()
        with torch.random.fork_rng(devices=[]):
            _KEPT[key] = load_model(name, cache_dir, data_seed=data_seed, progress=False, source=source,
                                    dataset=dataset, calib_seed=calib_seed)
    lm = _KEPT[key]
    return replace(lm, model=copy.deepcopy(lm.model))


def load_model_shared(name: str, cache_dir: str | os.PathLike | None = None, *, data_seed: int = 0,
                      progress: bool = True, source: dict | None = None, dataset: dict | None = None,
                      calib_seed: int = 0) -> LoadedModel:
    """``load_model`` for code that loads the same model again and again in one process (the driver's models,
    dense and mask stages): an external model (timm, torchvision, checkpoint: seconds to build and
    initialise, its dataset read and preprocessed each time) is loaded once and copied (``load_model_copy``, the
    last one kept); a reference model (milliseconds) is loaded as ``load_model`` loads it."""
    if source and source.get("source", "reference") != "reference":
        return load_model_copy(name, cache_dir, data_seed=data_seed, source=source, dataset=dataset,
                               calib_seed=calib_seed)
    return load_model(name, cache_dir, data_seed=data_seed, progress=progress, source=source, dataset=dataset,
                      calib_seed=calib_seed)


def forget() -> None:
    """Drop this process's kept models (``load_model_copy``): a driver calls it once its stages that load models
    have run (trials run in processes of their own; a kept model with its preprocessed dataset can be GBs)."""
    _KEPT.clear()


def _file_stamp(source: Mapping[str, Any] | None) -> tuple:
    """(size, mtime) of a checkpoint named by ``path``: a file replaced on disk is loaded (and verified) again."""
    path = (source or {}).get("path")
    if not path:
        return ()
    try:
        st = os.stat(path)
    except OSError:
        return ("missing",)
    return (st.st_size, st.st_mtime_ns)
