"""tasks/catalog.py, the registries' static table, is equal to the live registries, both ways: every name, every
method's schema, defaults and flags, and every settings check's verdict and message on a battery of settings."""
from __future__ import annotations

import itertools

import pytest

from orchestrator.spec import registries
from tasks import catalog
from tasks.data import DATASETS, DIGITS_SPLIT_SIZES
from tasks.healing import HEALERS, resolve_healer
from tasks.models import ADAPTERS, MODEL_SOURCES, MODELS, parse_ref
from tasks.models.weights import DATA_SEED, SHIPPED
from tasks.pruning import PRUNERS

# values each setting is tried with, alone and in pairs: valid ones, bounds, wrong types, non-finite numbers
POOL = (None, True, False, 0, 1, 2, 3, 4, 8, -1, 0.0, 0.5, 1.0, 1.5, -0.5, 1e-3, float("inf"), float("nan"), "x",
        "auto", "token", "example", "train", "frozen", "qk", "qkv", "median", "mean", "conv", "bn", "activation",
        "magnitude", "authors", "oas", "joint", "module", "cumulative", "calib", "reject", "variance_match", [],
        [0.5], [0.5, 0.9], [0.9, 0.5], [0.2, 1.2], [True], ["a"], {"a": 1})


def outcome(fn, *args):
    try:
        return "ok", fn(*args)
    except (ValueError, TypeError, KeyError) as e:
        return type(e).__name__, str(e)


def settings_battery(schema):
    keys = list(schema) + ["no_such_setting"]
    yield {}
    for k in keys:
        for v in POOL:
            yield {k: v}
    for a, b in itertools.combinations(list(schema), 2):  # cross-field rules (n < m, floor <= cap, w_align/w_kl)
        for va, vb in itertools.product(POOL[:16], repeat=2):
            yield {a: va, b: vb}


def test_every_registry_lists_the_same_names_both_ways():
    assert sorted(catalog.PRUNERS) == PRUNERS.names()
    assert sorted(catalog.HEALERS) == HEALERS.names()
    assert catalog.REFERENCE_MODELS == {n: MODELS.get(n).dataset for n in MODELS.names()}
    assert list(catalog.MODEL_SOURCES) == MODEL_SOURCES.names()
    assert list(catalog.ADAPTERS) == ADAPTERS.names()
    assert catalog.DATASETS == {n: getattr(DATASETS.get(n), "check", None) is not None for n in DATASETS.names()}
    assert catalog.DIGITS_SPLIT_SIZES == DIGITS_SPLIT_SIZES and catalog.DATA_SEED == DATA_SEED
    assert catalog.SHIPPED_SHA256 == {n: w.sha256 for n, w in SHIPPED.items()}


def test_search_designs_are_the_search_registry():
    from orchestrator.search import DESIGNS
    from orchestrator.spec.checks import DESIGNS as NAMES

    assert sorted(NAMES) == DESIGNS.names()


@pytest.mark.parametrize("kind, name", [("pruner", n) for n in PRUNERS.names()] + [("healer", n) for n in HEALERS.names()])
def test_each_method_is_its_registered_method(kind, name):
    live, table = (PRUNERS if kind == "pruner" else HEALERS).get(name), registries.get(kind, name)
    assert table.kind == kind and table.name == name
    assert dict(table.schema) == dict(live.settings_schema)
    if kind == "healer":
        assert table.trains == live.trains
    assert table.uses_calibration == live.uses_calibration
    assert kind == "healer" or table.seeded_mask == live.seeded_mask
    assert table.has_grid == hasattr(live, "check_sparsity")
    checked = 0
    for s in settings_battery(live.settings_schema):
        got = outcome(table.check, s)
        assert got == outcome(live.check, s), (name, s)
        if got[0] != "ok":
            continue
        checked += 1
        assert outcome(table.resolved_settings, s) == outcome(live.resolved_settings, s), (name, s)
        if kind == "pruner":
            assert table.fixed_sparsity(s) == live.fixed_sparsity(s), (name, s)
            assert registries.diagnostic_settings(table, s) == registries.diagnostic_settings(live, s), (name, s)
            for sp in (0.5, 0.9, 0.97, 0.98):
                assert table.pattern(sp, s) == live.pattern(sp, s), (name, s, sp)
                if table.has_grid:
                    assert outcome(table.check_sparsity, sp, s) == outcome(live.check_sparsity, sp, s), (name, s, sp)
    assert checked >= 1 + len(live.settings_schema)  # the battery reached the accepting side for every setting


