"""``healsweep run SPEC --dry-run``: a recipe's every stage on stand-in data, on this machine, before its real run.

A GPU recipe (configs/deit_imagenet_starfish.yaml, configs/resnet50_imagenet_starfish.yaml) needs ImageNet, the
pretrained weights and GPUs; its dry run needs none of them. The spec mapping is rewritten (``dry_run_spec``):

- ``models``: the same architectures, scopes, classes and builder arguments with **random-init weights** (timm and
  torchvision entries ``pretrained: false`` without ``weights``; a checkpoint entry becomes its ``arch``), so
  nothing is downloaded or read; reference (digits) models keep their shipped weights;
- ``dataset``: a **generated image folder** (tasks/data/synthetic.py: 10 classes, PNGs at the models' input
  size, written by the caller to ``data_root``) with ``DRY_SIZES`` images per split; the digits set is kept;
- ``calib_sizes`` capped at ``DRY_CALIB`` (every grid), the first seed only, ``search``: one trial per cell with
  one epoch (or ``DRY_STEPS`` optimizer steps), no re-evaluation, no widening, design ``shared``, objective
  ``selection_acc``; ``heal.batch_size`` at most ``DRY_CALIB``, ``heal.latency_rounds`` 1 (CORP's efficiency
  figures are computed, once: timing a random-init model on a CPU 3 + 3 times per trial cost a DeiT-B trial 16 s);
- ``resources``: one CPU per trial and per dense task, no GPU, no retry (a failure shows at once); ``store``: the
  run's own (``--store``, default DIR/store), shards of ``DRY_CALIB`` rows; ``mlflow``: SQLite in the run
  directory; ``offline: true``; ``name``: ``<name>-dry-run``.

Sparsities, pruners (with their settings), healers (with theirs, chains included) and scopes are the recipe's:
those are what the dry run checks, stage by stage, on the real architectures at their real input size.
"""
from __future__ import annotations

import copy
from typing import Any, Mapping

from orchestrator.spec.checks import SpecError

# Calibration images (the largest calibration size of the dry run; also a batch, and a train split). Two, not one:
# a batch of two still exercises batch statistics (BatchNorm in train mode, CORP's moments over several images).
# Measured 2026-11-28 (DeiT-B, 3 trials, 1 CPU): 4 / 2 / 2 images -> 2 / 1 / 1: 147 -> 120 s wall.
DRY_CALIB = 2
DRY_SIZES = {"train": 0, "calibration": DRY_CALIB, "selection": 1, "evaluation": 1}
DRY_STEPS = 2  # optimizer steps per trial when the recipe searches steps instead of epochs
DRY_CLASSES = 10
SUFFIX = "-dry-run"


def check_recipe(raw: Any, base_dir: Any = None) -> None:
    """The spec as written gets the registry-free checks of a real run (spec.parse.check_plain), every extra grid's
    too, before the rewrite replaces what it checks (seeds, calibration sizes, search, heal, resources, store): a
    dry run must not pass a spec its real run refuses. Models, data and weights are not checked (the dry run needs
    none of them). SpecError (one line)."""
    from orchestrator.spec.grids import GRID_KEYS, view_raw
    from orchestrator.spec.parse import check_plain

    d = check_plain(raw, base_dir)[0]
    grids = d.get("grids")
    for i, g in enumerate(grids if isinstance(grids, list) else ()):
        if not isinstance(g, Mapping) or not isinstance(g.get("search") or {}, Mapping):
            continue  # refused by the full check, in its own words
        search = {k: v for k, v in (g.get("search") or {}).items() if v is not None}
        view = view_raw(d, {k: g[k] for k in GRID_KEYS if k in g and k != "models" and g[k] is not None}, search, "")
        try:
            check_plain(view, base_dir)
        except SpecError as e:
            raise SpecError(f"grids[{i}].{e.path}" if e.path else f"grids[{i}]", e.message) from None


