"""The loop's post-step (tasks/healing/loop.py ``_step``) does only the passes that can change a weight:
- the mask restore runs only on tensors with a nonzero entry the loop may not change (elsewhere AdamW keeps ±0 with a
  zero gradient exactly, sign bit included);
- under a fused AdamW whose steps provably keep the weights finite (tasks/healing/guard.py ``adamw_stays_finite``),
  a bad step is skipped inside the kernel (its ``found_inf``) instead of copying every weight before each step.
Both give the weights, bit for bit, that restoring and copying gave (checked against the code before the change on
36 heals, docs/gpu.md); here: the bound by hand and against torch's AdamW, the invariants at the bit level, and a
diverged step under each path."""
import math

import pytest
import torch

from tasks.healing import HEALERS, HealConfig, HealingDiverged
from tasks.healing import loop
from tasks.healing.guard import NORM_SAFE, adam_ratio_bound, adamw_stays_finite

STARFISH = HEALERS.get("starfish")


def test_adam_ratio_bound_by_hand():
    # (0.9, 0.999): sqrt(0.01 / (0.001 * (1 - 0.81 / 0.999))) / 0.1 = sqrt(52.857...) / 0.1
    assert adam_ratio_bound((0.9, 0.999)) == pytest.approx(72.703, rel=1e-4)
    assert adam_ratio_bound((0.0, 0.5)) == pytest.approx(math.sqrt(1 / 0.5))  # m = g, v = g²/2 at most
    assert adam_ratio_bound((0.99, 0.9)) is None  # β1² ≥ β2: no bound of this form
    assert adam_ratio_bound((1.0, 0.999)) is None


@pytest.mark.parametrize("fused", [False, True])
def test_adamw_moves_no_entry_beyond_the_bound(fused):
    """Gradients built to push the ratio up (steady; growing by 1.11 a step, near β2/β1, where Cauchy-Schwarz is
    tightest; a spike then tiny; signs flipping; heavy tails): no step of torch's AdamW (lr 1, no decay) moves an
    entry by more than the bound (72.7; the growing sequence reaches 4.18)."""
    gen = torch.Generator().manual_seed(0)
    t = torch.arange(400, dtype=torch.float64)
    seqs = torch.stack([torch.ones(400), 1.11 ** t, torch.where(t < 3, 1e6, 1e-6), (-1) ** t * (t + 1),
                        torch.randn(400, generator=gen, dtype=torch.float64) ** 5,
                        torch.where(t % 50 == 0, 1e4, 1.0)], dim=1).float()  # (steps, 6 entries)
    bound = adam_ratio_bound((0.9, 0.999))
    w = torch.nn.Parameter(torch.zeros(6))
    opt = torch.optim.AdamW([w], lr=1.0, weight_decay=0.0, fused=fused or None)
    worst = 0.0
    for g in seqs:
        before = w.detach().clone()
        w.grad = g.clone()
        opt.step()
        worst = max(worst, float((w.detach() - before).abs().max()))
    assert 4.0 < worst <= bound  # the growing gradient moves an entry by over 4 lr, still within the bound


def test_adamw_stays_finite_decides_by_hand():
    # sqrt(1e6) * (1 + 1000 * 1e-2 * 72.7) = 7.3e5: far below NORM_SAFE
    assert adamw_stays_finite(1.0, 10**6, 1e-2, 0.05, 1000, (0.9, 0.999))
    assert not adamw_stays_finite(1.0, 10**6, NORM_SAFE / 1e3 / 72.7, 0.0, 1000, (0.9, 0.999))  # 1e3 * (1 + 1e15)
    assert not adamw_stays_finite(1.0, 10**6, 1.0, 3.0, 10, (0.9, 0.999))  # lr·wd > 2: decay can grow a weight
    assert not adamw_stays_finite(float("inf"), 10, 1e-3, 0.0, 10, (0.9, 0.999))
    assert not adamw_stays_finite(1.0, 10, 1e-3, 0.0, 10, (0.99, 0.9))


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().view(torch.int32)


class _Recording(type(STARFISH)):
    """STARFISH, observed: ``runs`` gets each heal's _Run, ``after`` the weights and AdamW state after each step."""

    def __init__(self):
        super().__init__()
        self.runs, self.after = [], []

    def _step(self, r, model, *a, **kw):
        out = super()._step(r, model, *a, **kw)
        if not self.runs or self.runs[-1] is not r:
            self.runs.append(r)
        state = [{k: v.clone() for k, v in r.opt.state[r.params[n]].items()} for n in r.names]
        self.after.append(({n: r.params[n].detach().clone() for n in r.names}, state))
        return out


