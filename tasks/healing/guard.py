"""Divergence bookkeeping of the gradient loop on the device: no host synchronisation per optimizer step.

Every step computes whether its loss, its gradients and its updated weights are finite as device scalars. The first
step where one is not turns ``bad`` on; from then on every step leaves the weights and BatchNorm buffers as they
were before that step (``keep_or_restore``). ``raise_if_bad`` (once per epoch, where the loop synchronises anyway)
raises ``HealingDiverged`` naming that step: the same weights, buffers and message as a check after every step.
"""
from __future__ import annotations

import math
from typing import Sequence

import torch

from tasks.healing.base import HealingDiverged

REASONS = {1: "loss became {loss}", 2: "non-finite gradient for {param}", 3: "weights became non-finite"}
NORM_SAFE = 1e18  # a weight tensor's L2 norm that stays far below float32's overflow in its norm (~1.8e19)


def adam_ratio_bound(betas: tuple[float, float]) -> float | None:
    """Upper bound of |m̂ / √v̂| per entry for Adam(W) with these betas, any number of steps and any finite gradients
    (None when β1² ≥ β2: no bound of this form). With m_t = Σ_i (1-β1)β1^(t-i) g_i and v_t = Σ_i (1-β2)β2^(t-i) g_i²,
    Cauchy-Schwarz gives |m_t| ≤ √(Σ_k (1-β1)²β1^(2k) / ((1-β2)β2^k)) · √v_t ≤ √((1-β1)² / ((1-β2)(1 - β1²/β2))) · √v_t;
    the bias corrections (1-β1^t) ≥ 1-β1 and (1-β2^t) ≤ 1 add at most a factor 1/(1-β1). Defaults (0.9, 0.999): 72.7."""
    b1, b2 = betas
    if not (0 <= b1 < 1 and 0 < b2 < 1) or b1 * b1 >= b2:
        return None
    return math.sqrt((1 - b1) ** 2 / ((1 - b2) * (1 - b1 * b1 / b2))) / (1 - b1)


def adamw_stays_finite(max_abs: float, numel: int, lr_max: float, weight_decay: float, steps: int,
                       betas: tuple[float, float]) -> bool:
    """Whether ``steps`` AdamW steps from weights with |w| ≤ ``max_abs`` (a tensor of at most ``numel`` entries) and
    a learning rate ≤ ``lr_max`` provably leave every weight tensor's norm under NORM_SAFE whenever each step's
    gradients are finite: a step moves an entry by at most lr·(ratio bound) (eps only shrinks it) after scaling it by
    1 - lr·wd, which does not grow it while lr·wd ≤ 2. Then the guard's reason 3 cannot occur."""
    ratio = adam_ratio_bound(betas)
    if ratio is None or not math.isfinite(max_abs) or lr_max < 0 or weight_decay < 0 or lr_max * weight_decay > 2:
        return False
    return math.sqrt(numel) * (max_abs + steps * lr_max * ratio) < NORM_SAFE


def finite_norms(tensors: Sequence[torch.Tensor], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(() bool: every tensor finite, () int64: index of the first that is not, len when none) from their L2 norms in
    one foreach launch: a NaN or Inf element makes its tensor's norm NaN or Inf. (A finite tensor whose norm overflows
    float32, some |x| > 1e19, counts as not finite too: a healing step with such gradients has diverged anyway.)"""
    if not tensors:
        return torch.ones((), dtype=torch.bool, device=device), torch.zeros((), dtype=torch.int64, device=device)
    ok = torch.isfinite(torch.stack(torch._foreach_norm(list(tensors))))  # (n,) bool
    first = torch.where(ok.all(), torch.full((), len(ok), dtype=torch.int64, device=device),
                        torch.argmin(ok.to(torch.int64)))
    return ok.all(), first


class DivergenceGuard:
    """Device-side record of the first non-finite step: ``bad`` () bool, and its step index (0-based, counted
    from the guard's start), reason code, offending parameter index and loss value."""

    def __init__(self, device: torch.device, first_step: int = 0):
        self.device = device
        self.bad = torch.zeros((), dtype=torch.bool, device=device)
        self._step = torch.full((), first_step, dtype=torch.int64, device=device)
        self._info = torch.zeros(4, dtype=torch.float64, device=device)  # (step, reason, param index, loss)

    def record(self, loss_ok: torch.Tensor, grad_ok: torch.Tensor, bad_grad: torch.Tensor, weights_ok: torch.Tensor,
               loss: torch.Tensor) -> torch.Tensor:
        """Note one step's flags (() bool each; ``bad_grad`` () int64: first parameter with a non-finite gradient).
        -> () bool: this step must be undone (it, or an earlier one, was not finite)."""
        step_bad = ~(loss_ok & grad_ok & weights_ok)
        first = step_bad & ~self.bad
        reason = torch.where(~loss_ok, 1, torch.where(~grad_ok, 2, 3))
        info = torch.stack([self._step.double(), reason.double(), bad_grad.double(), loss.detach().double()])  # (4,)
        self._info.copy_(torch.where(first, info, self._info))  # in place: a captured step (heal.graph) updates
        self.bad |= step_bad  # the same tensors on every replay
        self._step += 1
        return self.bad

    def raise_if_bad(self, healer: str, where, param_names: Sequence[str]) -> None:
        """One host synchronisation: HealingDiverged for the first bad step. ``where(step)`` -> text naming it."""
        info = self._info.tolist() if bool(self.bad) else None
        if info is None:
            return
        step, reason, param, loss = int(info[0]), int(info[1]), int(info[2]), info[3]
        name = param_names[param] if 0 <= param < len(param_names) else "?"
        what = REASONS[reason].format(loss=loss, param=name)
        raise HealingDiverged(f"healer {healer!r}: {what} at {where(step)}")


def keep_or_restore(undo: torch.Tensor, current: Sequence[torch.Tensor], before: Sequence[torch.Tensor]) -> None:
    """In place: each tensor of ``current`` keeps its value, or takes ``before``'s when ``undo`` (() bool) is True."""
    for cur, old in zip(current, before):
        torch.where(undo, old, cur, out=cur)  # in place: one kernel, no temporary
