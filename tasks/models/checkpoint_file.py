"""Checkpoint files: their sha256 (a model's identity in every key), a structural check that reads no tensor, and
the one verified loader every source uses (shipped reference weights, trained ones, users' checkpoints).

A file is refused with a one-line ``ModelSourceError`` naming it, before anything is loaded: missing, a sha256
that does not match the expected one, a safetensors file that is truncated or not safetensors at all.
"""
from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Mapping

from tasks.atomic import sha256_file
from tasks.models.base import ModelSourceError
from tasks.errors import first_line

DIGEST_LEN = 16  # hex characters of the sha256 used in keys, file names and MLflow params


def file_digest(path: str | os.PathLike) -> str:
    """A file's identity in keys and MLflow params: the first 16 hex of its sha256 (its path plays no part)."""
    return sha256_file(path)[:DIGEST_LEN]


def safetensors_header(path: str | os.PathLike) -> dict:
    """The JSON header of a safetensors file, checked against the file's size (a truncated file, or one that is
    not safetensors, is a one-line ModelSourceError); no tensor is read."""
    p = Path(path)
    size = p.stat().st_size
    with open(p, "rb") as f:
        head = f.read(8)
        n = int.from_bytes(head, "little") if len(head) == 8 else -1
        if not 2 <= n <= size - 8:
            raise ModelSourceError(f"checkpoint {str(p)!r}: not a safetensors file (no valid header; truncated?)")
        try:
            header = json.loads(f.read(n))
        except ValueError:
            raise ModelSourceError(f"checkpoint {str(p)!r}: not a safetensors file (its header is not JSON)") from None
    ends = [v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"] if isinstance(header, dict) else None
    if not ends or any(not isinstance(e, int) for e in ends):
        raise ModelSourceError(f"checkpoint {str(p)!r}: not a safetensors file (no tensors in its header)")
    if 8 + n + max(ends) != size:
        raise ModelSourceError(f"checkpoint {str(p)!r}: truncated or padded: {size} bytes, its header says "
                               f"{8 + n + max(ends)}")
    return header


def verify(path: str | os.PathLike, sha256: str | None = None) -> str:
    """The full sha256 of a checkpoint that exists, matches ``sha256`` (a prefix of at least 16 hex, when given)
    and, for .safetensors, is a complete safetensors file; otherwise a one-line ModelSourceError naming it."""
    p = Path(path)
    if not p.is_file():
        raise ModelSourceError(f"checkpoint {str(p)!r}: file not found")
    got = sha256_file(p)
    if sha256 is not None and not got.startswith(sha256.lower()):
        raise ModelSourceError(f"checkpoint {str(p)!r}: sha256 {got[:DIGEST_LEN]}… does not match the expected "
                               f"{sha256[:DIGEST_LEN]}…; refused (not loaded)")
    if p.suffix == ".safetensors":
        safetensors_header(p)
    return got


def check_sha256(value, where: str) -> str | None:
    """A spec's ``sha256`` pin: None, or 16 to 64 hex characters (lower-cased); else a one-line ModelSourceError."""
    if value is None:
        return None
    if not isinstance(value, str) or not 16 <= len(value) <= 64 or any(c not in "0123456789abcdef" for c in
                                                                          value.lower()):
        raise ModelSourceError(f"must be 16 to 64 hex characters of the file's sha256, got {value!r}", field=where)
    return value.lower()


def checkpoint_meta(path: str | os.PathLike) -> dict:
    """The ``meta`` JSON a healsweep checkpoint carries in its safetensors metadata ({} when it has none)."""
    raw = (safetensors_header(path).get("__metadata__") or {}).get("meta")
    try:
        meta = json.loads(raw) if raw else {}
    except ValueError:
        meta = {}
    return meta if isinstance(meta, dict) else {}


def read_state_dict(path: str | os.PathLike, sha256: str | None = None):
    """A verified state dict (:func:`verify`) from .safetensors, or from a torch file loaded with
    weights_only=True (never pickle code)."""
    import torch

    p = Path(path)
    verify(p, sha256)
    if p.suffix == ".safetensors":
        from safetensors.torch import load_file

        try:
            return load_file(str(p))
        except Exception as e:  # noqa: BLE001 - a header that passed the size check but not safetensors' own
            raise ModelSourceError(f"checkpoint {str(p)!r}: not a valid safetensors file: "
                                   f"{first_line(e, 200)}") from None
    try:
        sd = torch.load(str(p), map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001
        why = re.sub(r"\x1b\[[0-9;]*m", "", first_line(e, 400))[:160]  # torch's message, no ANSI codes
        raise ModelSourceError(f"checkpoint {str(p)!r}: not loadable with weights_only=True (only tensors are read: a "
                               f"whole pickled model is not; save model.state_dict() instead): {why}") from None
    for key in ("state_dict", "model", "model_state_dict"):  # common wrappers
        if isinstance(sd, Mapping) and isinstance(sd.get(key), Mapping):
            sd = sd[key]
    if not isinstance(sd, Mapping) or not all(isinstance(v, torch.Tensor) for v in sd.values()):
        raise ModelSourceError(f"checkpoint {str(p)!r}: expected a mapping of parameter names to tensors")
    return dict(sd)


def fit_problem(model_sd: Mapping, file_sd: Mapping) -> str:
    """Why a state dict does not load into a model with ``strict=True``, in one line: missing and unexpected keys
    and shape mismatches with examples, and the likely cause (a ``module.`` prefix, another ``num_classes``). torch's
    own message starts with a header line and puts every key on the next ones."""
    missing = [k for k in model_sd if k not in file_sd]
    extra = [k for k in file_sd if k not in model_sd]
    shapes = [k for k in model_sd if k in file_sd and tuple(model_sd[k].shape) != tuple(file_sd[k].shape)]
    parts = ([f"{len(missing)} missing key(s) (e.g. {', '.join(missing[:2])})"] if missing else []) + \
        ([f"{len(extra)} unexpected (e.g. {', '.join(extra[:2])})"] if extra else []) + \
        [f"{len(shapes)} of another shape (e.g. {k}: file {list(file_sd[k].shape)}, model {list(model_sd[k].shape)})"
         for k in shapes[:1]]
    hint = ""
    if extra and all(k.startswith("module.") for k in extra) and {k[7:] for k in extra} >= set(missing):
        hint = "; its keys carry a 'module.' prefix (a DistributedDataParallel save): strip it"
    elif shapes and set(shapes) <= set(list(model_sd)[-2:]):  # only the classifier (its weight and bias)
        k = shapes[0]
        hint = (f"; the last layer differs: the file's has {file_sd[k].shape[0]} outputs (set num_classes: "
                f"{file_sd[k].shape[0]})")
    return (", ".join(parts) or "the state dict does not load") + hint
