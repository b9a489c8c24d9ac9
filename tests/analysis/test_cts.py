"""analysis.cts against hand-computed toy curves (values worked out in the comments)."""
from __future__ import annotations

import numpy as np
import pytest

from analysis.cts import CTSSettings, band_interval, compute_cts, cts_from_objectives, interp_r, longest_run, smooth3


def test_interp_r_anchor_at_zero_and_clamp():
    r = np.array([[0.5, 0.3]])  # grid 0.7, 0.8
    assert interp_r(r, [0.7, 0.8], np.array([0.75]))[0] == pytest.approx(0.4)
    # below the grid: line from R(0) = 1 to R(0.7) = 0.5 -> 0.75 at 0.35
    assert interp_r(r, [0.7, 0.8], np.array([0.35]))[0] == pytest.approx(0.75)
    assert interp_r(r, [0.7, 0.8], np.array([0.0]))[0] == pytest.approx(1.0)
    assert interp_r(r, [0.7, 0.8], np.array([0.99]))[0] == pytest.approx(0.3)  # clamped
    with pytest.raises(ValueError, match="shapes"):
        interp_r(r, [0.7, 0.8, 0.9], np.array([0.75]))


def test_smooth3_truncated_ends():
    np.testing.assert_allclose(smooth3([0, 3, 6, 0]), [1.5, 3.0, 3.0, 3.0])
    np.testing.assert_allclose(smooth3([2.0]), [2.0])


def test_cts_band_touching_grid_edge():
    s = [0.85, 0.90, 0.95, 0.975]
    # T = clip((jr - 0.3) / 0.4) = [0, 0, .5, 1]; G = je - jr = [0, .1, .3, .1]; CTS = [0, 0, .15, .1]
    # CTS̄ = [0, .05, .083333, .125]; B = max over s <= 0.90 = .05; max = .125
    out = cts_from_objectives(s, [0.2, 0.3, 0.5, 0.7], [0.2, 0.4, 0.8, 0.8], 0.3, 0.7)
    np.testing.assert_allclose(out["T"], [0, 0, 0.5, 1], atol=1e-7)
    np.testing.assert_allclose(out["G"], [0, 0.1, 0.3, 0.1], atol=1e-12)
    np.testing.assert_allclose(out["CTS"], [0, 0, 0.15, 0.1], atol=1e-7)
    np.testing.assert_allclose(out["CTS_smooth"], [0, 0.05, 0.25 / 3, 0.125], atol=1e-7)
    # core threshold .05 + .7 * .075 = .1025 -> only the last point (edge of the grid)
    assert out["core"]["lo"] == out["core"]["hi"] == 0.975
    assert out["core"]["threshold"] == pytest.approx(0.1025, abs=1e-7)
    assert out["core"]["baseline"] == pytest.approx(0.05, abs=1e-7)
    # broad band (alpha .4): threshold .08 -> 0.95 .. 0.975
    assert (out["band"]["lo"], out["band"]["hi"]) == (0.95, 0.975)


def test_ties_and_longest_run():
    s = [0.90, 0.91, 0.92, 0.93, 0.94, 0.95]
    # B = c[0] = 0, max 1, alpha .5 -> threshold .5: runs [1, 2] (peak 1.0) and [4, 5] (peak .9), equal length
    got = band_interval(s, [0, 1.0, 0.8, 0, 0.8, 0.9], 0.5, 0.90)
    assert (got["lo"], got["hi"]) == (0.91, 0.92)
    # equal length and equal peak -> the lower sparsity
    got = band_interval(s, [0, 1.0, 0, 1.0, 0, 0], 0.5, 0.90)
    assert (got["lo"], got["hi"]) == (0.91, 0.91)
    # a longer run beats a higher peak
    got = band_interval(s, [0, 1.0, 0, 0.6, 0.6, 0.6], 0.5, 0.90)
    assert (got["lo"], got["hi"]) == (0.93, 0.95)
    # points exactly at the threshold are inside (B = 0, max 1, alpha .5)
    got = band_interval(s, [0, 0.5, 1.0, 0.5, 0.2, 0], 0.5, 0.90)
    assert (got["lo"], got["hi"]) == (0.91, 0.93)
    assert longest_run([False, False], [0, 0]) is None


def test_flat_curve_has_no_core():
    s = [0.85, 0.90, 0.95, 0.975]
    out = cts_from_objectives(s, [0.3, 0.3, 0.3, 0.3], [0.5, 0.5, 0.5, 0.5], 0.3, 0.3)
    assert out["CTS"] == [0.0] * 4  # T = 0 everywhere
    assert out["core"] is None and out["band"] is None
    assert band_interval(s, [0.2] * 4, 0.7, 0.90) is None  # flat non-zero CTS̄ too


def test_no_low_anchor_points_baseline_zero():
    got = band_interval([0.95, 0.96, 0.97], [0.1, 0.4, 0.2], 0.7, 0.90)
    assert got["baseline"] == 0.0 and (got["lo"], got["hi"]) == (0.96, 0.96)  # thr .28


def test_descending_targets_rejected():
    with pytest.raises(ValueError, match="ascending"):
        cts_from_objectives([0.9, 0.85], [0, 0], [0, 0], 0, 1)


def _toy():
    grid = [0.7, 0.8, 0.9]
    layers = ["a", "b"]
    r = np.array([[0.5, 0.2, 0.6],   # non-monotone in s
                  [0.4, 0.4, 0.4]])
    return r, grid, layers


def test_compute_cts_non_monotone_rr():
    r, grid, layers = _toy()
    st = CTSSettings(s_low=0.8, s_high=0.9, targets=(0.8, 0.85, 0.9))
    alloc_rr = lambda x: {"a": x - 0.1, "b": x + 0.1}  # noqa: E731
    alloc_erk = lambda x: {"a": x, "b": x}  # noqa: E731
    out = compute_cts(r, grid, layers, alloc_rr, alloc_erk, st)
    # J_RR(A^RR): 0.8 -> (R_a(.7)=.5 + R_b(.9)=.4)/2 = .45; 0.85 -> (.35 + .4)/2 = .375; 0.9 -> (.2 + .4)/2 = .3
    # J_RR(A^ERK): 0.8 -> (.2 + .4)/2 = .3; 0.85 -> (.4 + .4)/2 = .4; 0.9 -> (.6 + .4)/2 = .5
    np.testing.assert_allclose(out["J_rr"], [0.45, 0.375, 0.3])
    np.testing.assert_allclose(out["J_erk"], [0.3, 0.4, 0.5])
    assert (out["J_low"], out["J_high"]) == pytest.approx((0.45, 0.3))
    # G = [-.15, .025, .2]; T = clip((jr - .45)/(-.15)) = [0, .5, 1]; CTS = [0, .0125, .2]
    np.testing.assert_allclose(out["CTS"], [0, 0.0125, 0.2], atol=1e-7)
    # CTS̄ = [.00625, .0708333, .10625]; B = .00625; core thr .07625 -> 0.9; band thr .04625 -> .85..0.9
    assert (out["core"]["lo"], out["core"]["hi"]) == (0.9, 0.9)
    assert (out["band"]["lo"], out["band"]["hi"]) == (0.85, 0.9)
    # swapped roles: G < 0 where T > 0 -> CTS̄ never rises above B -> no core
    out2 = compute_cts(r, grid, layers, alloc_erk, alloc_rr, st)
    np.testing.assert_allclose(out2["CTS"], [0, -0.0125, -0.2], atol=1e-7)
    assert out2["core"] is None
