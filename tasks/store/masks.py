"""Mask artifacts: content-addressed safetensors files (never pickle), shared by every healer of a cell.

Beside the target store (``<store>/masks``) and without torch until a mask is written or read: a driver whose
masks already exist checks them with ``MaskStore.has`` alone (orchestrator/sweep/stages.py's mask stage)."""
from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path
from typing import TYPE_CHECKING

from tasks.atomic import atomic_write
from tasks.store.fs import StoreFS
from tasks.store.format import KEY_RE, StoreError

if TYPE_CHECKING:
    import torch

SUFFIX = ".safetensors"


class MaskStore:
    """Masks as ``<root>/<key>.safetensors``; ``root`` is a local directory or a pyarrow.fs URI (``s3://...``),
    so a node without a shared file system reads the masks the driver wrote."""

    def __init__(self, root: str | os.PathLike) -> None:
        s = os.fspath(root)
        self.fs = None
        if "://" in s and not s.startswith("file://"):
            self.fs, self.root = StoreFS(s), s
        else:
            self.root = Path(s[len("file://"):] if s.startswith("file://") else s).resolve()
            self.root.mkdir(parents=True, exist_ok=True)

    def _name(self, key: str) -> str:
        if not isinstance(key, str) or not KEY_RE.match(key):
            raise StoreError(f"invalid mask key {key!r}")
        return f"{key}{SUFFIX}"

    def path(self, key: str) -> Path:
        p = (Path(self.root) / self._name(key)).resolve()
        if self.fs is None and p.parent != self.root:
            raise StoreError(f"mask key {key!r} escapes the store root")
        return p

    def keys(self) -> list[str]:
        """Every mask key of a local store (a remote one: [])."""
        if self.fs is not None:
            return []
        return sorted(p.name[: -len(SUFFIX)] for p in Path(self.root).glob(f"*{SUFFIX}")
                      if KEY_RE.match(p.name[: -len(SUFFIX)]) and p.is_file() and not p.is_symlink())

    def touch(self, key: str) -> None:
        """Mark a local mask used now: its file's mtime is its last use (``healsweep store gc --older-than``)."""
        if self.fs is None:
            with contextlib.suppress(OSError):  # a read-only store: the mask is used all the same
                os.utime(self.path(key))

    def has(self, key: str) -> bool:
        if self.fs is not None:
            return self.fs.size(self._name(key)) is not None
        return self.path(key).is_file()

    def save(self, key: str, masks: dict[str, torch.Tensor], meta: dict) -> Path | str:
        from safetensors.torch import save, save_file

        data = {k: v.contiguous() for k, v in masks.items()}
        info = {"meta": json.dumps(meta)}
        if self.fs is not None:
            self.fs.write_atomic(self._name(key), save(data, metadata=info))
            return self.fs.path(self._name(key))
        return atomic_write(self.path(key), lambda tmp: save_file(data, tmp, metadata=info))

    def load(self, key: str) -> dict[str, torch.Tensor]:
        from safetensors.torch import load, load_file

        if self.fs is not None:
            raw = self.fs.read_bytes(self._name(key))
            if raw is None:
                raise StoreError(f"mask {key} not found in {self.root}")
            return {k: v.bool() for k, v in load(raw).items()}
        return {k: v.bool() for k, v in load_file(self.path(key)).items()}
