"""The shared gradient-loop settings ``bn`` and ``qk_train`` (docs/methods.md#starfish): the authors' defaults
(train-mode BatchNorm, whole fused qkv trained) and the named alternatives."""
import copy

import pytest
import torch

from tasks.healing import HEALERS, HealConfig, dense_targets, in_memory_batches
from tasks.pruning import region
from tasks.pruning.repair import bn_state_names

STARFISH = HEALERS.get("starfish")


def _bn_buffers(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items() if k in bn_state_names(model)}


def test_bn_train_momentum_updates_from_dense_stats(heal_case):
    """lr = 0 and 32 identical images: every BN sees the same batch statistics x̄ on each of the T = 4·2 steps,
    so running_mean = 0.9^T·dense + (1 − 0.9^T)·x̄ (same for running_var with the unbiased batch variance), and
    num_batches_tracked grows by exactly T (docs/methods.md#starfish)."""
    case = heal_case("resnet", "conv", sparsity=0.5)
    same = case.ctx.images[:1].repeat(32, 1, 1, 1)
    case.ctx.images = same
    tg = dense_targets(case.model, case.ctx.blocks, same)  # any targets: lr = 0
    case.ctx.batches = in_memory_batches(tg, 8, seed=0)
    probe = copy.deepcopy(case.model)
    for m in probe.modules():
        if isinstance(m, torch.nn.BatchNorm2d):
            m.momentum = 1.0  # running stats := this batch's statistics
    probe.train()
    with torch.no_grad():
        probe(same[:8])
    batch = _bn_buffers(probe)
    dense = _bn_buffers(case.model)
    STARFISH.heal(case.ctx, HealConfig(lr=0.0, epochs=2, batch_size=8))
    after = _bn_buffers(case.model)
    T, keep = 8, 0.9 ** 8
    assert keep == pytest.approx(0.43046721)
    n = 0
    for k, v in after.items():
        if k.endswith("num_batches_tracked"):
            assert int(v) == int(dense[k]) + T
            continue
        expect = keep * dense[k].double() + (1 - keep) * batch[k].double()
        torch.testing.assert_close(v.double(), expect, rtol=1e-4, atol=1e-5)  # float32 updates
        assert not torch.allclose(v, dense[k])  # the update is not vacuous
        n += 1
    assert n >= 10
    assert not case.model.training  # evaluation afterwards is in eval mode
    case.assert_invariants(allowed=STARFISH.may_change(case.model, case.entries, {}))


@pytest.mark.parametrize("name", ["starfish", "mse", "kl", "starfish_kl"])
def test_bn_frozen_leaves_every_buffer_bit_identical(heal_case, name):
    healer = HEALERS.get(name)
    case = heal_case("resnet", "conv")
    healer.heal(case.ctx, HealConfig(lr=1e-2, epochs=2, batch_size=8, settings={"bn": "frozen"}))
    assert healer.may_change(case.model, case.entries, {"bn": "frozen"}) == set()
    case.assert_invariants()  # every BN buffer bit-identical
    assert any(k.endswith("running_var") for k in case.before)


@pytest.mark.parametrize("name", ["starfish", "mse", "kl", "starfish_kl"])
def test_bn_train_is_the_default_of_every_gradient_healer(heal_case, name):
    healer = HEALERS.get(name)
    case = heal_case("resnet", "conv")
    healer.heal(case.ctx, HealConfig(lr=1e-2, epochs=1, batch_size=8))
    sd = case.model.state_dict()
    changed = {k for k in bn_state_names(case.model) if not torch.equal(sd[k], case.before[k])}
    assert changed == bn_state_names(case.model)  # every BN buffer moved (means, vars, counters)
    assert healer.resolved_settings({})["bn"] == "train" and healer.resolved_settings({})["qk_train"] == "qkv"
    case.assert_invariants(allowed=healer.may_change(case.model, case.entries, {}))


