"""Spec parsing for model sources and dataset settings (``models`` mapping entries, ``dataset`` mapping).

``models`` entries are names (reference models, or timm names) or mappings {name, source, arch, pretrained,
weights, path, num_classes, model_args, init_seed, sha256, input_size}; ``dataset`` is a name or {name: ..., <settings>}.
"""
from __future__ import annotations

import json
from functools import lru_cache
from typing import Any, Mapping

from orchestrator.spec.checks import SpecError, check_list, excerpt, join, local_path
from orchestrator.spec.registries import (DigitsLayout, SplitsLayout, check_shipped_seed, known, live, names,
                                          reference_ref)
from tasks import catalog


def from_dict_form(raw: Any) -> Any:
    """A ``SweepSpec.to_dict()`` (sweep.json, refine rounds) back to spec syntax: model names -> their mapping
    entries, dataset name + settings -> the dataset mapping. Plain YAML specs pass through unchanged."""
    if not isinstance(raw, Mapping) or not ({"model_refs", "dataset_settings"} & set(raw)):
        return raw
    d = dict(raw)
    refs, settings = d.pop("model_refs", None) or {}, d.pop("dataset_settings", None) or {}
    for key, v in (("model_refs", refs), ("dataset_settings", settings)):
        if not isinstance(v, Mapping) or (key == "model_refs" and not all(isinstance(r, Mapping) for r in v.values())):
            raise SpecError(key, f"must be a mapping (as SweepSpec.to_dict writes it), got {excerpt(v)}")
    if isinstance(d.get("models"), (list, tuple)):
        d["models"] = [_entry(m, refs.get(m, {})) if isinstance(m, str) else m for m in d["models"]]
    if settings:
        d["dataset"] = {"name": d.get("dataset", "digits"), **settings}
    return d


def _entry(name: str, ref: Mapping) -> Any:
    """A model's spec entry back from its ModelRef dict: a reference model's shipped weights by name; a reference
    checkpoint as {name, path, sha256}; an external model as its mapping."""
    if ref.get("source", "reference") == "reference":
        return name if not ref.get("path") else {k: ref[k] for k in ("name", "path", "sha256") if ref.get(k)}
    return {k: v for k, v in ref.items() if v is not None and k != "offline"}


def parse_dataset(raw: Any, base_dir: Any = None) -> tuple[str, dict, int | None]:
    """-> (name, settings, largest calibration size the settings allow; None: load the dataset to know). A dataset
    that takes settings checks them itself (it reads its files or index): only then is tasks.data imported. Its
    local path settings come back absolute (relative ones taken from ``base_dir``: checks.local_path)."""
    settings: dict = {}
    if isinstance(raw, Mapping):
        if "name" not in raw:
            raise SpecError("dataset.name", "required key is missing")
        settings = {k: v for k, v in raw.items() if k != "name"}
        for k in settings:
            if not isinstance(k, str):
                raise SpecError("dataset", f"setting names must be strings, got {excerpt(k)}")
        raw = raw["name"]
    if not known("dataset", raw):
        raise SpecError("dataset", f"unknown dataset {excerpt(raw)}; allowed: {', '.join(names('dataset'))}")
    source = None if catalog.DATASETS.get(raw) is False else live("dataset").get(raw)
    check = getattr(source, "check", None)
    if check is None:
        if settings:
            raise SpecError(f"dataset.{sorted(settings)[0]}", f"dataset {raw!r} takes no settings")
        return raw, settings, None
    try:
        if hasattr(source, "local_paths"):  # a plugin's dataset may have no local files
            settings = source.local_paths(settings, lambda v: local_path(v, base_dir))
        return raw, settings, int(check(settings))
    except (ValueError, TypeError) as e:
        raise SpecError("dataset", str(e)) from None


def parse_models(raw: Any, dataset: str, offline: bool, data_seed: int = 0,
                 base_dir: Any = None) -> tuple[list[str], dict[str, dict]]:
    """-> (model display names, {name: ModelRef dict}); reference models must be trained on ``dataset`` and, as
    their weights' metadata says, on ``data_seed``'s train split (a checkpoint given by ``path`` is verified now:
    sha256 pin, complete safetensors file, model and data seed; a relative ``path`` is taken from ``base_dir``). A
    reference model given by its name is checked from the static table (no torch); any other entry by tasks.models."""
    names, refs = [], {}
    for i, item in enumerate(check_list(raw, "models")):
        if isinstance(item, Mapping) and isinstance(item.get("path"), str) and item["path"]:
            item = {**item, "path": local_path(item["path"], base_dir)}
        ref = _reference(item, i, dataset, offline, data_seed) if _is_reference_name(item) else \
            _model_ref(item, i, dataset, offline, data_seed)
        if ref["name"] in refs:
            raise SpecError(f"models[{i}].name", f"model {ref['name']!r} is listed twice")
        names.append(ref["name"])
        refs[ref["name"]] = ref
    return names, refs


