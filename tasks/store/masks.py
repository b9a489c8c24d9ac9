"""Mask artifacts: content-addressed safetensors files (never pickle), shared by every healer of a cell.

Beside the target store (``<store>/masks``) and without torch until a mask is written or read: a driver whose
masks already exist checks them with ``MaskStore.has`` alone (orchestrator/sweep/stages.py's mask stage)."""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping

from tasks.atomic import atomic_write
from tasks.store.fs import StoreFS
from tasks.store.format import KEY_RE, StoreError, content_key

if TYPE_CHECKING:
    import torch

SUFFIX = ".safetensors"
LAST_USE_DIR = ".last_use"  # a remote store's record of each mask's last use (MaskStore.touch)
MASK_KIND = "mask/1"  # a sweep's mask identity (orchestrator/spec/plan.py): its key is the content key of it


def content_digest(arrays: Mapping[str, Any]) -> str:
    """What a mask prunes: sha256 (16 hex) of every array's name, shape and kept entries (bits packed), in name
    order; arrays: numpy (or anything ``np.asarray`` takes) of any dtype, nonzero = kept."""
    import numpy as np

    h = hashlib.sha256()
    for name in sorted(arrays):
        a = np.asarray(arrays[name]).astype(bool, copy=False)
        h.update(f"{name}:{tuple(a.shape)};".encode())
        h.update(np.packbits(a).tobytes())  # flattened
    return h.hexdigest()[:16]


