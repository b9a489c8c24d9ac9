"""analysis/matched.py: patterns that reach one sparsity (unstructured 0.5, N:M 2:4, CORP 0.5-structured) are
compared by their best combos, with hand-computed gaps and noise bands."""
from __future__ import annotations

import math

import pandas as pd
import pytest

from analysis.matched import matched_lines


def _cell(pruner, pattern, sparsity, healer, acc, noise, calib=64, seed=0):
    return dict(pruner=pruner, pattern=pattern, sparsity=sparsity, healer=healer, calib_size=calib, seed=seed,
                mask_key=f"{pruner}{pattern}", healed_acc=acc, noise=noise)


def test_each_pattern_at_one_sparsity_is_told_as_its_best_combo_and_its_gap_to_the_best():
    gb = pd.DataFrame([
        _cell("magnitude", "0.5", 0.5, "starfish", 0.98, 0.005), _cell("magnitude", "0.5", 0.5, "crbn", 0.90, 0.005),
        _cell("nm", "2:4", 0.5, "starfish", 0.95, 0.005), _cell("nm", "2:4", 0.5, "crbn", 0.96, 0.005),
        _cell("corp", "0.5-structured", 0.5, "starfish", 0.975, 0.01),
        _cell("magnitude", "0.9", 0.9, "starfish", 0.90, 0.01),  # one pattern at 0.9: no line
        _cell("magnitude", "0.5", 0.5, "starfish", 0.97, 0.005, calib=256),  # one pattern at calib 256: no line
    ])
    # corp: 2 hypot(0.5, 1.0) pp = 2.24 pp > 0.50 pp; nm's best is crbn (96 %): 2 hypot(0.5, 0.5) = 1.41 pp < 2.00 pp
    assert matched_lines(gb) == [
        "At sparsity 0.5 (calib 64), by pattern: magnitude 0.5 × starfish 98.0 % · corp 0.5-structured × starfish "
        "97.5 % -0.50 pp (not resolved: 2 noise units = ±2.24 pp) · nm 2:4 × crbn 96.0 % -2.00 pp (resolved: 2 noise units = ±1.41 pp)."]
    assert matched_lines(gb[gb["pattern"] != "2:4"].assign(sparsity=lambda d: d["pattern"].map(
        {"0.5": 0.5, "0.9": 0.9, "0.5-structured": 0.75}))) == []  # no two patterns share a sparsity
    assert matched_lines(gb.drop(columns="sparsity")) == []  # an old sweep without the sparsity column


def test_two_seeds_pair_their_gap_on_the_seed():
    gb = pd.DataFrame([_cell("magnitude", "0.5", 0.5, "starfish", a, 0.001, seed=s) for s, a in ((0, 0.98), (1, 0.96))]
                      + [_cell("nm", "2:4", 0.5, "starfish", a, 0.001, seed=s) for s, a in ((0, 0.95), (1, 0.93))])
    (line,) = matched_lines(gb)
    # 3 pp on both seeds: the paired interval has no spread, so it is the band (never narrower); a mean's noise
    # sqrt(2 * 0.1²)/2 pp, the band 2 hypot of both
    assert line.startswith("At sparsity 0.5 (calib 64), by pattern: magnitude 0.5 × starfish 97.0 % · nm 2:4 × "
                           "starfish 94.0 % -3.00 pp [95 % CI -3.20, -2.80], n=2 (resolved: 2 noise units = ±0.20 pp)."), line


def test_one_pruner_twice_at_a_pattern_is_its_best_cell_and_a_gap_against_the_shared_seeds_is_not_resolved():
    """Two erk entries (other settings, one label) at 0.5: the pattern is told by its better cell, not by whichever
    row came first; a pattern ahead on its mean but behind on the seeds both hold is not resolved ahead."""
    gb = pd.DataFrame([_cell("erk", "0.5", 0.5, "starfish", 0.90, 0.005), _cell("erk", "0.5", 0.5, "starfish", 0.97, 0.005),
                       _cell("nm", "2:4", 0.5, "starfish", 0.95, 0.005)])
    assert matched_lines(gb) == ["At sparsity 0.5 (calib 64), by pattern: erk 0.5 × starfish 97.0 % · nm 2:4 × starfish "
                                 "95.0 % -2.00 pp (resolved: 2 noise units = ±1.41 pp)."]
    # magnitude: 99 % (seed 0), 80 % (seed 1); nm: seed 1 only, 85 %. Means 89.5 vs 85.0, but on seed 1 nm leads
    gb = pd.DataFrame([_cell("magnitude", "0.5", 0.5, "starfish", a, 0.005, seed=s) for s, a in ((0, 0.99), (1, 0.80))]
                      + [_cell("nm", "2:4", 0.5, "starfish", 0.85, 0.005, seed=1)])
    assert matched_lines(gb) == ["At sparsity 0.5 (calib 64), by pattern: magnitude 0.5 × starfish 89.5 % · nm 2:4 × "
                                 "starfish 85.0 % +5.00 pp (not resolved: 2 noise units = ±1.22 pp)."]


def test_a_gap_of_zero_is_told_without_a_minus():
    gb = pd.DataFrame([_cell("magnitude", "0.5", 0.5, "starfish", 0.98, 0.005),
                       _cell("nm", "2:4", 0.5, "starfish", 0.98, 0.005)])
    assert matched_lines(gb) == ["At sparsity 0.5 (calib 64), by pattern: magnitude 0.5 × starfish 98.0 % · nm 2:4 × "
                                 "starfish 98.0 % +0.00 pp (not resolved: 2 noise units = ±1.41 pp)."]


def test_a_lead_interval_is_never_narrower_than_its_noise_band():
    """+9 pp on both seeds with a band of ±14.1 pp: the seeds' t-interval alone, [+9.00, +9.00], excluded 0 beside
    "not resolved" (the first screen said so at 0.95 in the default sweep's healers grid)."""
    from analysis.leads import lead, lead_text

    vn = ({"a": {(0,): 0.90, (1,): 0.95}, "b": {(0,): 0.81, (1,): 0.86}}, {"a": 0.05, "b": 0.05})
    d = lead(vn, "a", "b")
    assert d.mean == pytest.approx(0.09) and d.half == pytest.approx(2 * math.hypot(0.05, 0.05)) and not d.ok
    assert lead_text(vn, "a", "b") == (False, "+9.00 pp vs b [95 % CI -5.14, +23.14], n=2 (not resolved: 2 noise "
                                              "units = ±14.14 pp)")
    tight = (vn[0], {"a": 0.01, "b": 0.01})  # band ±2.83 pp: the interval [+6.17, +11.83] excludes 0, resolved
    assert lead_text(tight, "a", "b") == (True, "+9.00 pp vs b [95 % CI +6.17, +11.83], n=2 (resolved: 2 noise "
                                                "units = ±2.83 pp)")
