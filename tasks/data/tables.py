"""Image data sources for real models: local image folders and Parquet/Arrow image tables here, Hugging Face
datasets (map-style or streaming) in tasks/data/hub.py, all through one split builder and one lazy split type.

An ``ImageTable`` is an indexable source of (image, label). The four splits (docs/methods.md#data-splits) are drawn from one or
more tables: splits that share a table are consecutive slices of one seeded permutation of it (so they are
disjoint); splits from different tables are disjoint by construction (e.g. ImageNet calibration from the test
split, evaluation from the validation split). A streamed table is first materialized to the items a sweep needs
through a seeded shuffle buffer (encoded bytes kept, decoded on access; once per machine: hub.StreamTable); its
indices are stream positions.

Images stay lazy: ``LazyImages`` decodes and preprocesses only the rows asked for, so ``images[i:i+b]`` on a
50 000-image evaluation split reads b images. Slicing returns tensors (callers batch), so a split is never
materialized as a whole except by an explicit ``images[:n]`` (the calibration set of size n).
"""
from __future__ import annotations

import hashlib
import io
import json
import os
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Mapping

import numpy as np
import torch

from tasks.data.splits import SPLITS, DatasetError, DatasetSplits, SplitData
from tasks.errors import first_line

# Threads that decode and preprocess the rows of one batch (HEALSWEEP_DECODE_THREADS; default: up to 8).
DECODE_THREADS = int(os.environ.get("HEALSWEEP_DECODE_THREADS", min(8, os.cpu_count() or 1)))


def to_pil(x: Any):
    """An HF/Arrow image cell (PIL image, {'bytes','path'} dict, raw bytes or a path) -> RGB PIL image."""
    from PIL import Image

    try:
        if isinstance(x, Image.Image):
            img = x
        elif isinstance(x, Mapping):
            img = Image.open(io.BytesIO(x["bytes"])) if x.get("bytes") is not None else Image.open(x["path"])
        elif isinstance(x, (bytes, bytearray)):
            img = Image.open(io.BytesIO(x))
        else:
            img = Image.open(x)
        return img.convert("RGB")
    except OSError as e:  # PIL's UnidentifiedImageError, a truncated file, a missing path: one line
        where = x.get("path") if isinstance(x, Mapping) else x if isinstance(x, (str, Path)) else None
        raise DatasetError(f"cannot decode image {str(where)!r}: {first_line(e, 200)}" if where
                           else f"cannot decode an image: {first_line(e, 200)}") from None


class ImageTable:
    ident: str = ""  # stable description (part of the dataset digest)
    where: str = "the dataset"  # what a message calls it

    def __len__(self) -> int:
        raise NotImplementedError

    def image(self, i: int):
        raise NotImplementedError

    def labels(self, idx: np.ndarray) -> np.ndarray:
        raise NotImplementedError


class FolderTable(ImageTable):
    """torchvision ImageFolder layout: root/<class>/<image>; classes sorted, label = class index."""

    def __init__(self, root: str | Path) -> None:
        from torchvision.datasets.folder import IMG_EXTENSIONS, make_dataset

        root = Path(root)
        if not root.is_dir():
            raise DatasetError(f"image folder {str(root)!r} does not exist")
        self.classes = class_folders(root)
        with _one_line(root):  # a class folder without images: torchvision's FileNotFoundError
            self.samples = make_dataset(str(root), {c: i for i, c in enumerate(self.classes)}, extensions=IMG_EXTENSIONS)
        self.num_classes = len(self.classes)
        self.where = "the image folder"
        self.ident = f"folder:{root.resolve()}:{len(self.samples)}:" + ",".join(self.classes)

    def __len__(self) -> int:
        return len(self.samples)

    def image(self, i: int):
        return to_pil(self.samples[i][0])

    def labels(self, idx: np.ndarray) -> np.ndarray:
        return np.array([self.samples[i][1] for i in idx], dtype=np.int64)


