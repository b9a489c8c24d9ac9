"""Registered image datasets (``tasks.data.DATASETS``): local image folders, Parquet/Arrow image tables, any
Hugging Face dataset, and presets for ImageNet-1k (the STARFISH paper's protocol) and CIFAR-10/100.

Each loader takes ``seed``, the model's preprocessing (``transform`` + ``transform_id``, from
``tasks.models``) and the spec's ``dataset`` settings; ``check(settings)`` validates the settings without
reading data and returns the largest calibration size they allow.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping

from tasks.data.stream_cache import local_stamp
from tasks.data.splits import DATASETS, SPLITS, DatasetError, DatasetSplits
from tasks.data.hub import hf_splits, hub_by_split
from tasks.data.tables import (ArrowTable, FolderTable, class_folders, default_transform, folder_count, split_sizes,
                               table_classes, table_rows, table_splits, too_few)

PATH_KEY = {"folder": "root", "table": "path", "hub": "path"}  # the setting that names a kind's files (or hub id)
_MEMO: dict[str, DatasetSplits] = {}  # one load per process and (dataset, settings, seed, transform)


@dataclass(frozen=True)
class ImageDataset:
    kind: str  # folder | table | hub
    sizes: Mapping[str, int]  # default split sizes
    defaults: Mapping[str, Any] = field(default_factory=dict)  # preset settings (hub path, columns, split map)

    def allowed(self, sweep: bool = True) -> set[str]:
        """The setting names a spec (``sweep``) or a direct caller may give (docs/models-and-data.md#dataset-settings)."""
        return {"folder": {"root"}, "table": {"path", "image_column", "label_column"},
                "hub": {"path", "config", "splits", "streaming", "image_column", "label_column", "buffer_size",
                        "num_classes", "revision"}}[self.kind] | {"sizes"} | (set() if sweep else {"image_size"})

    def settings(self, settings: Mapping[str, Any], sweep: bool = False) -> dict:
        """``settings`` checked, with the preset's defaults and every split's size. ``sweep``: a spec's settings,
        where ``image_size`` (the fallback preprocessing's size, for callers that pass no transform) is refused: a
        sweep always preprocesses with the model's own transform, so it would be ignored."""
        allowed = self.allowed(sweep)
        if sweep and "image_size" in settings:
            raise ValueError("image_size: not a sweep setting: each model preprocesses images its own way (its timm "
                             "data config or its torchvision weights' transforms), which sets their size; set the model "
                             "entry's input_size: N")
        unknown = sorted(set(settings) - allowed)
        if unknown:
            raise ValueError(f"{unknown[0]}: unknown dataset setting; allowed: {', '.join(sorted(allowed))}")
        d = {**self.defaults, **settings}
        need = PATH_KEY[self.kind]
        if not d.get(need):
            raise ValueError(f"{need}: required for a {self.kind} dataset")
        if not isinstance(d[need], str):
            raise ValueError(f"{need}: must be a path or name (a string), got {type(d[need]).__name__}")
        d["sizes"] = split_sizes(settings.get("sizes"), self.sizes)
        empty = [k for k in ("calibration", "selection", "evaluation") if sweep and d["sizes"][k] < 1]
        if empty:  # a sweep calibrates, selects its winners and evaluates them: each split needs an item
            raise ValueError(f"sizes.{empty[0]}: must be >= 1 in a sweep, got 0")
        if self.kind == "hub":
            splits = {**{s: "train" for s in SPLITS}, **dict(d.get("splits") or {})}
            bad = sorted(set(splits) - set(SPLITS))
            if bad:
                raise ValueError(f"splits.{bad[0]}: unknown split; allowed: {', '.join(SPLITS)}")
            d["splits"] = splits
        return d

    def local_paths(self, settings: Mapping[str, Any], absolute: Callable[[str], str]) -> dict:
        """``settings`` with its local path made ``absolute`` (the spec's rule): a folder's ``root``, a table's
        ``path``, a hub dataset's ``path`` when it names a local folder or file (else it is a hub id)."""
        key = PATH_KEY[self.kind]
        v = settings.get(key)
        if not isinstance(v, str) or not v:
            return dict(settings)  # missing or not a string: settings() says so
        p = absolute(v)
        return {**settings, key: p} if self.kind != "hub" or Path(p).exists() else dict(settings)

    def classes(self, settings: Mapping[str, Any]) -> int | None:
        """Classes of a local image folder (its class folders) or table (largest label + 1, from the label column
        alone); None for a hub dataset (known when it is loaded)."""
        d = self.settings(settings, sweep=True)
        if self.kind == "folder":
            return len(class_folders(d["root"]))
        if self.kind == "table":
            return table_classes(d["path"], d.get("label_column", "label"))
        return None

    def check(self, settings: Mapping[str, Any]) -> int:
        """The settings' largest calibration size; a local image folder or table that is not there, or holds
        fewer items than the four splits' sizes, is refused now (like a checkpoint ``path``), not when the
        models stage reads it. (Hub datasets are counted when they are loaded.)"""
        d = self.settings(settings, sweep=True)
        if self.kind == "folder" and not Path(d["root"]).is_dir():
            raise DatasetError(f"root: image folder {str(d['root'])!r} "
                               f"{'is not a folder' if Path(d['root']).exists() else 'does not exist'}")
        if self.kind == "table" and not Path(d["path"]).exists():
            raise DatasetError(f"path: image table {str(d['path'])!r} does not exist")
        if self.kind in ("folder", "table"):
            need = sum(d["sizes"].values())
            have, where = ((folder_count(d["root"], need), f"the image folder {str(d['root'])!r}")
                           if self.kind == "folder" else (table_rows(d["path"]), f"the table {str(d['path'])!r}"))
            short = too_few(d["sizes"], have, where)
            if short:
                raise DatasetError(f"sizes: {short}")
            n = self.classes(d)
            if n is not None and n < 2:  # accuracy of a one-class problem says nothing about healing
                raise DatasetError(f"{PATH_KEY[self.kind]}: {where} holds {n} class"
                                   f"{'' if n == 1 else 'es'}; classification needs at least 2")
        return d["sizes"]["calibration"]

    def __call__(self, seed: int = 0, *, transform: Callable | None = None, transform_id: str = "",
                 **settings) -> DatasetSplits:
        d = self.settings(settings)
        if transform is None:
            transform, transform_id = default_transform(d.get("image_size", 224))
        memo = json.dumps([self.kind, d, seed, transform_id], sort_keys=True, default=str)
        if memo in _MEMO:
            return _MEMO[memo]
        name = d.get("path") or d.get("root")
        if self.kind == "folder":
            data = table_splits(str(name), FolderTable(d["root"]), d["sizes"], seed, transform, transform_id)
        elif self.kind == "table":
            table = ArrowTable(d["path"], d.get("image_column", "image"), d.get("label_column", "label"))
            data = table_splits(str(name), table, d["sizes"], seed, transform, transform_id)
        else:
            streaming = bool(d.get("streaming", False))
            by_split = hub_by_split(d["path"], d.get("config"), d["splits"], streaming, d.get("revision"))
            data = hf_splits(str(name), by_split, d["sizes"], seed, transform, transform_id,
                             d.get("image_column", "image"), d.get("label_column", "label"),
                             int(d.get("buffer_size", 10_000)), d.get("num_classes"),
                             ident=f"{d['path']}:{d.get('config')}:{d.get('revision')}:streaming={streaming}",
                             stamp=local_stamp(d["path"]) if streaming else "")
        _MEMO[memo] = data
        return data


_SMALL = {"train": 0, "calibration": 64, "selection": 32, "evaluation": 64}
for _name, _ds in {
    "imagefolder": ImageDataset("folder", _SMALL),
    "image_table": ImageDataset("table", _SMALL),
    "hf": ImageDataset("hub", _SMALL),
    # Paper 000: calibration from the unlabeled test split, evaluation on the validation split, both streamed;
    # selection (search objective) and the labeled baseline budget from the train split (disjoint slices).
    "imagenet1k": ImageDataset("hub", {"train": 0, "calibration": 5000, "selection": 1000, "evaluation": 50_000},
                               {"path": "ILSVRC/imagenet-1k", "streaming": True, "num_classes": 1000,
                                "splits": {"train": "train", "calibration": "test", "selection": "train",
                                           "evaluation": "validation"}}),
    # CIFAR: train-derived calibration/selection/train slices (disjoint), evaluation on the test split.
    "cifar10": ImageDataset("hub", {"train": 0, "calibration": 5000, "selection": 1000, "evaluation": 10_000},
                            {"path": "uoft-cs/cifar10", "image_column": "img", "label_column": "label",
                             "num_classes": 10, "splits": {"evaluation": "test"}}),
    "cifar100": ImageDataset("hub", {"train": 0, "calibration": 5000, "selection": 1000, "evaluation": 10_000},
                             {"path": "uoft-cs/cifar100", "image_column": "img", "label_column": "fine_label",
                              "num_classes": 100, "splits": {"evaluation": "test"}}),
}.items():
    DATASETS.register(_name)(_ds)