CHAINS = [[{"name": "corp"}, {"name": "starfish", "settings": {"granularity": "token"}}],
          [{"name": "none"}, {"name": "ce"}], [{"name": "crbn", "settings": {"bn_batches": 0}}, {"name": "kl"}],
          [{"name": "none"}, {"name": "no_such_healer"}], [{"name": "mse"}], [{"name": "kl"}, {"name": "starfish_kl",
                                                                           "settings": {"w_align": 0, "w_kl": 0}}]]


@pytest.mark.parametrize("chain", CHAINS)
def test_chains_resolve_and_check_as_the_live_chain(chain):
    name, settings = "+".join(st["name"] for st in chain), {"chain": chain}
    live, table = outcome(resolve_healer, name, settings), outcome(registries.resolve_healer, name, settings)
    assert (live[0], live[0] == "ok" or live[1]) == (table[0], table[0] == "ok" or table[1])
    if live[0] == "ok":
        lh, th = live[1], table[1]
        assert (th.name, th.trains) == (lh.name, lh.trains)
        assert outcome(th.check, settings) == outcome(lh.check, settings)
        assert outcome(th.check, {**settings, "x": 1}) == outcome(lh.check, {**settings, "x": 1})
        if outcome(lh.check, settings)[0] == "ok":
            assert th.resolved_settings(settings) == lh.resolved_settings(settings)


def test_healers_read_the_digits_layout_as_the_live_dataset():
    from dataclasses import replace

    from tasks.data import load_dataset

    live = load_dataset("digits", seed=0)
    layout = registries.DigitsLayout()
    assert {s: len(layout[s]) for s in layout.splits} == {s: len(live[s]) for s in live.splits}
    assert {s: layout[s].labels is None for s in layout.splits} == {s: live[s].labels is None for s in live.splits}
    unlabeled = replace(live, splits={**live.splits, "train": replace(live["train"], labels=None)})
    for name in HEALERS.names():
        for data, s in itertools.product((live, unlabeled), ({}, {"split": "train"}, {"split": "selection"})):
            assert outcome(registries.get("healer", name).check_data, data, s) == \
                outcome(HEALERS.get(name).check_data, data, s), (name, s)


def test_reference_models_by_name_are_parse_ref():
    for name in MODELS.names():
        for offline in (False, True):
            assert registries.reference_ref(name, offline) == parse_ref(name, offline=offline).to_dict()
    from tasks.models import ModelSourceError
    from tasks.models.reference import check_shipped_seed

    for seed in (DATA_SEED, DATA_SEED + 1):
        live = outcome(check_shipped_seed, "vit_digits", seed)
        assert registries.check_shipped_seed("vit_digits", seed) == (None if live[0] == "ok" else live[1])
    assert issubclass(ModelSourceError, ValueError)


def test_a_name_the_table_does_not_list_comes_from_the_live_registry():
    """A plugin registers methods the table cannot know: the spec finds them in the live registry."""
    import tests.fault_plugins  # noqa: F401 - registers test_flaky and test_nan

    assert "test_flaky" not in catalog.HEALERS and registries.known("healer", "test_flaky")
    assert registries.get("healer", "test_flaky") is HEALERS.get("test_flaky")
    assert registries.resolve_healer("test_flaky") is HEALERS.get("test_flaky")
    assert not registries.known("healer", "no_such_healer") and not registries.known("pruner", 3)


def test_defaults_are_what_the_live_pruner_uses_for_a_setting_left_out():
    """``Method.defaults`` (nm, erk, corp: not filled in by ``resolve``, so that cell ids stay as they were) tell
    ``nm`` and ``nm {n: 2, m: 4}`` apart from ``nm {n: 1, m: 4}``: they must be the values the live pruner uses."""
    import inspect

    import torch

    g = torch.Generator().manual_seed(0)
    w = {"a": torch.randn(8, 16, generator=g), "b": torch.randn(16, 32, generator=g), "c": torch.randn(4, 8, generator=g)}
    for name, other in (("nm", {"n": 1, "m": 4}), ("erk", {"floor": 0.025, "cap": 0.6})):
        live, table = PRUNERS.get(name), registries.get("pruner", name)
        left_out = live(w, 0.5, seed=0)
        assert all(torch.equal(left_out[k], v) for k, v in live(w, 0.5, seed=0, **table.defaults).items()), name
        assert not all(torch.equal(left_out[k], v) for k, v in live(w, 0.5, seed=0, **other).items()), name
    assert registries.get("pruner", "corp").defaults == {
        "rank": inspect.signature(PRUNERS.get("corp").__call__).parameters["rank"].default}
    assert sorted(n for n, m in catalog.PRUNERS.items() if m.defaults) == ["corp", "erk", "nm"]