def test_vit_bn_train_and_frozen_are_bit_identical(heal_case):
    """No BatchNorm and zero dropout: train mode changes nothing on a ViT."""
    out = {}
    for bn in ("train", "frozen"):
        case = heal_case("timm_vit", "qkv_out_mlp")
        res = STARFISH.heal(case.ctx, HealConfig(lr=1e-2, epochs=2, batch_size=8, settings={"bn": bn}))
        out[bn] = (res.epoch_losses, case.model.state_dict())
    assert out["train"][0] == out["frozen"][0]
    assert all(torch.equal(v, out["frozen"][1][k]) for k, v in out["train"][1].items())


@pytest.mark.parametrize("qk_train", ["qkv", "qk"])
def test_qk_train_sets_the_trainable_qkv_rows(heal_case, qk_train):
    case = heal_case("timm_vit", "qk", sparsity=0.5)
    STARFISH.heal(case.ctx, HealConfig(lr=1e-2, epochs=1, batch_size=8, settings={"qk_train": qk_train}))
    sd = case.model.state_dict()
    for e in case.entries:
        w, b, m = sd[e.param], case.before[e.param], case.masks[e.param]
        d = w.shape[1]
        assert e.rows == (0, 2 * d)
        assert torch.all(w[~m] == 0)  # masked Q/K entries stay exactly 0
        assert int((~region(m, e)).sum()) > 0
        v_rows_changed = not torch.equal(w[2 * d :], b[2 * d :])
        assert v_rows_changed == (qk_train == "qkv")
        assert not torch.equal(w[: 2 * d], b[: 2 * d])  # Q/K rows train either way
        bias = e.param.replace("weight", "bias")
        assert torch.equal(sd[bias], case.before[bias])  # no bias is ever trained
    allowed = STARFISH.may_change(case.model, case.entries, {"qk_train": qk_train})
    assert ({e.param for e in case.entries} <= allowed) == (qk_train == "qkv")
    case.assert_invariants(allowed=allowed)


def test_loop_settings_are_validated():
    for name in ("starfish", "mse", "kl", "ce", "starfish_kl"):
        h = HEALERS.get(name)
        h.check({"bn": "frozen", "qk_train": "qk"})
        with pytest.raises(ValueError, match="must be one of"):
            h.check({"bn": "eval"})
        with pytest.raises(ValueError, match="must be one of"):
            h.check({"qk_train": "v"})


def test_resolved_settings_feed_cell_and_mask_keys():
    """A spec that spells out a default and one that omits it are the same cell; a changed default is not
    (docs/methods.md#run-identity). Pruner settings are resolved too (RR's ``at``)."""
    from pathlib import Path

    import yaml

    from orchestrator.spec import parse_spec
    from orchestrator.spec.plan import DIAGNOSTICS_KIND, expand_cells
    from orchestrator.sweep.diagnostics import diagnostics_identity

    base = yaml.safe_load((Path(__file__).resolve().parents[2] / "configs" / "tiny.yaml").read_text())

    def cells(healer, pruner="magnitude"):
        spec = parse_spec(dict(base, healers=[healer], pruners=[pruner]))
        return expand_cells(spec, {m: "conv" for m in spec.models})

    plain, spelled = cells("starfish"), cells({"name": "starfish", "settings": {"bn": "train", "qk_train": "qkv"}})
    frozen = cells({"name": "starfish", "settings": {"bn": "frozen"}})
    assert plain[0].healer_settings == {"bn": "train", "qk_train": "qkv", "granularity": "auto"}
    assert [c.cell_id for c in plain] == [c.cell_id for c in spelled]
    assert not {c.cell_id for c in plain} & {c.cell_id for c in frozen}
    rr = cells("crbn", pruner={"name": "rr", "settings": {"grid": [0.5, 0.9]}})
    assert rr[0].pruner_settings["at"] == "conv" and rr[0].healer_settings["bn_momentum"] == "module"
    ident = rr[0].mask_identity("d" * 32, "c" * 32)
    assert ident["settings"]["at"] == "conv"
    # an RR mask follows its diagnostics table: the table's version is in both keys (a table computed by an older
    # CR+BN must not leave its masks behind); a pruner without diagnostics keeps its key
    assert ident["diagnostics"] == DIAGNOSTICS_KIND == diagnostics_identity(rr[0], "d" * 32, "c" * 32)["kind"]
    assert "diagnostics" not in cells("crbn")[0].mask_identity("d" * 32, "c" * 32)
