"""Hugging Face datasets as image sources: a map-style ``Dataset`` (``HFTable``, memory-mapped by ``datasets``), a
streamed ``IterableDataset`` (``StreamTable``: the items a sweep needs, taken once per machine through a seeded
shuffle buffer and kept encoded in a memory-mapped Arrow file, tasks/data/stream_cache.py), the hub's splits or a
local ``save_to_disk`` directory opened by split (``hub_by_split``), and the four splits built from them
(``hf_splits``, through tables.build_splits)."""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Callable, Mapping

import numpy as np

from tasks.data import stream_cache
from tasks.data.splits import SPLITS, DatasetError, DatasetSplits
from tasks.data.tables import ImageTable, assert_disjoint, build_splits, to_pil
from tasks.errors import first_line


class LazyStream:
    """A hub split to be streamed, opened (``datasets.load_dataset(..., streaming=True)``) on first call only: a
    process whose items are in the machine's stream cache makes no hub call and needs neither network nor
    credentials. ``split``: the hub split's name (part of the cache key, as ``IterableDataset.split`` is)."""

    def __init__(self, split: str, opener: Callable[[], Any]) -> None:
        self.split, self._opener, self._ds = split, opener, None

    def __call__(self):
        if self._ds is None:
            self._ds = self._opener()
        return self._ds


class HFTable(ImageTable):
    """A map-style ``datasets.Dataset`` (Arrow-backed, memory-mapped: nothing is read until asked)."""

    def __init__(self, ds, image_column: str = "image", label_column: str | None = "label", ident: str = "",
                 need_labels: bool = True) -> None:
        self.ds, self.image_column, self.label_column = ds, image_column, label_column
        self.where = f"split {str(ds.split)!r}" if getattr(ds, "split", None) else "the dataset"
        missing_column(list(ds.column_names), image_column, label_column if need_labels else None,
                       f"{self.where} of the Hugging Face dataset" if self.where != "the dataset" else
                       "the Hugging Face dataset")
        self._labels = (np.asarray(ds[label_column], dtype=np.int64) if label_column in ds.column_names
                        else np.full(len(ds), -1, dtype=np.int64))
        feat = ds.features.get(label_column) if label_column else None
        self.num_classes = int(getattr(feat, "num_classes", 0) or (self._labels.max() + 1 if len(ds) else 0))
        self.ident = ident or f"hf:{ds._fingerprint}"

    def __len__(self) -> int:
        return len(self.ds)

    def image(self, i: int):
        return to_pil(self.ds[int(i)][self.image_column])

    def labels(self, idx: np.ndarray) -> np.ndarray:
        return self._labels[idx]


class StreamTable(ImageTable):
    """The first ``n`` items of a streamed dataset after a seeded shuffle buffer, kept encoded: in a machine-local
    Arrow file that every process on the machine memory-maps (tasks/data/stream_cache.py; the first one streams),
    or in this process's RAM when that cache is off (``HEALSWEEP_STREAM_CACHE=off``) or cannot be written.

    ``positions`` are the items' positions in the unshuffled stream (recorded as the split indices); ``source`` says
    where this process got the items: 'stream' or 'cache'. ``stamp`` (a local dataset's file stamp) keys the cache
    only: the digest (``ident``) is the same with the cache on or off."""

    def __init__(self, stream, n: int, seed: int, buffer_size: int = 10_000, image_column: str = "image",
                 label_column: str | None = "label", ident: str = "", stamp: str = "", need_labels: bool = True) -> None:
        self.ident = f"stream:{ident}:seed={seed}:buffer={buffer_size}"
        take = lambda: _take(stream, n, seed, buffer_size, image_column, label_column, ident, need_labels)  # noqa: E731
        root = stream_cache.cache_root()
        key = {"ident": ident, "stamp": stamp, "seed": seed, "buffer": buffer_size, "image": image_column,
               "label": label_column}
        got, self.source = _cached(stream_cache.cache_file(root, key), n, key, take) if root else (take(), "stream")
        if isinstance(got, tuple):  # in RAM: (items, positions, labels)
            self._items, self._cols = got[0], None
            self.positions, self._labels = np.asarray(got[1], dtype=np.int64), np.asarray(got[2], dtype=np.int64)
        else:  # a memory-mapped Arrow table (stream_cache.SCHEMA)
            self._items, self._cols = None, (got.column("bytes"), got.column("path"))
            self.positions = got.column("pos").to_numpy().astype(np.int64)
            self._labels = got.column("label").to_numpy().astype(np.int64)
        self.num_classes = int(self._labels.max()) + 1 if n else 0

    def __len__(self) -> int:
        return len(self.positions)

    def image(self, i: int):
        if self._cols is None:
            return to_pil(self._items[int(i)])
        return to_pil({"bytes": self._cols[0][int(i)].as_py(), "path": self._cols[1][int(i)].as_py()})

    def labels(self, idx: np.ndarray) -> np.ndarray:
        return self._labels[idx]


