"""heal.compile (tasks/healing/compiled.py): regional torch.compile of the target blocks and the objective, with a
real Inductor compile on the CPU. The compiled heal keeps every invariant of the eager one (masks exactly 0, nothing
outside the trainable region changed, BatchNorm statistics followed in train mode), lands on the eager run's losses
and weights to float rounding, and leaves the blocks' eager ``forward`` in place after it."""
import pytest
import torch

from tasks.healing import HEALERS, HealConfig
from tasks.healing.compiled import COMPILE_MODES, check_compile, compiled_blocks
from tasks.pruning import mask_violations

STARFISH = HEALERS.get("starfish")


def _heal(case, compile_mode, **kw):
    return STARFISH.heal(case.ctx, HealConfig(lr=1e-2, epochs=2, batch_size=8, compile=compile_mode, **kw))


@pytest.mark.timeout(300)
@pytest.mark.parametrize("kind,scope,bn", [("timm_vit", "qkv_out_mlp", "train"), ("resnet", "conv", "train")])
def test_compiled_heal_matches_eager_and_keeps_invariants(heal_case, kind, scope, bn):
    a, b = heal_case(kind, scope, sparsity=0.8), heal_case(kind, scope, sparsity=0.8)
    ra = _heal(a, "off", settings={"bn": bn})
    rb = _heal(b, "blocks", settings={"bn": bn})
    assert rb.steps == ra.steps
    assert rb.epoch_losses[-1] < rb.epoch_losses[0]  # it heals
    assert rb.epoch_losses == pytest.approx(ra.epoch_losses, rel=1e-4, abs=1e-6)
    assert mask_violations(b.model, b.masks) == 0
    b.assert_invariants(allowed=STARFISH.may_change(b.model, b.entries, {"bn": bn}))
    sa, sb = a.model.state_dict(), b.model.state_dict()
    for k in sa:  # weights and BN running statistics: the eager run's, to float rounding
        if sa[k].is_floating_point():
            assert torch.allclose(sa[k], sb[k], rtol=1e-3, atol=1e-5), k
        else:
            assert torch.equal(sa[k], sb[k]), k  # num_batches_tracked: the same number of BN updates
    assert all("forward" not in m.__dict__ for _, m in b.ctx.blocks)  # eager forward back after the heal


def test_compiled_blocks_restores_an_instance_forward():
    m = torch.nn.Linear(2, 2)
    own = m.forward = lambda x: x  # an instance attribute set by someone else survives
    with compiled_blocks([("m", m)], "blocks"):
        assert m.forward is not own
    assert m.forward is own
    with compiled_blocks([("m", m)], "off"):
        assert m.forward is own


def test_compile_names_checked():
    assert check_compile("off") == "off" and COMPILE_MODES == ("off", "blocks")
    with pytest.raises(ValueError, match="compile must be one of off, blocks"):
        check_compile("max-autotune")
