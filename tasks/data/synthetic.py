"""Generated image datasets in the formats the image sources read (docs/methods.md#data-splits): an image folder
of PNGs, a Parquet image table and a local Hugging Face dataset (``save_to_disk``). Used by ``healsweep run
--dry-run`` (a recipe's stages on stand-in data before any GPU time) and by the tests of every model source.

Each image is a seeded class colour plus noise, so the three formats hold the same pixels (PNG is lossless) in the
same order (class, then index): an image folder's row i is the table's and the Hugging Face dataset's row i.
"""
from __future__ import annotations

import io
from pathlib import Path
from typing import Iterator

import numpy as np


def synthetic_images(num_classes: int = 10, per_class: int = 3, size: int = 224, seed: int = 0
                     ) -> Iterator[tuple[np.ndarray, int, str]]:
    """(H, W, 3) uint8 image, label, relative file name ``c<label>/img<i>.png``; class by class."""
    if num_classes < 1 or per_class < 1 or size < 1:
        raise ValueError(f"synthetic images need num_classes, per_class and size >= 1, got "
                         f"{num_classes}, {per_class}, {size}")
    rng = np.random.default_rng(seed)
    for c in range(num_classes):
        base = rng.integers(40, 216, 3)  # the class colour
        for i in range(per_class):
            noise = rng.integers(-40, 41, (size, size, 3))
            yield np.clip(base + noise, 0, 255).astype(np.uint8), c, f"c{c:03d}/img{i:03d}.png"


def _png(arr: np.ndarray) -> bytes:

    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format="PNG")
    return buf.getvalue()


def write_image_folder(root: str | Path, num_classes: int = 10, per_class: int = 3, size: int = 224,
                       seed: int = 0) -> Path:
    """``root/c<label>/img<i>.png`` (the ``imagefolder`` dataset's layout) -> root."""
    root = Path(root)
    for arr, _, rel in synthetic_images(num_classes, per_class, size, seed):
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(_png(arr))
    return root


def _rows(num_classes: int, per_class: int, size: int, seed: int) -> list[dict]:
    return [{"image": {"bytes": _png(arr), "path": rel}, "label": label}
            for arr, label, rel in synthetic_images(num_classes, per_class, size, seed)]


def write_image_table(path: str | Path, num_classes: int = 10, per_class: int = 3, size: int = 224,
                      seed: int = 0) -> Path:
    """One Parquet file with columns ``image`` ({bytes, path}: the Hugging Face image cell) and ``label``
    (the ``image_table`` dataset's defaults) -> path."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(_rows(num_classes, per_class, size, seed)), path)
    return path


def write_hf_dataset(path: str | Path, num_classes: int = 10, per_class: int = 3, size: int = 224,
                     seed: int = 0, split: str = "train") -> Path:
    """A ``datasets.DatasetDict`` with one split (``image``: Image, ``label``: ClassLabel) saved with
    ``save_to_disk`` (the ``hf`` dataset with ``path`` a local directory) -> path."""
    import datasets

    rows = _rows(num_classes, per_class, size, seed)
    feats = datasets.Features({"image": datasets.Image(), "label": datasets.ClassLabel(num_classes=num_classes)})
    ds = datasets.Dataset.from_dict({"image": [r["image"] for r in rows], "label": [r["label"] for r in rows]},
                                    features=feats)
    datasets.DatasetDict({split: ds}).save_to_disk(str(path))
    return Path(path)
