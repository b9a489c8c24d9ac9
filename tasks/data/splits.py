"""Data sources and the four disjoint splits (docs/methods.md#data-splits).

Every source yields ``train`` (dense training only), ``calibration`` (unlabeled: its labels are never
exposed), ``selection`` (hyperparameter search objective) and ``evaluation`` (the only reported accuracy).
The calibration order is one fixed permutation per (dataset, seed); a calibration size n means its first n
items, so one dense cache of the largest n serves every smaller n.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch

from tasks.errors import DatasetError  # noqa: F401 - re-exported (raised by every dataset)
from tasks.registry import Registry

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


def _reordered(split: SplitData, order: np.ndarray) -> SplitData:
    """``split`` in ``order`` (positions into it); a table's images (tasks/data/tables.py LazyImages) stay lazy."""
    images = split.images.reordered(order) if hasattr(split.images, "reordered") else \
        split.images[torch.from_numpy(order)].contiguous()
    labels = None if split.labels is None else split.labels[torch.from_numpy(order)]
    return SplitData(images=images, labels=labels, indices=split.indices[order])


def redraw_calibration(data: DatasetSplits, calib_seed: int) -> DatasetSplits:
    """The same splits with the two a healer trains on in another seeded order: calibration (so that its first n
    items, a calibration size n, are another n-image draw of it; sizes still nest) and train (the supervised
    ``ce`` baseline takes its first n as its labeled set). ``calib_seed`` 0: ``data`` itself (the data seed's
    order, every sweep's before 2026-12-01). ``digest`` (the dataset and its splits' contents, which checkpoints
    are checked against) is kept; ``split_digest("calibration", n)`` hashes the drawn indices, so the store key,
    calibration-reading masks and trials of a draw are their own. Selection and evaluation are untouched."""
    if calib_seed == 0:
        return data
    rng = np.random.default_rng([calib_seed, 0xCA1B])
    drawn = {s: _reordered(data.splits[s], rng.permutation(len(data.splits[s])))  # (P,) positions in the split
             for s in ("calibration", "train") if s in data.splits}
    return DatasetSplits(data.name, data.num_classes, data.image_shape, {**data.splits, **drawn}, data.digest)


DATASETS: Registry[Callable[..., DatasetSplits]] = Registry("dataset")

def load_dataset(name: str, seed: int = 0, **kwargs) -> DatasetSplits:
    """``kwargs``: the dataset's settings and, for image datasets, ``transform``/``transform_id`` of the model."""
    return DATASETS.get(name)(seed=seed, **kwargs)