@pytest.mark.timeout(120)
@pytest.mark.parametrize("graph", ["off", "step"])
@pytest.mark.parametrize("kind,scope,settings,restored", [
    ("timm_vit", "qkv_out_mlp", {}, []), ("resnet", "conv", {}, []), ("timm_vit", "qk", {}, []),
    ("timm_vit", "qk", {"qk_train": "qk"}, ["blocks.0.attn.qkv.weight", "blocks.1.attn.qkv.weight"])])
def test_only_tensors_with_nonzero_frozen_entries_are_restored(heal_case, graph, kind, scope, settings, restored):
    """With weight decay on, every entry the loop may not change keeps its bits (signed zeros included), whether
    the restore ran on its tensor (V rows under qk_train='qk') or AdamW left it alone (masked zeros)."""
    case = heal_case(kind, scope)
    healer = _Recording()
    healer.heal(case.ctx, HealConfig(lr=2e-2, epochs=2, batch_size=8, weight_decay=0.1, graph=graph, settings=settings))
    r = healer.runs[0]
    assert [r.names[i] for i in r.restore] == restored
    sd = case.model.state_dict()
    for n in r.names:
        frozen = ~r.keep[n]
        assert frozen.any() and torch.equal(_bits(sd[n])[frozen], _bits(case.before[n])[frozen]), n
        assert not torch.equal(sd[n][r.keep[n]], case.before[n][r.keep[n]]), n  # the rest did heal
    assert any(bool(torch.signbit(case.before[n][~r.keep[n]]).any()) for n in r.names)  # -0.0 among them
    case.assert_invariants(HEALERS.get("starfish").may_change(case.model, case.entries, settings))


@pytest.mark.timeout(120)
def test_fused_adamw_skips_a_bad_step_inside_the_kernel(heal_case):
    """graph: step (fused AdamW on the CPU too): no copy of the weights; a NaN at step 3 leaves the weights and
    AdamW's state (moments, step count) as the undamaged run had them after step 2."""
    cfg = HealConfig(lr=1e-3, epochs=1, batch_size=8, graph="step")
    ref, bad = _Recording(), _Recording()
    ref.heal(heal_case("timm_vit", "qkv_out_mlp").ctx, cfg)
    case = heal_case("timm_vit", "qkv_out_mlp").nan_in_batch(2)
    with pytest.raises(HealingDiverged, match="loss became nan at epoch 1, step 3"):
        bad.heal(case.ctx, cfg)
    r = bad.runs[0]
    assert r.skip is not None and r.before is None and r.opt.found_inf is r.skip
    weights, state = bad.after[-1]
    ref_weights, ref_state = ref.after[1]
    assert all(torch.equal(_bits(weights[n]), _bits(ref_weights[n])) for n in r.names)
    assert all(torch.equal(a[k], b[k]) for a, b in zip(state, ref_state) for k in a)
    assert not all(torch.equal(weights[n], ref.after[2][0][n]) for n in r.names)  # step 3 would have moved them


@pytest.mark.timeout(120)
def test_learning_rate_beyond_the_bound_copies_and_restores(heal_case):
    """A fused AdamW at lr 1e20 may make weights non-finite from finite gradients: the loop keeps the copy, and the
    step that did it is undone (the weights of the pruned model, bit for bit)."""
    case = heal_case("timm_vit", "qkv_out_mlp")
    healer = _Recording()
    with pytest.raises(HealingDiverged, match="weights became non-finite at epoch 1, step 1"):
        healer.heal(case.ctx, HealConfig(lr=1e20, epochs=2, batch_size=8, graph="step"))
    r = healer.runs[0]
    assert r.skip is None and r.before is not None and getattr(r.opt, "found_inf", None) is None
    sd = case.model.state_dict()
    assert all(torch.equal(_bits(sd[k]), _bits(case.before[k])) for k in r.names)


def test_cpu_default_adamw_copies(heal_case):
    """torch's default (for-each) AdamW takes no found_inf: the CPU default keeps the copy and the restore."""
    case = heal_case("resnet", "conv")
    r = loop._prepare(case.ctx, HealConfig(lr=1e-2, epochs=1, batch_size=8), loop.loop_settings({}), 4)
    assert r.skip is None and len(r.before) == len(r.names) and getattr(r.opt, "found_inf", None) is None
