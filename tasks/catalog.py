"""The registries' static table: every registered name and each method's settings, without importing torch.

The registries (tasks.pruning.PRUNERS, tasks.healing.HEALERS, tasks.models.MODELS / MODEL_SOURCES / ADAPTERS,
tasks.data.DATASETS) fill themselves when their packages import their implementations, which import torch (1-2 s).
Checking a spec needs only names, settings (type or allowed values, defaults, value rules) and a few facts
(which healers train, N:M's fixed sparsity, RR's candidate grid), so they are written down here, a leaf that imports
the standard library only. tests/test_catalog.py holds this table equal to the live registries, both ways: names,
schemas, defaults and every check's verdict and message on a battery of settings. Add a method: register it as
before and add its line here (the test names what is missing). Plugins register methods this table does not know:
callers fall back to the live registry for any name not listed here (orchestrator/spec/registries.py).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

# --- models and datasets ---------------------------------------------------------------------------------------
REFERENCE_MODELS = {"resnet_digits": "digits", "vit_digits": "digits"}  # name -> the dataset it was trained on
MODEL_SOURCES = ("checkpoint", "timm", "torchvision")  # external sources; "reference" is the registry MODELS
ADAPTERS = ("mobilenet", "resnet", "timm_vit", "torchvision_vit", "vgg")  # architecture families
DATA_SEED = 0  # tasks.models.weights.DATA_SEED: the data seed the shipped weights were trained on
# tasks.models.weights.SHIPPED[name].sha256: the shipped weights' digests (the cached model facts' key, no torch)
SHIPPED_SHA256 = {"vit_digits": "a82e66177bd68dc0f206f5ed34d5622e1bf3d3624557c89de545865ca1039399",
                  "resnet_digits": "03f3c57ecfd0bf020dab8097d56f2d8ac7fa96d879c47b39edee06fea4b25998"}
# name -> True when the dataset takes settings and checks them itself (image folders, tables, hub sets: it reads
# files or an index to know its size, so checking it imports tasks.data)
DATASETS = {"cifar10": True, "cifar100": True, "digits": False, "hf": True, "image_table": True, "imagefolder": True,
            "imagenet1k": True}
DIGITS_SPLIT_SIZES = {"train": 937, "calibration": 320, "selection": 180, "evaluation": 360}
UNLABELED_SPLITS = ("calibration",)  # digits' splits without labels

# --- value rules shared by several methods ----------------------------------------------------------------------
CANDIDATE_GRID = (0.70, 0.80, 0.85, 0.90, 0.925, 0.95, 0.975)  # tasks.pruning.allocation_math
TAU_RULES = ("median", "mean")  # tasks.pruning.repair
MEASURE_AT = ("conv", "bn")  # tasks.pruning.rr
RANKS = ("activation", "magnitude")  # tasks.pruning.corp
SNAPVIT_VARIANTS = ("authors", "joint")
SNAPVIT_DEFAULTS = {"variant": "authors", "evaluations": 50, "min_head_keep": 0.2, "min_neuron_keep": 0.05,
                    "global_crops": 2, "local_crops": 10, "iterations": 50, "popsize": 0, "sigma0": 1.0, "pca_dim": 192,
                    "fitness_images": 128, "fitness_sparsities": [0.1, 0.25, 0.4, 0.6], "grad_batch": None,
                    "tau_t": 0.04, "tau_s": 0.1}
LOOP = {"bn": ("train", "frozen"), "qk_train": ("qkv", "qk")}  # every gradient healer's loop settings
LOOP_DEFAULTS = {"bn": "train", "qk_train": "qkv"}
GRANULARITY = ("auto", "token", "example")
LABELED_SPLITS = ("train",)
BN_SOURCES = ("calib", "calib_once", "train")


@dataclass(frozen=True)
class Method:
    """A pruner or healer as the spec sees it. ``schema``: setting -> a type (pruners: checked with isinstance,
    bools refused) or a tuple of allowed values (healers; a type there is not checked by the base rule).
    ``rules``: value checks beyond the schema (raise ValueError); ``resolve``: settings -> settings with every
    default filled in (None: the settings as given)."""

    kind: str
    name: str
    schema: Mapping[str, Any] = field(default_factory=dict)
    rules: tuple[Callable[[Mapping[str, Any]], None], ...] = ()
    resolve: Callable[[Mapping[str, Any]], dict] | None = None
    trains: bool = False
    uses_calibration: bool = False  # pruners: the mask reads calibration images; healers: they read them (or targets)
    seeded_mask: bool = False  # pruners: the mask depends on the seed (SnapViT's seeded search)
    has_grid: bool = False  # check_sparsity: its candidate grid must reach every sparsity
    needs_labels: bool = False  # check_data: reads a labeled split (setting 'split')
    # What the method uses for a setting left out, where ``resolve`` does not fill it in (adding it there would change
    # the cell ids and mask keys of sweeps that ran without it): only for telling two spec entries apart.
    defaults: Mapping[str, Any] = field(default_factory=dict)

    def check(self, settings: Mapping[str, Any]) -> None:
        for k, v in settings.items():
            if k not in self.schema:
                raise ValueError(f"unknown setting {k!r} for {self.kind} {self.name!r}; allowed: "
                                 f"{', '.join(self.schema) or 'none'}")
            allowed = self.schema[k]
            if self.kind == "pruner" and (not isinstance(v, allowed) or isinstance(v, bool)):
                raise ValueError(f"pruner {self.name!r} setting {k!r} must be {allowed.__name__}")
            if self.kind == "healer" and isinstance(allowed, tuple) and v not in allowed:
                raise ValueError(f"healer {self.name!r} setting {k!r} must be one of {allowed}, got {v!r}")
        for rule in self.rules:
            rule(settings)

    def resolved_settings(self, settings: Mapping[str, Any]) -> dict:
        return dict(settings) if self.resolve is None else self.resolve(settings)

    def same_as(self, settings: Mapping[str, Any]) -> dict:
        """The settings with every default filled in, ``defaults`` included: two entries whose ``same_as`` are
        equal run the same method (``nm`` and ``nm {n: 2, m: 4}``)."""
        return {**self.defaults, **self.resolved_settings(settings)}

    def fixed_sparsity(self, settings: Mapping[str, Any]) -> float | None:
        return 1.0 - settings.get("n", 2) / settings.get("m", 4) if self.name == "nm" else None

    def pattern(self, sparsity: float, settings: Mapping[str, Any]) -> str:
        if self.name == "nm":
            return f"{settings.get('n', 2)}:{settings.get('m', 4)}"
        return f"{sparsity:g}-structured" if self.name == "corp" else f"{sparsity:g}"

    def diagnostic_settings(self, settings: Mapping[str, Any]) -> dict[str, Any] | None:
        """What determines its RR diagnostics table (part of the table's key): the RR pruners' (those with a candidate
        grid); None for every other method, which reads none (the live pruner has no ``diagnostic_settings``)."""
        if not self.has_grid:
            return None
        resolved = self.resolved_settings(settings)
        return {k: resolved[k] for k in _RR_SCHEMA}

    def check_sparsity(self, sparsity: float, settings: Mapping[str, Any]) -> None:
        if not self.has_grid:
            return
        g = _grid(settings)
        if sparsity > g[-1] + 1e-12:
            raise ValueError(f"candidate grid {list(g)} cannot reach sparsity {sparsity} (largest candidate {g[-1]})")

    def check_data(self, dataset: Any, settings: Mapping[str, Any]) -> None:
        """``dataset``: anything with ``name``, ``splits`` and ``dataset[split].labels`` / ``len`` (a DatasetSplits or
        the spec's layout of one)."""
        if not self.needs_labels:
            return
        split = settings.get("split", "train")
        if split not in dataset.splits:
            raise ValueError(f"healer 'ce' needs a labeled {split!r} split but dataset {dataset.name!r} has only "
                             f"{', '.join(dataset.splits)}")
        if len(dataset[split]) == 0:
            raise ValueError(f"healer 'ce' trains on labeled images of split {split!r}, and dataset {dataset.name!r} "
                             f"gives it none: set dataset.sizes.{split}")
        if dataset[split].labels is None:
            raise ValueError(f"healer 'ce' needs labels but split {split!r} of dataset {dataset.name!r} is unlabeled")


# --- pruners' value rules and defaults (tasks/pruning/magnitude.py, allocation.py, corp.py, snapvit_math.py) ------
def _nm(s):
    n, m = s.get("n", 2), s.get("m", 4)
    if not (0 < n < m):
        raise ValueError(f"pruner 'nm' needs 0 < n < m, got n={n}, m={m}")


def _erk(s):
    f, c = s.get("floor", 0.025), s.get("cap", 1.0)
    if not 0.0 <= f <= c <= 1.0:
        raise ValueError(f"pruner 'erk' needs 0 <= floor <= cap <= 1, got floor={f}, cap={c}")


def _grid(s) -> tuple[float, ...]:
    return tuple(float(g) for g in s.get("grid", CANDIDATE_GRID))


def _repairability(name: str) -> Callable[[Mapping[str, Any]], None]:
    def rule(s):
        g = s.get("grid", CANDIDATE_GRID)
        if not g or not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in g):
            raise ValueError(f"pruner {name!r} setting 'grid' must be a non-empty list of numbers")
        g = _grid(s)
        if any(b <= a for a, b in zip(g, g[1:])) or g[0] < 0 or g[-1] > 1:
            raise ValueError(f"pruner {name!r} grid must be strictly increasing within [0, 1], got {list(g)}")
        if s.get("diag_images", 128) < 1:
            raise ValueError(f"pruner {name!r} setting 'diag_images' must be >= 1")
        if s.get("tau", "median") not in TAU_RULES:
            raise ValueError(f"pruner {name!r} setting 'tau' must be one of {TAU_RULES}")
        if s.get("at", "conv") not in MEASURE_AT:
            raise ValueError(f"pruner {name!r} setting 'at' must be one of {MEASURE_AT}, got {s['at']!r}")
    return rule


def _repairability_resolve(s) -> dict:
    return {**dict(s), "grid": list(_grid(s)), "diag_images": int(s.get("diag_images", 128)),
            "tau": s.get("tau", "median"), "at": s.get("at", "conv")}


def _corp_rank(s):
    if s.get("rank", "activation") not in RANKS:
        raise ValueError(f"pruner 'corp' setting 'rank' must be one of {RANKS}, got {s['rank']!r}")


def _snapvit(settings):
    raw = {**SNAPVIT_DEFAULTS, **settings}
    check_snapvit({**raw, "grad_batch": raw["grad_batch"] or 1})


def check_snapvit(s: Mapping[str, Any]) -> None:
    """SnapViT's settings (defaults filled in) checked: the one copy of these rules (tasks/pruning/snapvit_math.py
    uses it too)."""
    sp = s["fitness_sparsities"]
    if not isinstance(sp, (list, tuple)) or not sp or not all(
            isinstance(x, (int, float)) and not isinstance(x, bool) and 0.0 < x < 1.0 for x in sp):
        raise ValueError("pruner 'snapvit' setting 'fitness_sparsities' must be a non-empty list of values in (0, 1)")
    if s["variant"] not in SNAPVIT_VARIANTS:
        raise ValueError(f"pruner 'snapvit' setting 'variant' must be one of {SNAPVIT_VARIANTS}, got {s['variant']!r}")
    for k in ("min_head_keep", "min_neuron_keep"):
        if not 0.0 <= s[k] <= 1.0:
            raise ValueError(f"pruner 'snapvit' setting {k!r} must be in [0, 1], got {s[k]}")
    for k in ("iterations", "pca_dim", "fitness_images", "grad_batch", "evaluations", "global_crops"):
        if s[k] < 1:
            raise ValueError(f"pruner 'snapvit' setting {k!r} must be >= 1, got {s[k]}")
    if s["popsize"] < 0 or s["popsize"] == 1:
        raise ValueError("pruner 'snapvit' setting 'popsize' must be 0 (auto) or >= 2")
    for k in ("sigma0", "tau_t", "tau_s"):
        if not (s[k] > 0 and math.isfinite(s[k])):
            raise ValueError(f"pruner 'snapvit' setting {k!r} must be a positive number")


def _snapvit_resolve(settings) -> dict:
    out = {**SNAPVIT_DEFAULTS, **settings}
    if out["grad_batch"] is None:
        out["grad_batch"] = 16 if out["variant"] == "authors" else 1
    out["fitness_sparsities"] = [float(s) for s in out["fitness_sparsities"]]
    return out


_RR_SCHEMA = {"grid": list, "diag_images": int, "tau": str, "at": str}
_SNAPVIT_SCHEMA = {"variant": str, "evaluations": int, "min_head_keep": float, "min_neuron_keep": float,
                   "global_crops": int, "local_crops": int, "iterations": int, "popsize": int, "sigma0": float,
                   "pca_dim": int, "fitness_images": int, "fitness_sparsities": list, "grad_batch": int, "tau_t": float,
                   "tau_s": float}


def _pruners() -> dict[str, Method]:
    plain = [Method("pruner", n) for n in ("magnitude", "global_magnitude", "uniform", "global", "lamp")]
    rr = [Method("pruner", n, _RR_SCHEMA, (_repairability(n),), _repairability_resolve, uses_calibration=True,
                 has_grid=True) for n in ("raw_shift", "repair_residual", "rr")]
    return {m.name: m for m in plain + rr + [
        Method("pruner", "nm", {"n": int, "m": int}, (_nm,), defaults={"n": 2, "m": 4}),
        Method("pruner", "erk", {"floor": float, "cap": float}, (_erk,), defaults={"floor": 0.025, "cap": 1.0}),
        Method("pruner", "corp", {"rank": str}, (_corp_rank,), uses_calibration=True, defaults={"rank": "activation"}),
        Method("pruner", "snapvit", _SNAPVIT_SCHEMA, (_snapvit,), _snapvit_resolve, uses_calibration=True,
               seeded_mask=True)]}


# --- healers' value rules and defaults (tasks/healing/loop.py, objectives.py, corp.py, crbn.py) -------------------
def _loop_resolve(extra: Callable[[Mapping[str, Any]], dict] = lambda s: {}) -> Callable[[Mapping[str, Any]], dict]:
    return lambda s: {**dict(s), **{k: s.get(k, v) for k, v in LOOP_DEFAULTS.items()}, **extra(s)}


def _starfish_kl(s):
    w = [s.get(k, 0.5) for k in ("w_align", "w_kl")]
    for k, v in zip(("w_align", "w_kl"), w):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not v >= 0 or v == float("inf"):
            raise ValueError(f"healer 'starfish_kl' setting {k!r} must be a finite number >= 0, got {v!r}")
    if not any(w):
        raise ValueError("healer 'starfish_kl' needs w_align or w_kl > 0, got both 0")


def _corp_healer(s):
    for k in ("lambda_floor", "qk_ridge"):
        v = s.get(k, 0.0)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0:
            raise ValueError(f"healer 'corp' setting {k!r} must be a number >= 0, got {v!r}")
    lam = s.get("lambda", "authors")
    if lam not in ("authors", "oas") and (isinstance(lam, (bool, str)) or not isinstance(lam, (int, float))
                                           or not 0 <= lam < float("inf")):
        raise ValueError(f"healer 'corp' setting 'lambda' must be 'authors', 'oas' or a number >= 0, got {lam!r}")


def _corp_healer_resolve(s) -> dict:
    lam = s.get("lambda", "authors")
    return {"lambda": lam if isinstance(lam, str) else float(lam), "lambda_floor": float(s.get("lambda_floor", 1e-3)),
            "qk_ridge": float(s.get("qk_ridge", 1e-3)), "qk_symmetrize": bool(s.get("qk_symmetrize", True))}


def _crbn(s):
    for k in ("bn_batches", "bn_batch_size"):
        v = s.get(k, 1)
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"healer 'crbn' setting {k!r} must be a positive integer, got {v!r}")
    m = s.get("bn_momentum")
    ok = m is None or m in ("module", "cumulative") or (isinstance(m, (int, float)) and not isinstance(m, bool) and 0 < m <= 1)
    if not ok:
        raise ValueError(f"healer 'crbn' setting 'bn_momentum' must be null, 'module', 'cumulative' or a "
                         f"number in (0, 1], got {m!r}")