class ArrowTable(ImageTable):
    """A Parquet or Arrow IPC file (or a directory of them) with an image column and a label column."""

    def __init__(self, path: str | Path, image_column: str = "image", label_column: str | None = "label") -> None:
        p = Path(path)
        self.table = _arrow_read(p, lambda ds: ds.to_table())
        for c in (image_column, label_column):
            if c is not None and c not in self.table.column_names:
                raise DatasetError(f"image table {str(p)!r} has no column {c!r}; columns: {', '.join(self.table.column_names)}")
        self.image_column, self.label_column = image_column, label_column
        if label_column:
            check_labels(self.table.column(label_column), p, label_column)
        self._labels = (np.asarray(self.table.column(label_column).to_numpy(zero_copy_only=False), dtype=np.int64)
                        if label_column else np.full(len(self.table), -1, dtype=np.int64))
        self.num_classes = int(self._labels.max()) + 1 if len(self._labels) else 0
        self.where = "the table"
        self.ident = f"arrow:{p.resolve()}:{len(self.table)}:{image_column}:{label_column}"

    def __len__(self) -> int:
        return len(self.table)

    def image(self, i: int):
        return to_pil(self.table.column(self.image_column)[i].as_py())

    def labels(self, idx: np.ndarray) -> np.ndarray:
        return self._labels[idx]


class LazyImages:
    """(N, C, H, W) view of preprocessed images, decoded on indexing; indexing returns a float32 tensor."""

    def __init__(self, table: ImageTable, rows: np.ndarray, transform: Callable, item_shape: tuple[int, ...]) -> None:
        self.table, self.rows, self.transform, self.item_shape = table, rows, transform, tuple(item_shape)

    @property
    def shape(self) -> tuple[int, ...]:
        return (len(self.rows), *self.item_shape)

    def __len__(self) -> int:
        return len(self.rows)

    def reordered(self, order: np.ndarray) -> "LazyImages":
        """The same images in ``order`` (positions into this view), still decoded only when indexed."""
        return LazyImages(self.table, self.rows[order], self.transform, self.item_shape)

    def __getitem__(self, key) -> torch.Tensor:
        sel = self.rows[key.numpy() if isinstance(key, torch.Tensor) else key]
        if np.ndim(sel) == 0:
            return self.transform(self.table.image(int(sel)))
        if len(sel) == 0:
            return torch.empty((0, *self.item_shape))
        load = lambda i: self.transform(self.table.image(int(i)))  # noqa: E731 - decode + preprocess one row
        if len(sel) < 16 or DECODE_THREADS <= 1:
            return torch.stack([load(i) for i in sel])  # (B, C, H, W)

        with ThreadPoolExecutor(DECODE_THREADS) as pool:  # PIL decoding releases the GIL
            return torch.stack(list(pool.map(load, sel)))  # (B, C, H, W), in row order


def too_few(sizes: Mapping[str, int], have: int, where: str) -> str:
    """'' when ``have`` items cover the split ``sizes`` drawn from one source, else why not, in one line: each
    split's size, the total, what the source holds, and the fix."""
    need = sum(sizes.values())
    if need <= have:
        return ""
    parts = " + ".join(f"{s} {n}" for s, n in sizes.items() if n)
    return (f"splits need {parts} = {need} items from {where}, which has {have}; "
            f"set smaller dataset.sizes (docs/models-and-data.md#dataset-settings) or add items")


def folder_count(root: str | Path, stop_at: int) -> int:
    """Images ``FolderTable(root)`` would hold (torchvision's ImageFolder rules: class folders, files with an image
    extension, symlinks followed), counted without sorting or keeping them and only up to ``stop_at``; past it,
    each remaining class folder is only looked into until its first image. A class folder without images is
    refused as the loader would refuse it."""
    from torchvision.datasets.folder import IMG_EXTENSIONS, has_file_allowed_extension

    n, empty = 0, []
    for c in class_folders(root):
        found = 0
        for _, _, fnames in os.walk(os.path.join(root, c), followlinks=True):
            found += sum(has_file_allowed_extension(f, IMG_EXTENSIONS) for f in fnames)
            if found and n + found >= stop_at:
                break
        n += found
        empty += [] if found else [c]
    if empty:
        raise DatasetError(f"image folder {str(root)!r}: Found no valid file for the classes {', '.join(empty[:20])}. "
                           f"Supported extensions are: {', '.join(IMG_EXTENSIONS)}")
    return n


