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
          "difference (at least 2 noise units of the quoted numbers wide: search + seed noise) lies above 0,"
          " '≈' that it contains 0 (within noise), '?' fewer than two paired seeds (no "
          "noise estimate).")

Values = Mapping[str, Mapping[tuple, float]]  # healer -> {(seed, mask_key): healed accuracy in [0, 1]}
NOISE_Z = 2.0  # == analysis.reported.Z: noise units a difference must exceed


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


def paired_ci(a: Mapping[tuple, float], b: Mapping[tuple, float], level: float = 0.95,
              noise_a: Mapping[tuple, float] | None = None, noise_b: Mapping[tuple, float] | None = None
              ) -> PairedCI | None:
    """Interval of mean(a - b) over the keys both have; None when they share none. With ``noise_a``/``noise_b``
    (each quoted number's search + seed noise, analysis/reported.py) the half-width is at least Z noise units of
    the mean difference, sqrt(sum_k noise_a,k^2 + noise_b,k^2) / n: with few seeds the spread of the
    differences alone can be small by chance, and a rerun's search may land elsewhere."""
    keys = sorted(set(a) & set(b), key=repr)
    d = [a[k] - b[k] for k in keys]  # [n]
    if not d:
        return None
    n = len(d)
    mean = sum(d) / n
    floor = None
    if noise_a is not None and noise_b is not None:
        nz = [(noise_a.get(k, math.nan) or 0.0) ** 2 + (noise_b.get(k, math.nan) or 0.0) ** 2 for k in keys]
        floor = NOISE_Z * math.sqrt(sum(nz)) / n if all(math.isfinite(x) for x in nz) else None
    if n < 2:
        return PairedCI(mean, floor, n)
    sd = math.sqrt(sum((x - mean) ** 2 for x in d) / (n - 1))
    half = float(stats.t.ppf(0.5 + level / 2, n - 1)) * sd / math.sqrt(n)
    return PairedCI(mean, half if floor is None else max(half, floor), n)


def measured_ordering(values: Values, noise: Values | None = None) -> str:
    """'ce > kl ≈ starfish > none': healers by mean accuracy, each neighbour pair's paired verdict between
    (``noise``: healer -> {key: noise of the quoted number}, the floor of ``paired_ci``)."""
    means = {h: sum(v.values()) / len(v) for h, v in values.items() if v}
    order = sorted(means, key=lambda h: (-means[h], h))
    parts = order[:1]
    for hi, lo in zip(order, order[1:]):
        ci = paired_ci(values[hi], values[lo], noise_a=(noise or {}).get(hi), noise_b=(noise or {}).get(lo))
        sign = "?" if ci is None else ("≈" if ci.sign in ("≈", "<") else ci.sign)  # '<' cannot follow the sort
        parts += [sign, lo]                                                        # by mean; kept as '≈'
    return " ".join(parts)


def claim_check(values: Values, claim=CLAIM, noise: Values | None = None) -> list[tuple[str, str, PairedCI, str]]:
    """[(a, b, interval of a - b, 'holds' | 'within noise' | 'reversed' | 'no noise estimate')] for every
    claimed pair a ≥ b whose two healers both ran in this group."""
    out = []
    for a, b in claim:
        if a not in values or b not in values:
            continue
        ci = paired_ci(values[a], values[b], noise_a=(noise or {}).get(a), noise_b=(noise or {}).get(b))
        if ci is None:
            continue
        word = {">": "holds", "≈": "within noise", "<": "reversed", "?": "no noise estimate"}[ci.sign]
        out.append((a, b, ci, word))
    return out