def dry_run_spec(raw: Any, data_root: str | None) -> dict:
    """The spec mapping ``raw`` rewritten for a dry run (module docstring); ``data_root``: the generated image
    folder (None when the spec keeps the digits set). SpecError (one line) when ``raw`` is not a spec mapping."""
    if not isinstance(raw, Mapping) or not isinstance(raw.get("name"), str):
        raise SpecError("spec", "a dry run needs a spec mapping with a name")
    d = copy.deepcopy(dict(raw))
    d["name"] = (d["name"][: 64 - len(SUFFIX)] + SUFFIX)
    if not keeps_digits(d):
        train = DRY_SIZES["train"] or (DRY_CALIB if _dataset_train(d.get("dataset")) else 0)
        d["dataset"] = {"name": "imagefolder", "root": data_root, "sizes": {**DRY_SIZES, "train": train}}
    if isinstance(d.get("models"), list):
        d["models"] = [random_init(m) for m in d["models"]]
    for key in ("pruners", "healers"):
        d[key] = _quick(d.get(key), key)
    d["calib_sizes"] = _capped(d.get("calib_sizes"))
    d["seeds"] = _first(d.get("seeds") or [0])
    d["search"] = _search(d.get("search"))
    for g in d.get("grids") or []:
        if isinstance(g, dict):  # keys a grid leaves out are the top level's (already rewritten)
            for key, value in (("calib_sizes", _capped(g.get("calib_sizes"))), ("seeds", _first(g.get("seeds")))):
                if g.get(key):
                    g[key] = value
            for key in ("pruners", "healers"):
                if g.get(key):
                    g[key] = _quick(g[key], key)
            if isinstance(g.get("search"), Mapping):
                g["search"] = _grid_search(g["search"])
    heal = dict(d["heal"]) if isinstance(d.get("heal"), Mapping) else {}
    batch = heal.get("batch_size", 32)
    heal["batch_size"] = min(batch, DRY_CALIB) if isinstance(batch, int) and not isinstance(batch, bool) else batch
    heal["latency_rounds"] = 1  # a structured pruner's latency timing: one round (a stand-in's speed means nothing)
    d["heal"] = heal
    d["resources"] = {"cpus_per_trial": 1, "gpus_per_trial": 0, "cpus_per_dense_task": 1, "gpus_per_dense_task": 0,
                      "max_failures": 0}
    store = d.get("store") if isinstance(d.get("store"), Mapping) else {}
    d["store"] = {"shard_size": DRY_CALIB, **({"dtype": store["dtype"]} if "dtype" in store else {})}
    d["mlflow"] = {}
    d["offline"] = True
    return d


def keeps_digits(raw: Mapping) -> bool:
    """Whether the dry run keeps the spec's dataset: the digits set (local, small, what reference models need)."""
    ds = raw.get("dataset", "digits")
    return (ds.get("name") if isinstance(ds, Mapping) else ds) == "digits"


def random_init(entry: Any) -> Any:
    """A ``models`` entry with random-init weights: same architecture, classes and builder arguments."""
    if isinstance(entry, str):
        from tasks.models import MODELS

        return entry if entry in MODELS else {"name": entry, "source": "timm", "arch": entry, "pretrained": False}
    if not isinstance(entry, Mapping):
        return entry  # refused by the spec check, in its own words
    e = {k: v for k, v in entry.items() if k not in ("weights", "path", "sha256")}
    source = e.get("source", "reference")
    if source == "reference":
        return e
    if source == "checkpoint":
        inner, _, arch = str(e.get("arch", "")).rpartition(":")
        e.update(source=inner or "timm", arch=arch)
    e["pretrained"] = False
    return e