@contextmanager
def _one_line(root: str | Path):
    """torchvision's FileNotFoundError about an image folder (no class folder, a class without images) as a
    one-line DatasetError naming the folder."""
    try:
        yield
    except FileNotFoundError as e:
        raise DatasetError(f"image folder {str(root)!r}: {first_line(e, 300)}") from None


def class_folders(root: str | Path) -> list[str]:
    """The class folders of an image folder, sorted (torchvision's ``find_classes``); one-line DatasetError when
    there is none."""
    from torchvision.datasets.folder import find_classes

    with _one_line(root):
        return find_classes(str(root))[0]


def table_classes(path: str | Path, label_column: str | None) -> int | None:
    """Largest label + 1 of an image table, reading its label column alone (``ArrowTable.num_classes``); None
    without a label column."""
    import pyarrow.compute as pc

    def top_label(ds) -> tuple[bool, Any]:  # (the column exists, its largest value)
        if label_column not in ds.schema.names:
            return False, None
        col = ds.to_table(columns=[label_column]).column(0)
        check_labels(col, Path(path), label_column)
        return True, pc.max(col).as_py()

    if not label_column:
        return None
    has, top = _arrow_read(Path(path), top_label)
    if not has:
        raise DatasetError(f"image table {str(path)!r} has no column {label_column!r}")
    return 0 if top is None else int(top) + 1


def check_labels(col, where: Path, name: str) -> None:
    """One-line DatasetError when a label column cannot hold class indices: nulls (read as -2**63, every such
    image counted misclassified), non-integer numbers (truncated), text. col: a pyarrow (chunked) array."""
    import pyarrow as pa
    import pyarrow.compute as pc

    head = f"image table {str(where)!r}: label column {name!r}"
    if col.null_count:
        raise DatasetError(f"{head} has {col.null_count} empty (null) label(s) of {len(col)}")
    if pa.types.is_floating(col.type):
        frac = pc.not_equal(col, pc.floor(col))
        if pc.any(frac).as_py():
            bad = pc.filter(col, frac)[0].as_py()
            raise DatasetError(f"{head} holds non-integer labels (e.g. {bad}); labels are class indices 0..K-1")
    elif not pa.types.is_integer(col.type):
        raise DatasetError(f"{head} holds {col.type} values, not integer class indices 0..K-1 (map names to "
                           "indices first)")


def _arrow_read(p: Path, read: Callable[[Any], Any]) -> Any:
    """``read(pyarrow.dataset)`` over a Parquet or Arrow IPC file (or a directory of them); one-line DatasetError
    when it is missing or unreadable."""
    import pyarrow.dataset as pads

    if not p.exists():
        raise DatasetError(f"image table {str(p)!r} does not exist")
    fmt = "arrow" if p.suffix in (".arrow", ".feather", ".ipc") else "parquet"
    try:
        return read(pads.dataset(str(p), format=fmt))
    except DatasetError:  # what ``read`` found in a readable table (check_labels)
        raise
    except (OSError, ValueError) as e:  # pyarrow's ArrowInvalid (a ValueError): not Parquet / Arrow IPC
        raise DatasetError(f"image table {str(p)!r} is not a readable {fmt} file: "
                           f"{first_line(e, 300)}") from None


def table_rows(path: str | Path) -> int:
    """Rows of an image table, from its files' metadata (no image read)."""
    return _arrow_read(Path(path), lambda ds: ds.count_rows())


