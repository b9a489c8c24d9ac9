"""The target store's format: key and file names, constants, the canonical JSON/key codec and errors. A leaf
module without torch (a driver checks a warm store without importing it): the writer (core), reader and builder
import it; nothing here imports them. The 16-bit tensor codec is ``tasks.store.codec``."""
from __future__ import annotations

import hashlib
import json
import logging
import platform
import re
from importlib.metadata import version

import numpy as np
import pyarrow as pa

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
DTYPE_NAMES = ("float16", "bfloat16")  # the 16-bit dtypes a key may hold (tasks.store.codec.DTYPES: as torch dtypes)


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
    import torch  # only where a manifest is written (after a shard was computed): a warm store's check needs none

    try:
        hs = version("healsweep")
    except Exception:  # noqa: BLE001 - not installed as a distribution
        hs = "unknown"
    return {"healsweep": hs, "torch": torch.__version__, "pyarrow": pa.__version__, "numpy": np.__version__,
            "python": platform.python_version()}


def shard_name(index: int) -> str:
    return f"shard-{index:05d}.arrow"


def sidecar_name(index: int) -> str:
    return f"shard-{index:05d}.json"
