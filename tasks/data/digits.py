"""The embedded offline default dataset: scikit-learn's bundled digits (1797 real 8x8 scans), registered as
``digits`` in ``tasks.data.DATASETS``."""
from __future__ import annotations

import hashlib
import importlib.util
import json
from functools import lru_cache
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from tasks.data.splits import DATASETS, DatasetSplits, SplitData, split_indices

# scikit-learn's digits, 8x8 grey levels 0..16, upsampled to 16x16 (bilinear), scaled to [-1, 1].
DIGITS_SPLIT_SIZES = {"train": 937, "calibration": 320, "selection": 180, "evaluation": 360}
DIGITS_TRANSFORM = "digits8->16:bilinear:/16*2-1"


def digits_preprocess(raw: np.ndarray) -> torch.Tensor:
    """(N, 8, 8) grey levels 0..16 -> (N, 1, 16, 16) float32 in [-1, 1]."""
    x = torch.from_numpy(raw.astype(np.float32) / 16.0).unsqueeze(1)  # (N, 1, 8, 8)
    x = F.interpolate(x, size=(16, 16), mode="bilinear", align_corners=False)  # (N, 1, 16, 16)
    return x * 2.0 - 1.0


def digits_arrays() -> tuple[np.ndarray, np.ndarray]:
    """scikit-learn's bundled digits as ((1797, 8, 8) float64 grey levels, (1797,) int labels), read from the
    file scikit-learn ships (``sklearn/datasets/data/digits.csv.gz``, what ``sklearn.datasets.load_digits``
    parses) without importing scikit-learn: every Ray worker and the driver load it, and ``import sklearn`` costs
    ~0.75 s of CPU each time. Falls back to ``load_digits`` when the file is not where that version keeps it."""

    spec = importlib.util.find_spec("sklearn")  # locates the package without running it
    path = Path(next(iter(spec.submodule_search_locations or [""]))) / "datasets" / "data" / "digits.csv.gz" \
        if spec else None
    if path is None or not path.is_file():
        from sklearn.datasets import load_digits as _sk_digits

        bunch = _sk_digits()
        return bunch.images, bunch.target
    data = np.loadtxt(path, delimiter=",")  # (1797, 65): 64 pixels, then the label
    return data[:, :-1].reshape(-1, 8, 8), data[:, -1].astype(int)


@DATASETS.register("digits")
@lru_cache(maxsize=4)
def load_digits(seed: int = 0) -> DatasetSplits:
    """The embedded offline default: scikit-learn's bundled digits (1797 real 8x8 scans)."""
    raw, target = digits_arrays()
    images = digits_preprocess(raw)
    labels = torch.from_numpy(target.astype(np.int64))
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
