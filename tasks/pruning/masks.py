"""Mask artifacts: content-addressed safetensors files (never pickle), shared by every healer of a cell."""
from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from tasks._io import atomic_write
from tasks.store import KEY_RE, StoreError


class MaskStore:
    def __init__(self, root: str | os.PathLike) -> None:
        self.root = Path(root).resolve()
        self.root.mkdir(parents=True, exist_ok=True)

    def path(self, key: str) -> Path:
        if not isinstance(key, str) or not KEY_RE.match(key):
            raise StoreError(f"invalid mask key {key!r}")
        p = (self.root / f"{key}.safetensors").resolve()
        if p.parent != self.root:
            raise StoreError(f"mask key {key!r} escapes the store root")
        return p

    def has(self, key: str) -> bool:
        return self.path(key).is_file()

    def save(self, key: str, masks: dict[str, torch.Tensor], meta: dict) -> Path:
        data = {k: v.contiguous() for k, v in masks.items()}
        return atomic_write(self.path(key), lambda tmp: save_file(data, tmp, metadata={"meta": json.dumps(meta)}))

    def load(self, key: str) -> dict[str, torch.Tensor]:
        return {k: v.bool() for k, v in load_file(self.path(key)).items()}
