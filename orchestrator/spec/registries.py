"""The method and model registries as spec checks see them: the static table (tasks/catalog.py) for every name it
lists, the live registry (tasks.pruning, tasks.healing, tasks.models, tasks.data: they import torch) only for a name
it does not list (a plugin's method) and for checks that need an implementation (an external model source, a
dataset that reads its files). tests/test_catalog.py holds the table equal to the live registries.

Pruner and healer objects from either place answer the same questions: ``check``, ``resolved_settings``,
``fixed_sparsity``, ``pattern``, ``trains``, ``check_data`` and (RR's candidate grid) ``check_sparsity``.
"""
from __future__ import annotations

from typing import Any, Mapping, Sequence

from tasks import catalog

CHAIN_SEP = "+"  # tasks.healing.chain.CHAIN_SEP


def live(kind: str):
    """The live registry of ``kind`` (pruner, healer, model, dataset): imports its implementations."""
    if kind == "pruner":
        from tasks.pruning import PRUNERS

        return PRUNERS
    if kind == "healer":
        from tasks.healing import HEALERS

        return HEALERS
    if kind == "model":
        from tasks.models import MODELS

        return MODELS
    from tasks.data import DATASETS

    return DATASETS


def _table(kind: str) -> Mapping[str, Any]:
    return {"pruner": catalog.PRUNERS, "healer": catalog.HEALERS, "model": catalog.REFERENCE_MODELS,
            "dataset": catalog.DATASETS}[kind]


def known(kind: str, name: Any) -> bool:
    """``name`` is registered (the table first; the live registry only for a name the table does not list)."""
    return isinstance(name, str) and (name in _table(kind) or name in live(kind))


def names(kind: str) -> list[str]:
    """Every registered name of ``kind``, plugins' included (for an error message: imports the live registry)."""
    return live(kind).names()


def get(kind: str, name: str):
    """A pruner or healer by name; KeyError (the live registry's message) when it is not registered."""
    return _table(kind).get(name) or live(kind).get(name)


def diagnostic_settings(pruner, settings: Mapping[str, Any]) -> dict[str, Any] | None:
    """What determines a pruner's RR diagnostics table (part of its key), or None when the pruner reads none: the
    table's answer, or a live (plugin) pruner's own ``diagnostic_settings`` when it has one."""
    fn = getattr(pruner, "diagnostic_settings", None)
    return None if fn is None else fn(settings)


def sparsity_check(pruner):
    """The pruner's ``check_sparsity`` (a candidate grid that must reach every sparsity), or None."""
    return pruner.check_sparsity if getattr(pruner, "has_grid", True) and hasattr(pruner, "check_sparsity") else None


class Chain:
    """Healers run in order (tasks.healing.chain.ChainHealer), as the spec checks it: the same name, checks,
    messages and resolved settings, its parts from the table."""

    def __init__(self, chain: Sequence[Mapping[str, Any]]) -> None:
        if len(chain) < 2:
            raise ValueError(f"a healer chain needs at least 2 healers, got {len(chain)}")
        self.parts = []
        for i, st in enumerate(chain):
            try:
                part = get("healer", st["name"])
            except KeyError as e:
                raise ValueError(f"chain[{i}]: {e.args[0]}") from None
            self.parts.append((part, dict(st.get("settings") or {})))
        self.name = CHAIN_SEP.join(p.name for p, _ in self.parts)
        self.trains = any(p.trains for p, _ in self.parts)
        self.uses_calibration = any(p.uses_calibration for p, _ in self.parts)

    def _each(self, fn) -> None:
        for i, (part, settings) in enumerate(self.parts):
            try:
                fn(part, settings)
            except ValueError as e:
                raise ValueError(f"chain[{i}] ({part.name!r}): {e}") from None

    def check(self, settings: Mapping[str, Any]) -> None:
        if set(settings) - {"chain"}:
            raise ValueError(f"a healer chain takes no settings of its own; set them per step, got {sorted(settings)}")
        self._each(lambda part, s: part.check(s))

    def check_data(self, dataset, settings) -> None:
        self._each(lambda part, s: part.check_data(dataset, s))

    def resolved_settings(self, settings) -> dict:
        return {"chain": [{"name": part.name, "settings": part.resolved_settings(s)} for part, s in self.parts]}


def resolve_healer(name: str, settings: Mapping[str, Any] | None = None):
    """tasks.healing.resolve_healer without torch: a listed healer, or the chain a spec entry describes (name
    ``a+b``, settings {"chain": [...]}); any other name from the live registry (KeyError when unknown)."""
    settings = settings or {}
    if name in catalog.HEALERS:
        return catalog.HEALERS[name]
    if "chain" in settings:
        h = Chain(settings["chain"])
        if h.name != name:
            raise ValueError(f"healer chain name {name!r} does not match its steps ({h.name!r})")
        return h
    return live("healer").get(name)


def reference_ref(name: str, offline: bool) -> dict:
    """``tasks.models.parse_ref(name).to_dict()`` of a reference model given by its name (no file, no torch)."""
    return {"name": name, "source": "reference", "arch": "", "pretrained": False, "weights": None, "path": None,
            "num_classes": None, "offline": bool(offline), "init_seed": 0, "model_args": None, "sha256": None,
            "input_size": None}


def check_shipped_seed(name: str, data_seed: int) -> str | None:
    """tasks.models.reference.check_shipped_seed's message when the shipped weights do not serve ``data_seed``."""
    if data_seed == catalog.DATA_SEED:
        return None
    return (f"model {name!r}: the shipped weights were trained on data_seed {catalog.DATA_SEED}'s train split; for "
            f"data_seed {data_seed} train one (healsweep models train {name} --data-seed {data_seed}) and give it "
            f"as {{name: {name}, path: FILE}}")


class SplitLayout:
    """A split's size and whether it carries labels (``labels`` is None when it does not): no pixels."""

    def __init__(self, n: int, labeled: bool) -> None:
        self.n, self.labels = n, (True if labeled else None)

    def __len__(self) -> int:
        return self.n


class SplitsLayout:
    """A dataset's splits as a DatasetSplits answers ``name``, ``splits`` and ``[split]`` (sizes, labels), from
    their sizes alone: every split but calibration carries labels (the calibration split is unlabeled by contract)."""

    def __init__(self, name: str, sizes: Mapping[str, int]) -> None:
        self.name = name
        self.splits = {s: SplitLayout(n, s not in catalog.UNLABELED_SPLITS) for s, n in sizes.items()}

    def __getitem__(self, split: str) -> SplitLayout:
        return self.splits[split]


class DigitsLayout(SplitsLayout):
    """The digits splits (tasks/catalog.py: no torch, no scikit-learn)."""

    def __init__(self) -> None:
        super().__init__("digits", catalog.DIGITS_SPLIT_SIZES)
