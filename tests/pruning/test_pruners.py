"""Mask generators (tasks.pruning) and mask artifacts (tasks.store.masks): exact counts, exact selections."""
import json

import numpy as np
import pytest
import torch
from safetensors import safe_open

from tasks.models import ScopeEntry, get_adapter
from tasks.pruning import (PRUNERS, MaskStore, achieved_sparsity, apply_masks, expand_masks, make_masks,
                           mask_violations, n_pruned, train_masks)
from tasks.pruning.magnitude import nm_mask
from tasks.store import StoreError


def _weights(seed=0):
    g = torch.Generator().manual_seed(seed)
    return {"a": torch.randn(7, 13, generator=g),  # 91
            "b": torch.randn(4, 3, 3, 3, generator=g),  # 108
            "c": torch.randn(10, generator=g)}  # 10


# hand-computed floor(s*n + 0.5) for n = 91, 108, 10
EXPECTED_PRUNED = {
    0.0: (0, 0, 0),
    0.1: (9, 11, 1),  # 9.1, 10.8, 1.0
    0.25: (23, 27, 3),  # 22.75, 27.0, 2.5 -> half up
    0.5: (46, 54, 5),  # 45.5 -> 46
    0.8: (73, 86, 8),  # 72.8, 86.4, 8.0
    0.95: (86, 103, 10),  # 86.45, 102.6, 9.5 -> 10
}


@pytest.mark.parametrize("s", sorted(EXPECTED_PRUNED))
def test_n_pruned_hand_values(s):
    assert tuple(n_pruned(n, s) for n in (91, 108, 10)) == EXPECTED_PRUNED[s]


@pytest.mark.parametrize("s", sorted(EXPECTED_PRUNED))
def test_magnitude_exact_count_and_smallest_removed(s):
    w = _weights()
    masks = PRUNERS.get("magnitude")(w, s, seed=0)
    for (name, t), k in zip(w.items(), EXPECTED_PRUNED[s]):
        m = masks[name]
        assert m.dtype == torch.bool and m.shape == t.shape
        assert int((~m).sum()) == k
        a = t.abs().numpy().ravel()
        expected_pruned = np.sort(np.argsort(a, kind="stable")[:k])
        np.testing.assert_array_equal(np.flatnonzero(~m.numpy().ravel()), expected_pruned)
        if 0 < k < a.size:
            assert a[~m.numpy().ravel()].max() <= a[m.numpy().ravel()].min()


def test_magnitude_ties_drop_lower_flat_index_first():
    w = {"t": torch.tensor([[1.0, -1.0, 1.0, 2.0]])}
    m = PRUNERS.get("magnitude")(w, 0.5, seed=0)["t"]
    assert m.tolist() == [[False, False, True, True]]


def test_global_magnitude_exact_count_single_threshold():
    g = torch.Generator().manual_seed(1)
    w = {"small": torch.randn(20, 10, generator=g) * 0.01,  # 200
         "big": torch.randn(30, 5, generator=g) * 1.0,  # 150
         "mid": torch.randn(8, 8, generator=g) * 0.1}  # 64
    s = 0.6
    masks = PRUNERS.get("global_magnitude")(w, s, seed=0)
    k = 248  # floor(0.6 * 414 + 0.5) = floor(248.9)
    assert sum(int((~m).sum()) for m in masks.values()) == k
    allw = np.concatenate([t.abs().numpy().ravel() for t in w.values()])
    allm = np.concatenate([masks[n].numpy().ravel() for n in w])
    assert allw[~allm].max() <= allw[allm].min()  # one threshold
    np.testing.assert_array_equal(np.flatnonzero(~allm), np.sort(np.argsort(allw, kind="stable")[:k]))
    per = {n: float((~m).float().mean()) for n, m in masks.items()}
    assert per["small"] == 1.0 and per["big"] < 0.3 and 0.0 < per["mid"] < 1.0  # layer sparsities differ


