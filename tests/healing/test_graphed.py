"""heal.graph (tasks/healing/graphed.py): the whole step as one CUDA graph. What runs the same on the CPU is tested here
(tests/gpu/test_graph_step.py captures it on a GPU): the capturable AdamW whose learning rate is a float32 tensor
written by the host's cosine schedule, heals with every invariant of ``off`` to float rounding, resumes from its own
checkpoint bit for bit, names a diverged step as ``off`` does, and the setting is checked and logged."""
import copy

import pytest
import torch

from tasks.healing import HEALERS, HealConfig, HealingDiverged
from tasks.healing.graphed import GRAPH_MODES, StepGraphs, capturable_adamw, check_graph, rebind_lr
from tasks.pruning import mask_violations

STARFISH = HEALERS.get("starfish")


def _cfg(graph: str, **kw) -> HealConfig:
    return HealConfig(**{"lr": 1e-2, "epochs": 2, "batch_size": 8, "graph": graph, **kw})


def _cosine(t_max: int, eta_min: float):
    return lambda o: torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=t_max, eta_min=eta_min)


def test_device_lr_follows_the_eager_schedule_in_float32():
    """Step by step, the lr the capturable optimizer reads equals float32 of the lr ``off``'s schedule gives, and the
    host schedule's own value is that schedule's float64 number exactly."""
    w = torch.nn.Parameter(torch.zeros(3))
    ref = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(3))], lr=3e-3)
    ref_sched = _cosine(7, 1e-6)(ref)
    ref.step()  # no gradient: changes nothing (the schedule wants an optimizer step before its own)
    opt, sched = capturable_adamw([w], 3e-3, 0.0, torch.device("cpu"), _cosine(7, 1e-6))
    assert opt.param_groups[0]["lr"] is sched.lr and sched.lr.dtype == torch.float32
    seen = []
    for _ in range(9):  # past T_max: the cosine turns back up, as torch's recursion does
        assert sched.host.param_groups[0]["lr"] == ref.param_groups[0]["lr"]
        assert sched.lr.item() == torch.tensor(ref.param_groups[0]["lr"], dtype=torch.float32).item()
        seen.append(sched.lr.item())
        ref_sched.step()
        sched.step()
    assert seen[0] == pytest.approx(3e-3) and min(seen) == pytest.approx(1e-6, rel=1e-5)
    # a resumed schedule writes its state's lr into the tensor, and a loaded optimizer reads that tensor again
    other_opt, other = capturable_adamw([torch.nn.Parameter(torch.zeros(3))], 3e-3, 0.0, torch.device("cpu"),
                                        _cosine(7, 1e-6))
    other_opt.load_state_dict(opt.state_dict() | {"param_groups": [{**opt.state_dict()["param_groups"][0],
                                                                     "lr": 0.5}]})
    other.load_state_dict(sched.state_dict())
    rebind_lr(other_opt, other)
    assert other_opt.param_groups[0]["lr"] is other.lr and other.lr.item() == sched.lr.item()


@pytest.mark.timeout(180)
@pytest.mark.parametrize("kind,scope,bn", [("timm_vit", "qkv_out_mlp", "train"), ("resnet", "conv", "train")])
def test_graph_step_heals_like_off_and_keeps_invariants(heal_case, kind, scope, bn):
    a, b = heal_case(kind, scope, sparsity=0.8, n=36), heal_case(kind, scope, sparsity=0.8, n=36)  # last batch of 4
    ra = STARFISH.heal(a.ctx, _cfg("off", settings={"bn": bn}))
    rb = STARFISH.heal(b.ctx, _cfg("step", settings={"bn": bn}))
    assert rb.steps == ra.steps == 10
    assert rb.epoch_losses[-1] < rb.epoch_losses[0]  # it heals
    assert rb.epoch_losses == pytest.approx(ra.epoch_losses, rel=1e-4)
    assert mask_violations(b.model, b.masks) == 0
    b.assert_invariants(allowed=STARFISH.may_change(b.model, b.entries, {"bn": bn}))
    sa, sb = a.model.state_dict(), b.model.state_dict()
    for k in sa:  # weights and BN running statistics: off's, to the float32 rounding of the lr
        if sa[k].is_floating_point():
            assert torch.allclose(sa[k], sb[k], rtol=1e-3, atol=1e-5), k
        else:
            assert torch.equal(sa[k], sb[k]), k
    assert all(not p.requires_grad and p.grad is None for p in b.model.parameters())


