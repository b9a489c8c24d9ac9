"""Allocation rules (docs/methods.md#relative-repairability-crbn-rr): LAMP, ERK, the greedy repairability solver,
exact counts, spec validation."""
from __future__ import annotations

import copy
import itertools
import math

import pytest
import torch

from orchestrator.spec import SpecError, parse_spec
from tasks.models import get_adapter
from tasks.pruning import PruneContext, make_masks, n_pruned
from tasks.pruning.allocation_math import (CANDIDATE_GRID, allocate_counts, erk_sparsities, fit_budget,
                                           global_magnitude_sparsities, greedy_allocate, lamp_scores, lamp_sparsities)
from tests.orchestrator.test_spec import BASE


def test_lamp_scores_hand_computed():
    s = lamp_scores(torch.tensor([1.0, -2.0, 3.0]))
    assert torch.allclose(s, torch.tensor([1 / 14, 4 / 13, 1.0], dtype=torch.float64))
    t = lamp_scores(torch.tensor([[2.0, 1.0], [-2.0, 0.0]]))  # ties share the denominator Σ_{|v|>=2} v² = 8
    assert torch.allclose(t, torch.tensor([[0.5, 1 / 9], [0.5, 0.0]], dtype=torch.float64))


def test_lamp_vs_global_magnitude_on_hand_example():
    w = {"a": torch.tensor([1.0, 2.0, 3.0]), "b": torch.tensor([10.0, 4.0])}
    # LAMP scores: a = (1/14, 4/13, 1), b = (16/116, 1); pruning 2 of 5 drops a's 1 and b's 4.
    assert lamp_sparsities(w, 0.4) == {"a": pytest.approx(1 / 3), "b": pytest.approx(0.5)}
    # Global magnitude drops the two smallest |w|: 1 and 2, both in a.
    assert global_magnitude_sparsities(w, 0.4) == {"a": pytest.approx(2 / 3), "b": 0.0}


def test_erk_densities_hand_computed_with_cap():
    # raw = sum(dims)/prod(dims): a 8/16 = 0.5, b 200/1e4 = 0.02; keep 0.1 * 10016 = 1001.6 weights.
    # round 1: eps = 1001.6/208 -> a's density 2.41 > 1: a dense; round 2: eps = 985.6/200, b = 0.02*eps.
    s = erk_sparsities({"a": (4, 4), "b": (100, 100)}, 0.9)
    assert s["a"] == 0.0
    assert s["b"] == pytest.approx(1 - 0.02 * 985.6 / 200)


def test_erk_floor_budget_and_proportionality():
    shapes = {"small": (8, 4, 3, 3), "mid": (64, 64, 3, 3), "big": (512, 512, 3, 3), "fc": (10, 512)}
    n = {k: math.prod(v) for k, v in shapes.items()}
    s = erk_sparsities(shapes, 0.97, floor=0.025)
    d = {k: 1 - v for k, v in s.items()}
    assert sum(n[k] * d[k] for k in n) == pytest.approx(0.03 * sum(n.values()), rel=1e-9)  # exact budget
    assert all(0.025 - 1e-12 <= v <= 1.0 for v in d.values())
    free = [k for k in d if 0.025 + 1e-9 < d[k] < 1 - 1e-9]
    ratios = {k: d[k] / (sum(shapes[k]) / n[k]) for k in free}  # one common eps for unconstrained layers
    assert max(ratios.values()) == pytest.approx(min(ratios.values()), rel=1e-9)
    assert d["big"] == pytest.approx(0.025)  # floored
    with pytest.raises(ValueError, match="cannot reach"):
        erk_sparsities({"a": (100, 100)}, 0.99, floor=0.025)


def test_greedy_known_optimum_flat_layer_first():
    cost = {"steep": [0.0, 5.0, 10.0], "flat": [1.0, 1.0, 1.0]}
    assert greedy_allocate(cost, {"steep": 100, "flat": 100}, (0.5, 0.7, 0.9), 0.7) == {"steep": 0.5, "flat": 0.9}


def test_greedy_matches_brute_force_on_convex_costs():
    """Equal sizes and equal steps + convex costs: greedy = the optimum among allocations of the same budget."""
    grid = (0.5, 0.6, 0.7, 0.8, 0.9)
    gen = torch.Generator().manual_seed(0)
    for trial in range(5):
        cost = {}
        for layer in "abcd":
            inc = torch.sort(torch.rand(4, generator=gen)).values  # increasing increments: convex
            cost[layer] = [0.0] + torch.cumsum(inc, 0).tolist()
        sizes = {k: 50 for k in cost}
        for steps in range(1, 16):
            target = 0.5 + 0.1 * steps / 4
            got = greedy_allocate(cost, sizes, grid, target)
            got_cost = sum(cost[k][grid.index(v)] for k, v in got.items())
            best = min(sum(cost[k][i] for k, i in zip(cost, lv))
                       for lv in itertools.product(range(5), repeat=4) if sum(lv) == steps)
            assert got_cost == pytest.approx(best), (trial, steps)