def missing_column(columns: list[str], image_column: str, label_column: str | None, where: str) -> None:
    """DatasetError naming a column the spec gives (``image_column``, ``label_column``) that ``where`` lacks: a
    missing label column gave every image the label -1, and every accuracy 0 % with no error. (A hub split that
    serves only calibration images needs no labels: its caller passes ``label_column`` None.)"""
    for key, c in (("image_column", image_column), ("label_column", label_column)):
        if c is not None and c not in columns:
            raise DatasetError(f"{where} has no column {c!r} ({key}); its columns: {', '.join(map(str, columns))}")


def _take(stream, n: int, seed: int, buffer_size: int, image_column: str, label_column: str | None,
          ident: str, need_labels: bool = True) -> tuple[list, list[int], list[int]]:
    """The first ``n`` items of ``stream`` after its seeded shuffle buffer: (undecoded image cells, positions in
    the unshuffled stream, labels; -1 where none). DatasetError when the stream is shorter."""
    from datasets import Image

    if isinstance(stream, LazyStream):
        stream = stream()
    if image_column in (stream.features or {}):
        stream = stream.cast_column(image_column, Image(decode=False))  # keep bytes; decode on access
    stream = stream.map(lambda ex, i: {"__pos": i}, with_indices=True)
    stream = stream.shuffle(seed=seed, buffer_size=buffer_size)
    items, pos, lab = [], [], []
    for ex in stream.take(n):
        if not items:  # a stream's columns are known from its first item (its features may be None)
            missing_column([c for c in ex if c != "__pos"], image_column, label_column if need_labels else None,
                           f"stream {ident or 'dataset'}")
        items.append(ex[image_column])
        pos.append(ex["__pos"])
        v = ex.get(label_column, -1) if label_column else -1
        lab.append(-1 if v is None else int(v))
    if len(items) < n:
        raise DatasetError(f"stream {ident or 'dataset'} has only {len(items)} items, {n} needed")
    return items, pos, lab


def _cached(path: Path, n: int, key: Mapping[str, Any], take: Callable[[], tuple]) -> tuple[Any, str]:
    """(the first ``n`` items, 'cache' | 'stream') through the machine-local file ``path``: read when it holds
    them, else streamed (``take``) under the machine lock and written. A cache that cannot be written (read-only
    or full disk) or items that are not encoded images leave the items in RAM (``take``'s tuple), with a warning."""
    got, stage = None, "cache"
    try:
        with stream_cache.machine_lock(path):
            table = stream_cache.open_cached(path, n)
            if table is not None:
                return table, "cache"
            stage = "stream"  # the stream's own errors (network ones are OSErrors) propagate
            got = take()
            stage = "cache"
            parts = [stream_cache.cell_parts(x) for x in got[0]]
            if any(p is None for p in parts):
                return got, "stream"
            stream_cache.write_cached(path, stream_cache.items_table(parts, got[1], got[2]), key)
            return stream_cache.open_cached(path, n), "stream"
    except OSError as e:
        if stage == "stream":
            raise
        print(f"healsweep: stream cache {path.parent} not usable ({e}); keeping the stream's items in RAM",
              file=sys.stderr)
        return (got if got is not None else take()), "stream"