def _crbn_resolve(s) -> dict:
    reset = bool(s.get("bn_reset", False))
    m = s.get("bn_momentum")
    m = ("cumulative" if reset else "module") if m is None else (m if isinstance(m, str) else float(m))
    return {"tau": s.get("tau", "median"), "no_bn": s.get("no_bn", "variance_match"),
            "bn_batches": int(s.get("bn_batches", 20)), "bn_batch_size": int(s.get("bn_batch_size", 128)),
            "bn_momentum": m, "bn_reset": reset, "bn_source": s.get("bn_source", "calib")}


def _healers() -> dict[str, Method]:
    starfish = {**LOOP, "granularity": GRANULARITY}
    granularity = _loop_resolve(lambda s: {"granularity": s.get("granularity", "auto")})
    weights = _loop_resolve(lambda s: {"granularity": s.get("granularity", "auto"), "w_align": float(s.get("w_align", 0.5)),
                                       "w_kl": float(s.get("w_kl", 0.5))})
    return {m.name: m for m in [
        Method("healer", "starfish", starfish, (), granularity, trains=True, uses_calibration=True),
        Method("healer", "mse", dict(LOOP), (), _loop_resolve(), trains=True, uses_calibration=True),
        Method("healer", "kl", dict(LOOP), (), _loop_resolve(), trains=True, uses_calibration=True),
        Method("healer", "ce", {**LOOP, "split": LABELED_SPLITS}, (),
               _loop_resolve(lambda s: {"split": s.get("split", "train")}), trains=True, needs_labels=True),
        Method("healer", "starfish_kl", {**starfish, "w_align": float, "w_kl": float}, (_starfish_kl,), weights, trains=True,
               uses_calibration=True),
        Method("healer", "none"),
        Method("healer", "corp", {"lambda": object, "lambda_floor": float, "qk_ridge": float, "qk_symmetrize": (True, False)},
               (_corp_healer,), _corp_healer_resolve, uses_calibration=True),
        Method("healer", "crbn", {"tau": TAU_RULES, "no_bn": ("variance_match", "reject"), "bn_batches": int,
                                  "bn_batch_size": int, "bn_momentum": object, "bn_reset": (False, True),
                                  "bn_source": BN_SOURCES}, (_crbn,), _crbn_resolve, uses_calibration=True)]}


def changes_with_draw(pruner, healer) -> bool:
    """Another draw of the calibration images can change the cell's number: its healer trains (on them: a searched
    cell) or reads them (CR+BN, CORP), or its pruner's mask does (RR, SnapViT, CORP). search.calib_draws re-evaluates
    such a cell on the other draws (orchestrator/search/records.py ``redrawn_cell``); ``none`` on a magnitude mask
    gives one number on every draw. Table or live methods, or chains; None (a method not known) reads nothing."""
    return any(getattr(m, a, False) for m, a in ((healer, "trains"), (healer, "uses_calibration"),
                                                (pruner, "uses_calibration")))


PRUNERS: dict[str, Method] = _pruners()
HEALERS: dict[str, Method] = _healers()