@pytest.mark.timeout(180)
def test_graph_step_resumes_from_its_checkpoint_bit_for_bit(heal_case):
    full, part = heal_case("timm_vit", "qkv_out_mlp"), heal_case("timm_vit", "qkv_out_mlp")
    states, weights = {}, {}
    full.ctx.checkpoint = lambda epoch, s: states.__setitem__(epoch, copy.deepcopy(s))
    on_epoch = lambda e, m: weights.__setitem__(e, copy.deepcopy(full.model.state_dict()))  # noqa: E731
    rf = STARFISH.heal(full.ctx, _cfg("step", epochs=3), on_epoch)
    part.model.load_state_dict(weights[1])  # as a trial restores the epoch's weights before resuming
    part.ctx.resume = states[1]
    rp = STARFISH.heal(part.ctx, _cfg("step", epochs=3))
    assert rp.epoch_losses == rf.epoch_losses and rp.steps == rf.steps
    sf, sp = full.model.state_dict(), part.model.state_dict()
    assert all(torch.equal(sf[k], sp[k]) for k in sf)


@pytest.mark.timeout(120)
def test_graph_step_names_the_diverged_step_as_off_does(heal_case):
    messages = []
    for graph in ("off", "step"):
        case = heal_case("timm_vit", "qkv_out_mlp").nan_in_batch(2)
        with pytest.raises(HealingDiverged) as e:
            STARFISH.heal(case.ctx, _cfg(graph, lr=1e-3, epochs=1))
        messages.append(str(e.value))
        assert mask_violations(case.model, case.masks) == 0
        assert all(torch.isfinite(p).all() for p in case.model.parameters())
    assert messages[0] == messages[1] and "loss became nan at epoch 1, step 3" in messages[0]


@pytest.mark.timeout(120)
def test_the_loop_closes_its_step_graphs_also_when_the_heal_diverges(heal_case, step_graphs):
    """A reused trial actor heals again in the same process: each heal's StepGraphs is closed (graphs dropped, memory
    handed back on CUDA) when the heal ends, whether it ended or raised."""
    STARFISH.heal(heal_case("timm_vit", "qkv_out_mlp").ctx, _cfg("step", epochs=1))
    with pytest.raises(HealingDiverged):
        STARFISH.heal(heal_case("timm_vit", "qkv_out_mlp").nan_in_batch(1).ctx, _cfg("step", epochs=1))
    STARFISH.heal(heal_case("timm_vit", "qkv_out_mlp").ctx, _cfg("off", epochs=1))  # off makes none
    assert len(step_graphs) == 2 and all(g.closed and g.graphs == {} for g in step_graphs)


def test_step_graphs_without_cuda_run_the_body_on_the_batch():
    calls = []
    graphs = StepGraphs(torch.device("cpu"))
    assert not graphs.capture
    x, t = torch.ones(2, 3), {"b": torch.zeros(2, 4)}
    out = graphs(lambda xb, tb: calls.append((xb, tb)) or xb.sum() + tb["b"].sum(), x, t)
    assert out.item() == 6.0 and calls[0][0] is x and calls[0][1]["b"] is t["b"]  # no static copies on the CPU
    assert graphs.graphs == {} and graphs.failed == {}


def test_graph_names_checked(heal_case):
    assert check_graph("off") == "off" and GRAPH_MODES == ("off", "step")
    with pytest.raises(ValueError, match="graph must be one of off, step"):
        check_graph("whole")
    case = heal_case("timm_vit", "qkv_out_mlp")
    with pytest.raises(ValueError, match="graph must be one of off, step, got 'cuda'"):
        STARFISH.heal(case.ctx, _cfg("cuda"))  # checked before the model is touched
    case.assert_invariants()
    sd = case.model.state_dict()
    assert all(torch.equal(sd[k], case.before[k]) for k in sd)
