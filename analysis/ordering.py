"""Healer ordering with its noise: paired 95 % confidence intervals on identical masks.

For two healers A and B of one group (model x pruner x pattern x calibration size), the paired differences
d_k = acc_A(k) - acc_B(k) over the seeds k where both ran on the same mask give a mean and a Student-t
interval mean ± t_{0.975, n-1} · sd(d) / sqrt(n). A > B only when that interval lies above 0, A < B only when
it lies below 0, A ≈ B otherwise ("within noise"); with fewer than two pairs there is no noise estimate ("?").
The measured ordering sorts healers by mean accuracy and writes the verdict between neighbours; the claim
check tests the paper's ordering (cosine ≥ MSE ≥ KL ≥ CE, docs/methods.md#starfish) pair by pair.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping

from scipy import stats

__all__ = ["CLAIM", "PairedCI", "paired_ci", "measured_ordering", "claim_check", "LEGEND"]

# The paper's high-sparsity claim as adjacent pairs (registry names): cosine >= MSE >= KL >= CE.
CLAIM = (("starfish", "mse"), ("mse", "kl"), ("kl", "ce"))
LEGEND = ("healers by mean healed accuracy; between neighbours '>' means the 95 % paired t-interval of their "
          "difference lies above 0, '≈' that it contains 0 (within noise), '?' fewer than two paired seeds (no "
          "noise estimate).")

Values = Mapping[str, Mapping[tuple, float]]  # healer -> {(seed, mask_key): healed accuracy in [0, 1]}


@dataclass(frozen=True)
class PairedCI:
    mean: float  # mean of d = a - b
    half: float | None  # half-width of the 95 % interval; None with n < 2
    n: int

    @property
    def sign(self) -> str:
        if self.half is None:
            return "?"
        if self.mean - self.half > 0:
            return ">"
        if self.mean + self.half < 0:
            return "<"
        return "≈"


def paired_ci(a: Mapping[tuple, float], b: Mapping[tuple, float], level: float = 0.95) -> PairedCI | None:
    """Interval of mean(a - b) over the keys both have; None when they share none."""
    keys = sorted(set(a) & set(b), key=repr)
    d = [a[k] - b[k] for k in keys]  # [n]
    if not d:
        return None
    n = len(d)
    mean = sum(d) / n
    if n < 2:
        return PairedCI(mean, None, n)
    sd = math.sqrt(sum((x - mean) ** 2 for x in d) / (n - 1))
    return PairedCI(mean, float(stats.t.ppf(0.5 + level / 2, n - 1)) * sd / math.sqrt(n), n)


def measured_ordering(values: Values) -> str:
    """'ce > kl ≈ starfish > none': healers by mean accuracy, each neighbour pair's paired verdict between."""
    means = {h: sum(v.values()) / len(v) for h, v in values.items() if v}
    order = sorted(means, key=lambda h: (-means[h], h))
    parts = order[:1]
    for hi, lo in zip(order, order[1:]):
        ci = paired_ci(values[hi], values[lo])
        sign = "?" if ci is None else ("≈" if ci.sign in ("≈", "<") else ci.sign)  # '<' cannot follow the sort
        parts += [sign, lo]                                                        # by mean; kept as '≈'
    return " ".join(parts)


def claim_check(values: Values, claim=CLAIM) -> list[tuple[str, str, PairedCI, str]]:
    """[(a, b, interval of a - b, 'holds' | 'within noise' | 'reversed' | 'no noise estimate')] for every
    claimed pair a ≥ b whose two healers both ran in this group."""
    out = []
    for a, b in claim:
        if a not in values or b not in values:
            continue
        ci = paired_ci(values[a], values[b])
        if ci is None:
            continue
        word = {">": "holds", "≈": "within noise", "<": "reversed", "?": "no noise estimate"}[ci.sign]
        out.append((a, b, ci, word))
    return out