def build_splits(name: str, tables: Mapping[str, tuple[str, ImageTable]], sizes: Mapping[str, int], seed: int,
                 transform: Callable, transform_id: str, num_classes: int, shuffle: Mapping[str, bool] = {}) -> DatasetSplits:
    """Assemble the four splits. ``tables``: split -> (table key, table); splits sharing a table key get
    consecutive, disjoint slices (in SPLITS order) of one seeded permutation of it (identity order for tables
    that are already shuffled: ``shuffle[key] = False``)."""
    by_key: dict[str, list[str]] = {}
    for s in SPLITS:
        by_key.setdefault(tables[s][0], []).append(s)
    rows: dict[str, np.ndarray] = {}
    for key, splits in by_key.items():
        table = tables[splits[0]][1]
        short = too_few({s: sizes[s] for s in splits}, len(table), table.where)
        if short:
            raise DatasetError(f"dataset {name}: {short}")
        order = (np.random.default_rng(seed).permutation(len(table)) if shuffle.get(key, True)
                 else np.arange(len(table)))
        start = 0
        for s in splits:
            rows[s] = order[start : start + sizes[s]].astype(np.int64)
            start += sizes[s]
    probe = next(((tables[s][1], rows[s][0]) for s in SPLITS if len(rows[s])), None)
    if probe is None:
        raise DatasetError(f"dataset {name}: every split is empty")
    item_shape = tuple(transform(probe[0].image(int(probe[1]))).shape)
    splits = {}
    for s in SPLITS:
        table = tables[s][1]
        positions = getattr(table, "positions", None)
        idx = rows[s] if positions is None else positions[rows[s]]
        labels = None if s == "calibration" else torch.from_numpy(table.labels(rows[s]))
        splits[s] = SplitData(LazyImages(table, rows[s], transform, item_shape), labels, idx)  # type: ignore[arg-type]
    desc = {"name": name, "tables": {s: tables[s][1].ident for s in SPLITS}, "transform": transform_id,
            "seed": seed, "sizes": dict(sizes)}
    digest = hashlib.sha256(json.dumps(desc, sort_keys=True).encode()).hexdigest()[:16]
    return DatasetSplits(name, num_classes, item_shape, splits, digest)  # type: ignore[arg-type]


def assert_disjoint(data: DatasetSplits, tables: Mapping[str, str]) -> None:
    """Splits that share a table key must not share an index (a safety net for custom split layouts)."""
    for i, a in enumerate(SPLITS):
        for b in SPLITS[i + 1 :]:
            if tables[a] == tables[b]:
                common = np.intersect1d(data[a].indices, data[b].indices)
                if len(common):
                    raise AssertionError(f"splits {a} and {b} share {len(common)} items")


def default_transform(image_size: int = 224) -> tuple[Callable, str]:
    """When no model gives one: resize + center crop + ImageNet normalization."""
    from torchvision import transforms as T

    t = T.Compose([T.Resize(image_size), T.CenterCrop(image_size), T.ToTensor(),
                   T.Normalize((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))])
    return t, f"default:{image_size}"


def split_sizes(sizes: Mapping[str, int] | None, defaults: Mapping[str, int]) -> dict[str, int]:
    out = dict(defaults)
    if sizes is not None and not isinstance(sizes, Mapping):
        raise ValueError(f"sizes: must be a mapping of split -> items, e.g. {{calibration: 64, selection: 32, "
                         f"evaluation: 64}}, got {type(sizes).__name__}")
    for k, v in (sizes or {}).items():
        if k not in SPLITS:
            raise ValueError(f"sizes.{k}: unknown split; allowed: {', '.join(SPLITS)}")
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            raise ValueError(f"sizes.{k}: must be an integer >= 0, got {v!r}")
        out[k] = v
    return out


def table_splits(name: str, table: ImageTable, sizes: Mapping[str, int], seed: int, transform: Callable,
                 transform_id: str, num_classes: int | None = None) -> DatasetSplits:
    """All four splits from one local table (image folder, Parquet/Arrow file)."""
    tables = {s: ("table", table) for s in SPLITS}
    data = build_splits(name, tables, sizes, seed, transform, transform_id, num_classes or table.num_classes)
    assert_disjoint(data, {s: "table" for s in SPLITS})
    return data
