"""Data sources and the four disjoint splits (SPEC §1).

Every source yields ``train`` (dense training only), ``calibration`` (unlabeled: its labels are never
exposed), ``selection`` (hyperparameter search objective) and ``evaluation`` (the only reported accuracy).
The calibration order is one fixed permutation per (dataset, seed); a calibration size n means its first n
items, so one dense cache of the largest n serves every smaller n.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Callable

import numpy as np
import torch
import torch.nn.functional as F

from tasks._registry import Registry

SPLITS = ("train", "calibration", "selection", "evaluation")


@dataclass(frozen=True)
class SplitData:
    images: torch.Tensor  # (N, C, H, W) float32, already preprocessed
    labels: torch.Tensor | None  # (N,) int64; None for the calibration split (unlabeled by contract)
    indices: np.ndarray  # (N,) int64 indices into the source dataset, in split order

    def __len__(self) -> int:
        return int(self.images.shape[0])


@dataclass(frozen=True)
class DatasetSplits:
    name: str
    num_classes: int
    image_shape: tuple[int, int, int]  # (C, H, W)
    splits: dict[str, SplitData] = field(repr=False)
    digest: str = ""  # content digest of (source, transform, split indices)

    def __getitem__(self, split: str) -> SplitData:
        return self.splits[split]

    def split_digest(self, split: str, n: int | None = None) -> str:
        """Digest of the first ``n`` indices of a split (n=None: all), for run identity and MLflow."""
        idx = self.splits[split].indices[: (n if n is not None else None)]
        h = hashlib.sha256(f"{self.digest}:{split}:".encode())
        h.update(np.ascontiguousarray(idx, dtype=np.int64).tobytes())
        return h.hexdigest()[:16]


def split_indices(n_items: int, sizes: dict[str, int], seed: int) -> dict[str, np.ndarray]:
    """Deterministic disjoint splits of ``range(n_items)`` in the order of SPLITS.

    One seeded permutation; consecutive slices of it become the splits, so every split (the calibration
    split in particular) has a fixed order per (dataset, seed). Disjointness is asserted.
    """
    total = sum(sizes[s] for s in SPLITS)
    if total > n_items:
        raise ValueError(f"split sizes add up to {total} but the dataset has {n_items} items")
    perm = np.random.default_rng(seed).permutation(n_items)
    out, start = {}, 0
    for s in SPLITS:
        out[s] = perm[start : start + sizes[s]].astype(np.int64)
        start += sizes[s]
    seen = np.concatenate(list(out.values()))
    assert len(np.unique(seen)) == len(seen), "splits overlap"
    return out


DATASETS: Registry[Callable[..., DatasetSplits]] = Registry("dataset")

# scikit-learn's digits, 8x8 grey levels 0..16, upsampled to 16x16 (bilinear), scaled to [-1, 1].
DIGITS_SPLIT_SIZES = {"train": 937, "calibration": 320, "selection": 180, "evaluation": 360}
DIGITS_TRANSFORM = "digits8->16:bilinear:/16*2-1"


def digits_preprocess(raw: np.ndarray) -> torch.Tensor:
    """(N, 8, 8) grey levels 0..16 -> (N, 1, 16, 16) float32 in [-1, 1]."""
    x = torch.from_numpy(raw.astype(np.float32) / 16.0).unsqueeze(1)  # (N, 1, 8, 8)
    x = F.interpolate(x, size=(16, 16), mode="bilinear", align_corners=False)  # (N, 1, 16, 16)
    return x * 2.0 - 1.0


@DATASETS.register("digits")
@lru_cache(maxsize=4)
def load_digits(seed: int = 0) -> DatasetSplits:
    """The embedded offline default: scikit-learn's bundled digits (1797 real 8x8 scans)."""
    from sklearn.datasets import load_digits as _sk_digits

    bunch = _sk_digits()
    images = digits_preprocess(bunch.images)
    labels = torch.from_numpy(bunch.target.astype(np.int64))
    idx = split_indices(len(labels), DIGITS_SPLIT_SIZES, seed)
    splits = {
        s: SplitData(
            images=images[torch.from_numpy(i)].contiguous(),
            labels=None if s == "calibration" else labels[torch.from_numpy(i)].contiguous(),
            indices=i,
        )
        for s, i in idx.items()
    }
    desc = {"source": "sklearn.datasets.load_digits", "transform": DIGITS_TRANSFORM, "seed": seed,
            "sizes": DIGITS_SPLIT_SIZES}
    digest = hashlib.sha256(json.dumps(desc, sort_keys=True).encode()).hexdigest()[:16]
    return DatasetSplits("digits", 10, (1, 16, 16), splits, digest)


def load_dataset(name: str, seed: int = 0, **kwargs) -> DatasetSplits:
    """``kwargs``: the dataset's settings and, for image datasets, ``transform``/``transform_id`` of the model."""
    return DATASETS.get(name)(seed=seed, **kwargs)


import tasks.imagedata  # noqa: E402,F401 - registers the image folder / table / Hugging Face datasets