def hf_splits(name: str, by_split: Mapping[str, Any], sizes: Mapping[str, int], seed: int, transform: Callable,
              transform_id: str, image_column: str = "image", label_column: str | None = "label",
              buffer_size: int = 10_000, num_classes: int | None = None, ident: str = "",
              stamp: str = "") -> DatasetSplits:
    """Hugging Face data (map-style ``Dataset`` or streaming ``IterableDataset``) per hub split -> DatasetSplits.

    ``by_split``: our split -> the hub split's dataset object; several of ours may share one hub split (same
    object -> same table -> disjoint slices). Streams take exactly the items their splits need, through a
    seeded shuffle buffer."""
    from datasets import IterableDataset

    tables: dict[str, tuple[str, ImageTable]] = {}
    made: dict[int, tuple[str, ImageTable]] = {}
    shuffle: dict[str, bool] = {}
    for s in SPLITS:
        ds = by_split[s]
        if id(ds) not in made:
            key = f"{ident}:{getattr(ds, 'split', None) or len(made)}"
            labels = any(by_split[t] is ds for t in SPLITS if t != "calibration")  # calibration needs none
            if isinstance(ds, (IterableDataset, LazyStream)):
                need = sum(sizes[t] for t in SPLITS if by_split[t] is ds)
                made[id(ds)] = (key, StreamTable(ds, need, seed, buffer_size, image_column, label_column, key,
                                                      stamp, labels))
                shuffle[key] = False  # the shuffle buffer already fixed a seeded order
            else:
                made[id(ds)] = (key, HFTable(ds, image_column, label_column, key + f":{ds._fingerprint}", labels))
        tables[s] = made[id(ds)]
    nc = num_classes or max(getattr(t, "num_classes", 0) for _, t in tables.values())
    data = build_splits(name, tables, sizes, seed, transform, transform_id, nc, shuffle)
    assert_disjoint(data, {s: tables[s][0] for s in SPLITS})
    return data


def hub_by_split(path: str, config: str | None, mapping: Mapping[str, str], streaming: bool,
                 revision: str | None = None) -> dict[str, Any]:
    """Each distinct hub split opened once (``datasets.load_dataset``); our split -> its dataset object. Streamed
    splits are ``LazyStream``s: opened only if the machine's stream cache lacks their items."""
    try:
        import datasets
    except ImportError:
        raise ValueError(f"dataset {path!r}: hub datasets need the `datasets` package: pip install 'healsweep[hub]'") from None

    if Path(path).is_dir() and any((Path(path) / f).is_file() for f in SAVED_MARKERS):
        return saved_by_split(path, mapping, streaming)

    def load(hub_split: str):
        try:
            return datasets.load_dataset(path, config, split=hub_split, streaming=streaming, revision=revision)
        except Exception as e:  # noqa: BLE001 - network, auth, cache misses: one line
            msg = first_line(e, 300)
            raise DatasetError(f"dataset {path!r} split {hub_split!r}: {msg}") from None

    # a stream is opened only when its items are not in the machine's stream cache (StreamTable)
    opened = {h: LazyStream(h, lambda h=h: load(h)) if streaming else load(h) for h in sorted(set(mapping.values()))}
    return {s: opened[h] for s, h in mapping.items()}


SAVED_MARKERS = ("dataset_dict.json", "state.json")  # what ``save_to_disk`` writes (a DatasetDict / a Dataset)


def saved_by_split(path: str, mapping: Mapping[str, str], streaming: bool) -> dict[str, Any]:
    """A local directory written by ``save_to_disk`` (``datasets.load_dataset`` refuses those): a DatasetDict
    gives its splits by name; a single Dataset is its recorded split (``train`` when none is recorded).
    ``streaming``: each split read as an ``IterableDataset`` (the streamed code path, on local files)."""
    import datasets

    try:
        saved = datasets.load_from_disk(str(path))
    except Exception as e:  # noqa: BLE001 - damaged or foreign files: one line
        msg = first_line(e, 300)
        raise DatasetError(f"dataset {path!r}: cannot read the saved dataset: {msg}") from None
    splits = dict(saved) if isinstance(saved, datasets.DatasetDict) else {str(saved.split or "train"): saved}
    opened = {}
    for hub_split in sorted(set(mapping.values())):
        if hub_split not in splits:
            raise DatasetError(f"dataset {path!r} has no split {hub_split!r}; it holds: {', '.join(sorted(splits))}")
        ds = splits[hub_split]
        opened[hub_split] = ds.to_iterable_dataset() if streaming else ds
    return {s: opened[h] for s, h in mapping.items()}