def test_nm_hand_case_with_ties():
    w = torch.tensor([[0.1, -5.0, 3.0, 0.2, 1.0, 1.0, 1.0, 1.0]])
    assert nm_mask(w, 2, 4).tolist() == [[False, True, True, False, True, True, False, False]]


@pytest.mark.parametrize("shape", [(6, 16), (5, 8, 3, 3), (3, 8, 1, 1)])
@pytest.mark.parametrize("n,m", [(2, 4), (1, 4), (4, 8)])
def test_nm_groups_keep_exactly_n_largest(shape, n, m):
    w = torch.randn(*shape, generator=torch.Generator().manual_seed(2))
    mask = PRUNERS.get("nm")({"w": w}, 0.0, seed=0, n=n, m=m)["w"]
    assert mask.shape == w.shape and mask.dtype == torch.bool
    a = w.abs().numpy().reshape(shape[0], -1, m)  # (out, G, m) over flattened in*kh*kw
    k = mask.numpy().reshape(shape[0], -1, m)
    assert (k.sum(-1) == n).all()
    assert (np.where(k, a, np.inf).min(-1) >= np.where(~k, a, -np.inf).max(-1)).all()
    assert int((~mask).sum()) == w.numel() * (m - n) // m


@pytest.mark.parametrize("shape", [(3, 10), (2, 3, 3, 3)])
def test_nm_rejects_width_not_divisible(shape):
    with pytest.raises(ValueError, match="not divisible by M=4"):
        nm_mask(torch.randn(*shape), 2, 4)


def test_nm_check_and_fixed_sparsity():
    p = PRUNERS.get("nm")
    p.check({})
    p.check({"n": 1, "m": 4})
    for bad in ({"n": 4, "m": 4}, {"n": 5, "m": 4}, {"n": 0, "m": 4}):
        with pytest.raises(ValueError, match="0 < n < m"):
            p.check(bad)
    for bad in ({"n": True}, {"m": 4.0}, {"k": 2}):
        with pytest.raises(ValueError):
            p.check(bad)
    assert p.fixed_sparsity({}) == 0.5 and p.fixed_sparsity({"n": 1, "m": 4}) == 0.75
    with pytest.raises(ValueError, match="unknown setting"):
        PRUNERS.get("magnitude").check({"n": 2})
    assert PRUNERS.get("magnitude").fixed_sparsity({}) is None


def test_pattern_labels():
    assert PRUNERS.get("magnitude").pattern(0.8, {}) == "0.8"
    assert PRUNERS.get("global_magnitude").pattern(0.95, {}) == "0.95"
    assert PRUNERS.get("nm").pattern(0.5, {}) == "2:4"
    assert PRUNERS.get("nm").pattern(0.0, {"n": 1, "m": 8}) == "1:8"


@pytest.mark.parametrize("s,expected", [(0.5, 0.5), (0.3, 1228 / 4096)])  # 2 x floor(0.3*2048+0.5)=614
def test_make_masks_qk_scope_touches_only_q_and_k_rows(tiny_model, s, expected):
    model = tiny_model("timm_vit")
    entries = get_adapter(model).scope(model, "qk")
    masks = make_masks(model, entries, "magnitude", s, seed=0)
    assert set(masks) == {"blocks.0.attn.qkv.weight", "blocks.1.attn.qkv.weight"}
    for e in entries:
        m = masks[e.param]
        w = dict(model.named_parameters())[e.param].detach()
        assert m.shape == (96, 32) and e.rows == (0, 64)
        assert bool(m[64:].all())  # V rows untouched
        assert int((~m[:64]).sum()) == n_pruned(2048, s)
        # measured on the region: the smallest |w| among Q/K rows, V magnitudes play no role
        np.testing.assert_array_equal(m[:64].numpy(), PRUNERS.get("magnitude")({"r": w[:64]}, s, seed=0)["r"].numpy())
    assert achieved_sparsity(entries, masks) == expected