def _is_reference_name(item: Any) -> bool:
    return (isinstance(item, str) and item in catalog.REFERENCE_MODELS) or (
        isinstance(item, Mapping) and set(item) == {"name"} and item["name"] in catalog.REFERENCE_MODELS)


def _reference(item: Any, i: int, dataset: str, offline: bool, data_seed: int) -> dict:
    """A reference model named by the table: its dataset and the shipped weights' data seed (no file read)."""
    name = item if isinstance(item, str) else item["name"]
    trained_on = catalog.REFERENCE_MODELS[name]
    if trained_on != dataset:
        raise SpecError(f"models[{i}]", f"model {name!r} is trained on {trained_on!r}, not {dataset!r}")
    why = check_shipped_seed(name, data_seed)
    if why:
        raise SpecError(f"models[{i}]", why)
    return reference_ref(name, offline)


def _model_ref(item: Any, i: int, dataset: str, offline: bool, data_seed: int) -> dict:
    """Any other entry (a timm name, a mapping, a reference checkpoint by ``path``): tasks.models checks it."""
    from tasks.models import MODELS, ModelSourceError, parse_ref
    from tasks.models.reference import check_checkpoint
    from tasks.models.reference import check_shipped_seed as check_seed

    if isinstance(item, str) and item in MODELS:  # a plugin's reference model: no timm look-up of the name
        item = {"name": item}
    try:
        ref = parse_ref(item, offline=offline)
    except ModelSourceError as e:  # about one key of the entry (e.field): named as models[i].key
        raise SpecError(join(f"models[{i}]", e.field) if e.field else f"models[{i}]", e.message) from None
    except KeyError as e:  # unknown source name from the registry
        raise SpecError(f"models[{i}].source", str(e.args[0])) from None
    except (TypeError, ValueError) as e:  # a value of the wrong type deep in a source's own checks
        raise SpecError(f"models[{i}]", str(e)) from None
    if ref.source == "reference" and MODELS.get(ref.name).dataset != dataset:
        raise SpecError(f"models[{i}]", f"model {ref.name!r} is trained on {MODELS.get(ref.name).dataset!r}, "
                                        f"not {dataset!r}")
    if ref.source == "reference":
        try:
            if ref.path is None:
                check_seed(ref.name, data_seed)
            else:
                check_checkpoint(ref.name, ref.path, ref.sha256, data_seed)
        except ModelSourceError as e:
            raise SpecError(f"models[{i}]", str(e)) from None
    if ref.source != "reference" and dataset == "digits":
        raise SpecError(f"models[{i}]", f"model {ref.name!r} ({ref.source}) needs an image dataset, not the "
                                        f"digits reference set; set dataset: imagenet1k, cifar100, imagefolder, ...")
    return ref.to_dict()


def architecture(spec, name: str):
    """A spec model's architecture for validation: built once per process and model entry, on the meta device
    (shapes and module types only: no weight initialisation, no memory). Callers must not modify it."""

    return _architecture(json.dumps(spec.model_refs.get(name) or {"name": name}, sort_keys=True, default=str))


@lru_cache(maxsize=16)
def _architecture(ref_json: str):

    from tasks.models import ModelRef, build_untrained

    return build_untrained(ModelRef(**json.loads(ref_json)), device="meta")


def dataset_layout(name: str, seed: int, settings: Mapping | None = None):
    """A dataset's split layout: names, sizes and which splits carry labels, without pixels. Enough for calibration
    capacity and healers' ``check_data`` (e.g. ``ce`` needs a labeled train split). ``settings`` (a dataset that
    checks its settings): the sizes they give (SplitsLayout); digits: DigitsLayout (no torch, no scikit-learn);
    any other dataset is loaded to know its layout. None for a plugin's dataset with settings but no sizes."""
    if settings is not None:
        source = live("dataset").get(name)
        return SplitsLayout(name, source.settings(settings, sweep=True)["sizes"]) if hasattr(source, "settings") else None
    if name == "digits":
        return DigitsLayout()
    from tasks.data import load_dataset

    return load_dataset(name, seed=seed)
