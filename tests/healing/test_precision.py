"""heal.precision (tasks/healing/precision.py): a named setting with the same loop on every device. On the CPU: tf32
is fp32 bit for bit (the CPU has no TF32 mode); bf16 autocast heals with the invariants intact, its loss computed
in float32, and lands near fp32; the TF32 flags are restored after a heal. The divergence guard (no host sync per
step) names the first bad step like a per-step check."""
import copy

import numpy as np
import pytest
import torch

from tasks.healing import HEALERS, HealConfig, HealingDiverged
from tasks.healing.guard import DivergenceGuard, finite_norms
from tasks.healing.losses import cosine_align_loss
from tasks.healing.precision import as_f32, precision_flags
from tasks.healing.targets import recompute_batches, take_rows
from tasks.models import get_adapter
from tasks.pruning import mask_violations
from tasks.trial import memory_format, on_device

STARFISH = HEALERS.get("starfish")


def _heal(case, precision, **kw):
    return STARFISH.heal(case.ctx, HealConfig(lr=1e-2, epochs=3, batch_size=8, precision=precision, **kw))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind,scope", [("timm_vit", "qkv_out_mlp"), ("resnet", "conv")])
def test_tf32_is_fp32_on_the_cpu(heal_case, kind, scope):
    a, b = heal_case(kind, scope, sparsity=0.8), heal_case(kind, scope, sparsity=0.8)
    ra, rb = _heal(a, "fp32"), _heal(b, "tf32")
    assert ra.epoch_losses == rb.epoch_losses
    sa, sb = a.model.state_dict(), b.model.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind,scope", [("timm_vit", "qkv_out_mlp"), ("resnet", "conv")])
def test_bf16_heals_keeps_masks_and_tracks_fp32(heal_case, kind, scope):
    a, b = heal_case(kind, scope, sparsity=0.8), heal_case(kind, scope, sparsity=0.8)
    ra, rb = _heal(a, "fp32", settings={"bn": "frozen"}), _heal(b, "bf16", settings={"bn": "frozen"})
    assert rb.epoch_losses[-1] < 0.9 * rb.epoch_losses[0], rb.epoch_losses  # it heals
    assert mask_violations(b.model, b.masks) == 0
    b.assert_invariants()
    assert all(p.dtype == torch.float32 for p in b.model.parameters())  # weights stay float32
    assert rb.epoch_losses != ra.epoch_losses  # autocast did run in bfloat16
    assert abs(rb.epoch_losses[-1] - ra.epoch_losses[-1]) < 0.25 * ra.epoch_losses[0]


def test_precision_flags_restored():
    before = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    with precision_flags("tf32"):
        assert torch.backends.cuda.matmul.allow_tf32 and torch.backends.cudnn.allow_tf32
    with precision_flags("fp32"):
        assert not torch.backends.cuda.matmul.allow_tf32
    assert (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32) == before
    with pytest.raises(ValueError, match="precision must be one of fp32, tf32, bf16"):
        with precision_flags("fp16"):
            pass


def test_loss_of_bfloat16_outputs_is_computed_in_float32():
    g = torch.Generator().manual_seed(0)
    o, t = torch.randn(4, 5, 16, generator=g), torch.randn(4, 5, 16, generator=g)
    ref = cosine_align_loss([o.double()], [t.double()])
    got = cosine_align_loss([as_f32(o.bfloat16())], [t.half()])
    assert got.dtype == torch.float32
    assert abs(float(got) - float(ref)) < 1e-2  # bf16 rounding of the outputs only, not of the reduction
    assert as_f32(o) is o


def test_guard_names_the_first_bad_step_and_undoes_later_ones():
    dev = torch.device("cpu")
    g = DivergenceGuard(dev, first_step=10)
    t, f = torch.tensor(True), torch.tensor(False)
    assert not bool(g.record(t, t, torch.tensor(0), t, torch.tensor(0.5)))  # step 10: fine
    assert bool(g.record(t, f, torch.tensor(2), t, torch.tensor(0.4)))  # step 11: a gradient of param 2
    assert bool(g.record(f, t, torch.tensor(0), t, torch.tensor(float("nan"))))  # step 12: undone too, not named
    with pytest.raises(HealingDiverged, match=r"healer 'h': non-finite gradient for c at epoch 3, step 12"):
        g.raise_if_bad("h", lambda s: f"epoch 3, step {s + 1}", ["a", "b", "c"])
    ok = [torch.ones(3), torch.zeros(2)]
    bad = [torch.ones(3), torch.tensor([1.0, float("inf")]), torch.tensor([float("nan")])]
    assert [(bool(a), int(b)) for a, b in (finite_norms(ok, dev), finite_norms(bad, dev), finite_norms([], dev))] == \
        [(True, 2), (False, 1), (True, 0)]


