"""SnapViT ``variant: authors`` (docs/methods.md#snapvit): per-head + per-block-MLP search space, |x|, soft
per-block floors, separate head/neuron cuts from the s -> (r_m, r_h) mapping, evaluation-budgeted xNES that
returns the best sample ever evaluated, accumulated-gradient sensitivity."""
from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from tasks.models import get_adapter
from tasks.pruning import PRUNERS, PruneContext, make_masks
from tasks.pruning import snapvit as snapvit_pruner
from tasks.pruning import snapvit_math as snapvit
from tasks.pruning.snapvit_authors import (floored_scores, keep_from_scores, multicrop_dino_loss, ratios,
                                           search_index)
from tasks.pruning.xnes import xnes
from tests.conftest import build_model, calib_images


@dataclass(frozen=True)
class G:  # the fields of snapvit_math.Group the authors' cut reads
    block: str
    kind: str
    n: int


@dataclass(frozen=True)
class L:
    groups: tuple


def test_floors_protect_the_top_head_of_each_block():
    """2 blocks × 5 heads, min_head_keep 0.2 -> keep ≥ 1 per block; head ratio 0.5 -> int(10·0.5) = 5 pruned:
    scores {1, 2, 3, 4, 10} go; without floors {1, 2, 3, 4, 5} go and block 0 loses every head."""
    lay = L((G("b0", "head", 5), G("b1", "head", 5)))
    sens = torch.tensor([1, 2, 3, 4, 5, 10, 20, 30, 40, 50], dtype=torch.float64)
    coord, m0 = search_index(lay)
    x = torch.ones(len(m0), dtype=torch.float64)
    for floor, pruned in ((0.2, [1, 2, 3, 4, 10]), (0.0, [1, 2, 3, 4, 5])):
        sc = floored_scores(x, sens, lay, coord, floor, 0.05)
        keep = keep_from_scores(sc, lay, 0.5)  # heads only in scope: r_h = s
        assert sorted(sens[~keep].tolist()) == pruned
    assert int(keep[:5].sum()) == 0  # no floor: block 0 has no head left


def test_search_space_start_and_abs_symmetry():
    lay = L((G("b0", "head", 2), G("b0", "neuron", 3), G("b1", "head", 2), G("b1", "neuron", 3)))
    coord, m0 = search_index(lay)
    assert coord.tolist() == [2, 3, 0, 0, 0, 4, 5, 1, 1, 1]  # MLP weights first, then one per head
    torch.testing.assert_close(m0, torch.tensor([1.2, 0.8, 1.2, 1.2, 0.8, 0.8], dtype=torch.float64))
    sens = torch.arange(1.0, 11.0, dtype=torch.float64)
    x = torch.tensor([-2.0, 0.5, 1.0, -3.0, 2.0, -0.1], dtype=torch.float64)
    a = floored_scores(x, sens, lay, coord, 0.0, 0.0)
    assert torch.equal(a, floored_scores(-x, sens, lay, coord, 0.0, 0.0))  # c = |x|
    assert torch.equal(keep_from_scores(a, lay, 0.4), keep_from_scores(floored_scores(x.abs(), sens, lay, coord, 0, 0),
                                                                      lay, 0.4))


def test_sparsity_maps_to_mlp_and_head_ratios():
    both = {"head", "neuron"}
    assert ratios(0.1, both) == pytest.approx((0.15, 0.0))
    assert ratios(0.6, both) == pytest.approx((0.65, 0.5))
    assert ratios(0.05, both) == pytest.approx((0.075, 0.0))
    assert ratios(0.3, {"neuron"}) == (0.3, 0.3)


def test_xnes_evaluation_budget_returns_best_sample_ever_evaluated():
    """d = 30, 50 evaluations: λ = 14 -> 3 full generations + 8 samples of a 4th; 3 updates; the result is the
    sample with the best fitness among all 50 evaluated, not the mean."""
    seen = []

    def f(x):
        v = -float(((x.abs() - 0.5) ** 2).sum())  # maximised: −Σ(|x| − 0.5)²
        seen.append((v, x.clone()))
        return v

    res = xnes(f, torch.zeros(30, dtype=torch.float64), 1.0, seed=42, evaluations=50)
    assert len(seen) == res.evaluations == 50 and res.updates == 3 and len(res.history) == 4
    best_v, best_x = max(seen, key=lambda t: t[0])
    assert res.best_f == best_v and torch.equal(res.best_x, best_x)
    assert not torch.allclose(res.best_x, res.mean)


def test_multicrop_loss_skips_same_view_and_has_no_temperature():
    torch.manual_seed(0)
    s = torch.nn.functional.normalize(torch.randn(12, 3, 8), dim=-1)
    t = s[:2].clone()
    p = torch.softmax(t, -1)
    ref = sum(-(p[i] * torch.log_softmax(s[j], -1)).sum(-1) for i in range(2) for j in range(12) if j != i).mean()
    torch.testing.assert_close(multicrop_dino_loss(s, t), ref)


def test_authors_masks_nested_and_floors_hold_on_a_tiny_vit():
    snapvit_pruner.clear_memory_cache()
    model = build_model("timm_vit")
    ad = get_adapter(model)
    entries = ad.scope(model, "qkv_out_mlp")
    ctx = PruneContext(model, ad, entries, calib_images=calib_images("timm_vit", 8))
    settings = {"evaluations": 4, "fitness_sparsities": [0.3], "fitness_images": 8, "grad_batch": 4,
                "min_neuron_keep": 0.2}
    assert PRUNERS.get("snapvit").resolved_settings({})["variant"] == "authors"
    prev = None
    for s in (0.1, 0.3, 0.5, 0.7, 0.9):
        m = make_masks(model, entries, "snapvit", s, seed=0, settings=settings, ctx=ctx)
        for name, w in m.items():
            if name.endswith("fc1.weight") and s <= 0.7:  # r_m = s + 0.05 <= 0.8: the floor is never reached
                assert int(w[:, 0].sum()) >= int(w.shape[0] * 0.2)  # per-block neuron floor
            if name.endswith("fc1.weight") and s == 0.9:  # soft: r_m = 0.95 cuts into the protected neurons
                assert int(w[:, 0].sum()) < int(w.shape[0] * 0.2)
        if prev is not None:
            assert all(not bool((~prev[k] & m[k]).any()) for k in m)  # nested
        prev = m
    with pytest.raises(ValueError, match="variant"):
        PRUNERS.get("snapvit").check({"variant": "genetic"})
    assert snapvit.resolve_settings({"variant": "joint"})["grad_batch"] == 1
