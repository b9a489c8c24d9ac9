"""A steps budget (HealConfig.steps, ``search.steps``; docs/methods.md#search): the loop runs exactly that many
optimizer steps whatever the calibration size, stopping mid-epoch, with the cosine schedule over exactly them."""
import math

import pytest
from torch.optim.optimizer import register_optimizer_step_pre_hook

from tasks.healing import HEALERS, HealConfig
from tasks.healing.loop import schedule_steps

STARFISH = HEALERS.get("starfish")


@pytest.mark.parametrize("n", [16, 40])  # 2 and 5 steps per epoch at batch 8
def test_steps_budget_runs_exactly_s_optimizer_steps_on_the_cosine_schedule(heal_case, n):
    case = heal_case("resnet", "conv", n=n, batch=8)
    S, lr, lr_min = 7, 1e-3, 1e-5
    epochs = math.ceil(S / math.ceil(n / 8))  # what the searcher resolves: 4 epochs of 2 steps, or 2 of 5
    used: list[float] = []  # the lr every real optimizer step used (counted by a global step hook)
    handle = register_optimizer_step_pre_hook(
        lambda opt, args, kwargs: used.append(opt.param_groups[0]["lr"]))
    reported = []
    try:
        res = STARFISH.heal(case.ctx, HealConfig(lr=lr, epochs=epochs, batch_size=8, lr_min=lr_min, steps=S,
                                                 settings={"bn": "frozen"}),
                            lambda e, m: reported.append(e))
    finally:
        handle.remove()
    assert len(used) == S and res.steps == S
    assert reported == list(range(1, epochs + 1))  # the last epoch ends early, and is still reported
    expect = [lr_min + (lr - lr_min) * (1 + math.cos(math.pi * k / S)) / 2 for k in range(S)]
    assert used == pytest.approx(expect, rel=1e-6)  # T_max = S: the schedule is over exactly S steps
    case.assert_invariants(allowed=set())


def test_without_steps_the_loop_runs_whole_epochs(heal_case):
    case = heal_case("resnet", "conv", n=16, batch=8)
    res = STARFISH.heal(case.ctx, HealConfig(lr=1e-3, epochs=3, batch_size=8, settings={"bn": "frozen"}))
    assert res.steps == 6


def test_schedule_steps_refuses_a_budget_the_epochs_cannot_hold():
    assert schedule_steps(HealConfig(epochs=3, steps=5), 2) == 5
    assert schedule_steps(HealConfig(epochs=3), 2) == 6
    with pytest.raises(ValueError, match="steps=7 need 4 epochs"):
        schedule_steps(HealConfig(epochs=3, steps=7), 2)