@pytest.mark.timeout(60)
def test_nan_mid_epoch_restores_weights_of_the_step_before(heal_case):
    """A NaN batch in the middle of an epoch: the steps after it (no host check in between) change nothing."""
    case = heal_case("timm_vit", "qkv_out_mlp").nan_in_batch(2)  # the first row of the third batch of epoch 1
    ref = heal_case("timm_vit", "qkv_out_mlp")
    with pytest.raises(HealingDiverged, match="loss became nan at epoch 1, step 3"):
        STARFISH.heal(case.ctx, HealConfig(lr=1e-3, epochs=1, batch_size=8))
    snaps = []

    class Recording(type(STARFISH)):  # the same healer, observed: the weights after each step of an undamaged run
        def _step(self, *a, **kw):
            out = super()._step(*a, **kw)
            snaps.append({k: v.detach().clone() for k, v in ref.model.state_dict().items()})
            return out

    Recording().heal(ref.ctx, HealConfig(lr=1e-3, epochs=1, batch_size=8))
    sa, sb = case.model.state_dict(), snaps[1]  # after the two good steps, same schedule
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not all(torch.equal(sa[k], snaps[2][k]) for k in sa)  # the third step would have changed them


def test_memory_format_and_placement_on_the_cpu():
    conv = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.Conv2d(4, 4, 3))
    vit_like = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 4, stride=4), torch.nn.Linear(4, 4))
    assert memory_format("auto", "cuda", conv) == torch.channels_last
    assert memory_format("auto", "cuda", vit_like) == torch.preserve_format  # a patch embedding only
    assert memory_format("auto", "cpu", conv) == torch.preserve_format
    assert memory_format(True, "cpu", vit_like) == torch.channels_last
    x = torch.randn(2, 3, 4, 4)
    assert on_device(x, "cpu", torch.channels_last) is x  # the CPU path is untouched


def test_take_rows_on_the_cpu_is_indexing():
    """tasks/healing/targets.py ``take_rows``: on the CPU exactly ``x[rows]`` (numpy or torch rows, any order, repeats
    allowed); the pinned gather for a GPU: tests/gpu/test_cuda_stream.py."""
    x = torch.arange(6 * 3 * 2, dtype=torch.float32).reshape(6, 3, 2)
    for rows in (np.array([4, 0, 5]), torch.tensor([1, 1, 3]), np.array([], dtype=np.int64)):
        out = take_rows(x, rows, torch.device("cpu"))
        assert torch.equal(out, x[torch.as_tensor(rows, dtype=torch.int64)]) and out.shape[1:] == x.shape[1:]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("precision", ["tf32", "bf16"])
def test_recomputed_targets_are_made_as_the_store_makes_them(heal_case, precision):
    """Recompute mode (tasks/healing/targets.py ``recompute_batches``) runs the dense model between steps under
    ``heal.precision``'s process-wide flags: its forward passes run with the dense tasks' flags (no TF32 matmuls) and
    outside autocast, so that recomputed targets equal stored ones whatever mode the planner picked; the healed
    model's forward passes run under the heal's precision."""
    case = heal_case("timm_vit", "qkv_out_mlp", n=16)
    dense = copy.deepcopy(case.model)
    seen: dict[str, set] = {"dense": set(), "healed": set()}

    def record(who):
        return lambda *_: seen[who].add((torch.backends.cuda.matmul.allow_tf32, torch.is_autocast_enabled("cpu")))

    dense.register_forward_pre_hook(record("dense"))
    case.model.register_forward_pre_hook(record("healed"))
    blocks = get_adapter(dense).blocks(dense)
    case.ctx.batches = lambda e: recompute_batches(dense, blocks, case.ctx.images, 8, 0, e)
    HEALERS.get("starfish").heal(case.ctx, HealConfig(lr=1e-3, epochs=1, batch_size=8, precision=precision))
    assert seen["dense"] == {(False, False)}
    assert seen["healed"] == {(precision == "tf32", precision == "bf16")}