def test_make_masks_errors(tiny_model):
    model = tiny_model("timm_vit")
    with pytest.raises(KeyError, match="does not have"):
        make_masks(model, [ScopeEntry("blocks.9.attn.qkv.weight")], "magnitude", 0.5, seed=0)
    with pytest.raises(KeyError, match="unknown pruner"):
        make_masks(model, [ScopeEntry("blocks.0.attn.qkv.weight")], "nope", 0.5, seed=0)
    with pytest.raises(ValueError, match="0 < n < m"):
        make_masks(model, [ScopeEntry("blocks.0.attn.qkv.weight")], "nm", 0.5, seed=0, settings={"n": 4, "m": 2})


def test_achieved_sparsity_counts_region_only():
    entries = [ScopeEntry("a"), ScopeEntry("b", rows=(0, 1))]
    a = torch.tensor([[True, False, True, False], [True, True, False, True]])  # 3 of 8 pruned
    b = torch.tensor([[False, True], [True, True], [False, False]])  # region row 0: 1 of 2; rows 1-2 ignored
    assert achieved_sparsity(entries, {"a": a, "b": b}) == 4 / 10


def test_expand_and_train_masks_row_range():
    lin = torch.nn.Linear(2, 3, bias=False)
    entries = [ScopeEntry("weight", rows=(1, 3))]
    region_mask = {"weight": torch.tensor([[False, True], [True, False]])}
    full = expand_masks(lin, entries, region_mask)["weight"]
    assert full.tolist() == [[True, True], [False, True], [True, False]]
    assert train_masks(lin, entries, {"weight": full})["weight"].tolist() == [[False, False], [False, True],
                                                                           [True, False]]


def test_apply_masks_and_mask_violations_hand_case():
    lin = torch.nn.Linear(3, 2)
    with torch.no_grad():
        lin.weight.copy_(torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]]))
    bias = lin.bias.detach().clone()
    masks = {"weight": torch.tensor([[True, False, True], [False, True, True]])}
    assert mask_violations(lin, masks) == 2
    with torch.no_grad():
        lin.weight[0, 1] = 0.0  # an already-zero masked entry is no violation
    assert mask_violations(lin, masks) == 1
    apply_masks(lin, masks)
    assert lin.weight.tolist() == [[1.0, 0.0, 3.0], [0.0, 5.0, 6.0]]
    assert torch.equal(lin.bias, bias)
    assert mask_violations(lin, masks) == 0


# --- MaskStore ----------------------------------------------------------------------------------------

KEY = "0123456789abcdef0123456789abcdef"


def test_mask_store_round_trip(tmp_path):
    st = MaskStore(tmp_path / "masks")
    g = torch.Generator().manual_seed(3)
    masks = {"blocks.0.attn.qkv.weight": torch.rand(96, 32, generator=g) > 0.5,
             "layer1.0.conv1.weight": torch.rand(16, 64, 3, 3, generator=g) > 0.2}
    assert not st.has(KEY)
    path = st.save(KEY, masks, {"pruner": "magnitude", "sparsity": 0.8})
    assert st.has(KEY) and path == (tmp_path / "masks" / f"{KEY}.safetensors").resolve()
    back = st.load(KEY)
    assert set(back) == set(masks)
    for k in masks:
        assert back[k].dtype == torch.bool and torch.equal(back[k], masks[k])
    with safe_open(str(path), "pt") as f:
        assert json.loads(f.metadata()["meta"]) == {"pruner": "magnitude", "sparsity": 0.8}
    assert sorted(p.name for p in (tmp_path / "masks").iterdir()) == [f"{KEY}.safetensors"]  # no temp left


@pytest.mark.parametrize("key", ["../" + KEY[3:], "../../etc/passwd", KEY[:31], KEY.upper(), KEY + "/",
                                 "/tmp/" + KEY, KEY[:16] + "/.." + KEY[19:], "", None])
def test_mask_store_rejects_bad_keys(tmp_path, key):
    st = MaskStore(tmp_path / "masks")
    for call in (lambda: st.path(key), lambda: st.has(key), lambda: st.load(key),
                 lambda: st.save(key, {"w": torch.ones(2, dtype=torch.bool)}, {})):
        with pytest.raises(StoreError):
            call()
    assert list(tmp_path.rglob("*.safetensors")) == []