def test_greedy_negative_increments_ties_and_errors():
    sizes = {"a": 10, "b": 10}
    # b's cost falls with sparsity (negative q): promoted first, all the way.
    assert greedy_allocate({"a": [0, 1, 2], "b": [3, 2, 1]}, sizes, (0.7, 0.8, 0.9), 0.85) == {"a": 0.8, "b": 0.9}
    # equal q: the layer listed first is promoted first
    xy = {"x": 10, "y": 10}
    assert greedy_allocate({"x": [0, 1, 2], "y": [0, 1, 2]}, xy, (0.7, 0.8, 0.9), 0.75) == {"x": 0.8, "y": 0.7}
    assert greedy_allocate({"y": [0, 1, 2], "x": [0, 1, 2]}, xy, (0.7, 0.8, 0.9), 0.75) == {"x": 0.7, "y": 0.8}
    assert greedy_allocate({"x": [0, 1], "y": [0, 1]}, xy, (0.7, 0.8), 0.3) == {"x": 0.7, "y": 0.7}
    with pytest.raises(ValueError, match="cannot reach target sparsity 0.98"):
        greedy_allocate({"x": [0.0] * 7}, {"x": 10}, CANDIDATE_GRID, 0.98)


def test_fit_budget_and_counts_exact():
    alloc = fit_budget({"a": 0.9, "b": 0.8}, {"a": 100, "b": 300}, 0.8)  # overshoot 0.825 -> scaled
    assert 100 * alloc["a"] + 300 * alloc["b"] == pytest.approx(320)
    assert alloc["a"] / alloc["b"] == pytest.approx(0.9 / 0.8)
    c = allocate_counts({"a": 7, "b": 7, "c": 7}, {"a": 0.5, "b": 0.5, "c": 0.5}, 11)
    assert sum(c.values()) == 11 and c == {"a": 4, "b": 4, "c": 3}  # remainders tie: layer order


def _synthetic_table(entries, params, grid, flat: str):
    """RR table where ``flat``'s R never grows with sparsity and every other layer's does."""
    t = {c: [] for c in ("model", "layer", "n_weights", "shape", "sparsity", "D_raw", "D_repair", "R")}
    for e in entries:
        for i, s in enumerate(grid):
            r = 0.1 if e.param == flat else 0.1 + i
            for c, v in zip(t, ("m", e.param, params[e.param].numel(), "[]", s, 1.0, r, r)):
                t[c].append(v)
    return t


@pytest.mark.parametrize("name", ["rr", "repair_residual", "erk", "lamp", "global", "uniform"])
@pytest.mark.parametrize("sparsity", [0.5, 0.9, 0.95])
def test_exact_counts_on_resnet(tiny_model, name, sparsity):
    model = tiny_model("resnet")
    adapter = get_adapter(model)
    entries = adapter.scope(model, "conv")
    params = dict(model.named_parameters())
    flat = entries[-1].param
    ctx = PruneContext(model, adapter, entries, diagnostics={"rr": _synthetic_table(entries, params, CANDIDATE_GRID, flat)})
    masks = make_masks(model, entries, name, sparsity, seed=0, ctx=ctx)
    per = {e.param: int((~masks[e.param]).sum()) for e in entries}
    total = sum(params[e.param].numel() for e in entries)
    if name == "uniform":
        assert per == {e.param: n_pruned(params[e.param].numel(), sparsity) for e in entries}
    else:
        assert sum(per.values()) == n_pruned(total, sparsity)  # exact global count
    for e in entries:  # within a layer: exactly the smallest |w| are removed
        w, m = params[e.param].detach().abs().flatten(), masks[e.param].flatten()
        if (~m).any() and m.any():
            assert w[~m].max() <= w[m].min()
    if name == "rr":  # the layer whose R stays flat is promoted to the top of the grid first: the sparsest
        frac = {k: per[k] / params[k].numel() for k in per}
        assert frac[flat] >= max(frac.values()) - 1.0 / params[flat].numel()
        if sparsity > CANDIDATE_GRID[0]:
            assert frac[flat] > min(frac.values()) + 0.01
        else:  # below the grid there is no diagnostic information: every layer at the target
            assert max(frac.values()) - min(frac.values()) < 0.01


def _spec(**kw):
    d = copy.deepcopy(BASE)
    d.update(kw)
    return d


def test_spec_rejects_unreachable_rr_grid():
    with pytest.raises(SpecError, match=r"pruners\[0\].settings.grid.*'rr'.*'vit_digits'.*cannot reach sparsity 0.9"):
        parse_spec(_spec(pruners=[{"name": "rr", "settings": {"grid": [0.5, 0.7, 0.8]}}]))
    parse_spec(_spec(pruners=[{"name": "rr", "settings": {"grid": [0.5, 0.7, 0.9]}}]))  # reachable: fine


def test_spec_rejects_bn_repair_without_bn_when_asked():
    with pytest.raises(SpecError, match=r"healers\[0\].*'crbn'.*'vit_digits'.*no BatchNorm"):
        parse_spec(_spec(healers=[{"name": "crbn", "settings": {"no_bn": "reject"}}]))
    parse_spec(_spec(healers=[{"name": "crbn"}]))  # default: the per-feature variance operator serves ViTs


def test_allocation_config_validates():
    from pathlib import Path

    from orchestrator.spec import load_spec

    spec = load_spec(Path(__file__).resolve().parents[2] / "configs" / "allocation.yaml")
    assert {p.name for p in spec.pruners} >= {"uniform", "global", "erk", "lamp", "rr"}
    assert {h.name for h in spec.healers} == {"crbn", "starfish"}
    # the default spec's search (its main grid holds these cells): with only the first wave's 2 draws per cell a
    # sampler-seed change moved a STARFISH cell by 17.5 pp (docs/benchmarks.md, retest 2026-11-30)
    default = load_spec(Path(__file__).resolve().parents[2] / "configs" / "default.yaml")
    assert spec.search == default.search