class MaskStore:
    """Masks as ``<root>/<key>.safetensors``; ``root`` is a local directory or a pyarrow.fs URI (``s3://...``),
    so a node without a shared file system reads the masks the driver wrote."""

    def __init__(self, root: str | os.PathLike, create: bool = True) -> None:
        """``create``: make the root now (False: a reader such as ``healsweep store ls``, which creates nothing)."""
        s = os.fspath(root)
        self.fs = None
        if "://" in s and not s.startswith("file://"):
            self.fs, self.root = StoreFS(s, create=create), s
        else:
            self.root = Path(s[len("file://"):] if s.startswith("file://") else s).resolve()
            if create:
                self.root.mkdir(parents=True, exist_ok=True)

    def _name(self, key: str) -> str:
        if not isinstance(key, str) or not KEY_RE.match(key):
            raise StoreError(f"invalid mask key {key!r}")
        return f"{key}{SUFFIX}"

    def _used(self, key: str) -> str:
        """A remote mask's last-use record (relative to the root)."""
        self._name(key)  # the key checked
        return f"{LAST_USE_DIR}/{key}"

    def path(self, key: str) -> Path:
        p = (Path(self.root) / self._name(key)).resolve()
        if self.fs is None and p.parent != self.root:
            raise StoreError(f"mask key {key!r} escapes the store root")
        return p

    def keys(self) -> list[str]:
        """Every mask key in the store, local or remote (files ``<key>.safetensors`` directly under the root)."""
        if self.fs is not None:
            names = [n for n in self.fs.listdir() if n.endswith(SUFFIX)]
        else:
            names = [p.name for p in Path(self.root).glob(f"*{SUFFIX}") if p.is_file() and not p.is_symlink()]
        return sorted(k for k in (n[: -len(SUFFIX)] for n in names) if KEY_RE.match(k))

    def touch(self, key: str) -> None:
        """Mark a mask used now (``healsweep store gc --older-than``): a local file's mtime; a remote object cannot
        change its time, so there its last use is written beside it (``.last_use/<key>``, an ISO timestamp)."""
        with contextlib.suppress(OSError):  # a read-only store: the mask is used all the same
            if self.fs is None:
                os.utime(self.path(key))
            else:
                self.fs.write_atomic(self._used(key), datetime.now(timezone.utc).isoformat().encode())

    def last_use(self, key: str) -> datetime | None:
        """When the mask was last used (UTC): the later of ``touch``'s record and when it was written (a record
        older than the object: the mask was written again since); None: no such mask."""
        if self.fs is None:
            with contextlib.suppress(OSError):
                return datetime.fromtimestamp(self.path(key).stat().st_mtime, timezone.utc)
            return None
        mt = self.fs.mtime(self._name(key))
        if mt is None:
            return None
        written, raw = datetime.fromtimestamp(mt, timezone.utc), self.fs.read_bytes(self._used(key))
        with contextlib.suppress(ValueError, UnicodeDecodeError):
            if raw:
                t = datetime.fromisoformat(raw.decode())
                return max(written, t if t.tzinfo else t.replace(tzinfo=timezone.utc))
        return written

    def size(self, key: str) -> int | None:
        """The mask file's bytes (None: no such mask)."""
        if self.fs is not None:
            return self.fs.size(self._name(key))
        p = self.path(key)
        return p.stat().st_size if p.is_file() else None

    def delete(self, key: str) -> None:
        """Delete a mask (and, remotely, its last-use record); a missing one is no error."""
        if self.fs is not None:
            self.fs.delete(self._name(key))
            self.fs.delete(self._used(key))
        else:
            self.path(key).unlink(missing_ok=True)

    def has(self, key: str) -> bool:
        if self.fs is not None:
            return self.fs.size(self._name(key)) is not None
        return self.path(key).is_file()

    def save(self, key: str, masks: dict[str, torch.Tensor], meta: dict) -> Path | str:
        """Write the mask with its identity (``meta``) and its content digest, both checked on every load."""
        from safetensors.torch import save, save_file

        data = {k: v.contiguous() for k, v in masks.items()}
        info = {"meta": json.dumps(meta), "digest": content_digest({k: v.cpu().numpy() for k, v in data.items()})}
        if self.fs is not None:
            self.fs.write_atomic(self._name(key), save(data, metadata=info))
            return self.fs.path(self._name(key))
        return atomic_write(self.path(key), lambda tmp: save_file(data, tmp, metadata=info))

    def load(self, key: str) -> dict[str, torch.Tensor]:
        """The mask, checked (``StoreError`` naming the key when it is damaged or another key's: ``problem``)."""
        return self.load_digested(key)[0]

    def load_digested(self, key: str) -> tuple[dict[str, torch.Tensor], str]:
        """(the checked mask, its content digest): the digest the check computed, for the trial to log."""
        import torch

        arrays, meta = self._read(key)
        digest = content_digest(arrays)
        why = _mismatch(key, digest, meta)
        if why:
            raise StoreError(f"mask {key} in {self.root} is damaged ({why}): healsweep doctor moves it aside and "
                             "the next sweep recomputes it")
        return {k: torch.from_numpy(v).bool() for k, v in arrays.items()}, digest

    def problem(self, key: str) -> str | None:
        """Why the stored mask of ``key`` cannot be used (unreadable, another key's identity, content not its
        digest), or None. Torch-free: the mask stage checks every mask it reuses."""
        try:
            arrays, meta = self._read(key)
            return _mismatch(key, content_digest(arrays), meta)
        except StoreError as e:
            return str(e)
        except Exception as e:  # noqa: BLE001 - whatever safetensors says of a damaged file
            return f"unreadable ({type(e).__name__}: {str(e)[:80]})"

    def quarantine(self, key: str) -> str | None:
        """Move a local mask aside (``<root>/.quarantine/``); -> where, or None (remote: deleted instead)."""
        if self.fs is not None:
            self.delete(key)
            return None
        dst = Path(self.root) / ".quarantine" / self._name(key)
        dst.parent.mkdir(parents=True, exist_ok=True)
        self.path(key).replace(dst)
        return str(dst)

    def _read(self, key: str) -> tuple[dict, dict]:
        """(arrays as numpy, the file's metadata)."""
        from safetensors.numpy import load

        if self.fs is not None:
            raw = self.fs.read_bytes(self._name(key))
            if raw is None:
                raise StoreError(f"mask {key} not found in {self.root}")
        else:
            raw = self.path(key).read_bytes()
        return load(raw), _metadata(raw)


def _metadata(raw: bytes) -> dict:
    """A safetensors file's ``__metadata__`` (its JSON header, read without the tensors)."""
    n = int.from_bytes(raw[:8], "little")
    head = json.loads(raw[8 : 8 + n])
    return head.get("__metadata__") or {}


def _mismatch(key: str, digest: str, meta: Mapping[str, str]) -> str | None:
    """Why a mask file is not ``key``'s intact mask, or None: its identity names another key (a file copied or
    swapped), or its content (``digest``: content_digest of its arrays) is not the digest written with it."""
    try:
        ident = json.loads(meta.get("meta") or "{}")
    except ValueError:
        return "its identity is unreadable"
    if isinstance(ident, dict) and ident.get("kind") == MASK_KIND:
        owner = content_key({k: v for k, v in ident.items() if k != "provenance"})
        if owner != key:
            return f"it holds the mask of key {owner}"
    if meta.get("digest") and digest != meta["digest"]:
        return "its content is not the digest written with it"
    return None