def _quick(entries: Any, key: str) -> Any:
    """Pruner or healer entries (chains included) with each method's ``quick_settings`` over its settings: the
    image and batch counts that make a method slow at 224 px on a CPU (CR+BN's 20 x 128 BN images, RR's
    diagnostic images, SnapViT's search); every other setting stays the recipe's."""
    if not isinstance(entries, list):
        return entries
    from tasks.healing import HEALERS
    from tasks.pruning import PRUNERS

    registry = PRUNERS if key == "pruners" else HEALERS

    def one(e: Any) -> Any:
        if isinstance(e, Mapping) and isinstance(e.get("chain"), list):
            return {**e, "chain": [one(x) for x in e["chain"]]}
        name = e if isinstance(e, str) else e.get("name") if isinstance(e, Mapping) else None
        quick = getattr(registry.get(name), "quick_settings", {}) if isinstance(name, str) and name in registry else {}
        if not quick:
            return e  # unknown names are refused by the spec check, in its own words
        e = {"name": e} if isinstance(e, str) else dict(e)
        e["settings"] = {**(e.get("settings") or {}), **quick}
        return e
    return [one(e) for e in entries]


def _dataset_train(ds: Any) -> bool:
    """Whether the spec's dataset asks for training images (``sizes.train`` > 0)."""
    sizes = ds.get("sizes") if isinstance(ds, Mapping) else None
    return isinstance(sizes, Mapping) and bool(sizes.get("train"))


def _capped(sizes: Any) -> list | None:
    if not isinstance(sizes, list):
        return sizes
    return sorted({min(n, DRY_CALIB) if isinstance(n, int) and not isinstance(n, bool) else n for n in sizes})


def _first(seeds: Any) -> Any:
    """The first seed of a list (anything else as given: refused by the spec check, in its own words)."""
    return list(seeds)[:1] if isinstance(seeds, list) else seeds


def _search(search: Any) -> Any:
    if search is not None and not isinstance(search, Mapping):
        return search  # refused by the spec check, in its own words
    s = {k: v for k, v in (search or {}).items() if k not in ("design", "explore", "startup_trials", "widen",
                                                               "scheduler", "asha_grace_period",
                                                               "asha_reduction_factor")}
    s.update(trials_per_cell=1, reevaluate=0, objective="selection_acc", calib_draws=0)  # no re-evaluation: no draws
    if s.get("epochs") is not None or (search or {}).get("scheduler") == "asha":  # the real run searches epochs
        s["epochs"] = [1, 1]
    else:  # steps, given or the default (orchestrator/spec/schema.py SearchSpec)
        s["steps"] = [DRY_STEPS, DRY_STEPS]
    return s


def _grid_search(search: Mapping) -> dict:
    """A grid's search overrides for a dry run: one trial, no re-evaluation, its own length key shortened."""
    s = {k: v for k, v in search.items() if k not in ("explore", "startup_trials")}
    s.update(trials_per_cell=1, reevaluate=0)
    if "steps" in s:
        s["steps"] = [DRY_STEPS, DRY_STEPS]
    if "epochs" in s:
        s["epochs"] = [1, 1]
    return s


def dry_classes(raw: Mapping) -> int:
    """Classes of the generated image folder: ``DRY_CLASSES``, or the fewest ``num_classes`` a model entry gives
    (a model needs at least as many outputs as the dataset has classes: a 3-class model could not be dry-run)."""
    given = [m["num_classes"] for m in raw.get("models") or [] if isinstance(m, Mapping)
             and isinstance(m.get("num_classes"), int) and not isinstance(m["num_classes"], bool) and m["num_classes"] > 0]
    return min([DRY_CLASSES, *given])


def input_size(raw: Mapping) -> int:
    """The largest input size (pixels) of the dry-run spec's models: the generated images' size. Each
    architecture is built on the meta device (no weights, no memory)."""
    from timm.data import resolve_data_config

    from tasks.models import MODELS, ModelSourceError, build_untrained, parse_ref

    size = 0
    for entry in raw.get("models") or []:
        if isinstance(entry, str) and entry in MODELS:
            continue
        try:
            ref = parse_ref(entry, offline=True)
            if ref.source == "reference":
                continue
            size = max(size, int(resolve_data_config({}, model=build_untrained(ref, "meta"))["input_size"][-1]))
        except (ModelSourceError, ValueError, TypeError, KeyError):
            continue  # the spec check refuses the entry in one line
    return size or 224
