"""The target store's format: key and file names, constants, the canonical JSON/key codec, errors and the
16-bit tensor codec. A leaf module: the writer (core), reader and builder import it; nothing here imports them."""
from __future__ import annotations

import hashlib
import json
import logging
import platform
import re
from importlib.metadata import version

import numpy as np
import pyarrow as pa
import torch

log = logging.getLogger("healsweep.store")

KEY_RE = re.compile(r"^[0-9a-f]{32}$")
FORMAT = "healsweep-targets/1"
MANIFEST = "manifest.json"
VERIFIED = "verified.json"  # {shard file: {sha256, bytes, mtime}} of the last passing checksum (a record, not trusted)
LAST_USE = "last_use"  # ISO timestamp of the latest open (for `healsweep store ls/gc`)
LOCK = "lock"  # flock target of writers (local filesystems)
QUARANTINE = ".quarantine"  # <root>/.quarantine/<key>-<utc time>-<file>: damaged files moved aside, kept for inspection
BATCH_ROWS = 256  # max rows per Arrow record batch inside a shard file
_FILE_RE = re.compile(r"^(shard-\d{5,}\.(arrow|json)|manifest\.json|verified\.json|last_use|lock)$")
DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}
_DTYPE_NAMES = {v: k for k, v in DTYPES.items()}


def canonical_json(obj) -> str:
    """Deterministic JSON text: sorted keys, no whitespace, ASCII only; tuples become lists.

    Raises ValueError on NaN/inf and TypeError on anything JSON cannot represent.
    """
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False)


def content_key(obj) -> str:
    """32 hex chars: sha256 of ``canonical_json(obj)`` truncated to 128 bits."""
    return hashlib.sha256(canonical_json(obj).encode("ascii")).hexdigest()[:32]


class StoreError(Exception):
    """Invalid key, incomplete or corrupt store content, or inconsistent arguments."""


def producer_versions() -> dict[str, str]:
    try:
        hs = version("healsweep")
    except Exception:  # noqa: BLE001 - not installed as a distribution
        hs = "unknown"
    return {"healsweep": hs, "torch": torch.__version__, "pyarrow": pa.__version__, "numpy": np.__version__,
            "python": platform.python_version()}


def to_u16(t: torch.Tensor) -> np.ndarray:
    """(rows, *shape) float16/bfloat16 tensor -> (rows, prod(shape)) uint16 raw bit patterns."""
    a = t.detach().to("cpu").contiguous().view(torch.int16).numpy().view(np.uint16)
    return a.reshape(t.shape[0], -1)


def from_u16(a: np.ndarray, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """(B, prod(shape)) uint16 -> (B, *shape) tensor of ``dtype`` sharing ``a``'s memory."""
    return torch.from_numpy(a.view(np.int16)).view(dtype).reshape(a.shape[0], *shape)


def shard_name(index: int) -> str:
    return f"shard-{index:05d}.arrow"


def sidecar_name(index: int) -> str:
    return f"shard-{index:05d}.json"
