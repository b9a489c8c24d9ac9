"""analysis.bands on synthetic best-per-cell results with known bands."""
from __future__ import annotations

import math

import pandas as pd
import pytest

from analysis.bands import BandSettings, bands, chance_limit, iou, seed_means

DENSE = 0.9
SPARS = (0.5, 0.7, 0.8, 0.9, 0.95)
# seed means of healed accuracy; seeds are mean ± 0.01
HEALED = {"A": (0.88, 0.85, 0.70, 0.40, 0.12), "B": (0.86, 0.80, 0.13, 0.11, 0.10)}


def _best(n_eval=400.0, with_nm=True) -> pd.DataFrame:
    rows = []
    for healer, accs in HEALED.items():
        for s, acc in zip(SPARS, accs):
            for seed, d in ((0, -0.01), (1, 0.01)):
                rows.append(dict(model="m", pruner="magnitude", healer=healer, calib_size=64, scope="conv",
                                 granularity="example", sparsity=s, pattern=str(s), seed=seed,
                                 healed_acc=acc + d, retention=(acc + d) / DENSE, pruned_acc=0.1,
                                 dense_acc=DENSE, run_id=f"{healer}-{s}-{seed}", experiment_id="1",
                                 n_eval=n_eval, num_classes=10.0))
    if with_nm:  # N:M cells are not on the sparsity axis: ignored
        rows.append({**rows[0], "pattern": "2:4", "sparsity": 0.5, "healed_acc": 0.0, "run_id": "nm"})
    return pd.DataFrame(rows)


def test_chance_limit_binomial():
    # p = .1, n = 400: .1 + 2 * sqrt(.09 / 400) = .13
    assert chance_limit(10, 400, 2.0) == pytest.approx(0.13)
    assert math.isnan(chance_limit(10, float("nan"), 2.0))


def test_seed_means_and_std():
    m = seed_means(_best())
    assert len(m) == 10 and set(m["n_seeds"]) == {2}
    row = m[(m["healer"] == "A") & (m["sparsity"] == 0.7)].iloc[0]
    assert row["healed_mean"] == pytest.approx(0.85)
    assert row["healed_std"] == pytest.approx(math.sqrt(2) * 0.01)  # sample std of ±.01
    assert row["run_ids"] == "A-0.7-0;A-0.7-1"


def test_known_bands_and_agreement():
    cts = {"m": {"core": {"lo": 0.8, "hi": 0.9}, "band": {"lo": 0.85, "hi": 0.95}}}
    out = {b["healer"]: b for b in bands(_best(), cts)}
    a, b = out["A"], out["B"]
    assert [p["label"] for p in a["points"]] == ["recoverable", "recoverable", "transition", "transition",
                                                 "collapse"]
    assert a["intervals"] == [{"label": "recoverable", "lo": 0.5, "hi": 0.7},
                              {"label": "transition", "lo": 0.8, "hi": 0.9},
                              {"label": "collapse", "lo": 0.95, "hi": 0.95}]
    # B: 0.80/0.9 = .889 < .9 -> transition; .13 is exactly at the chance limit -> collapse
    assert [iv["label"] for iv in b["intervals"]] == ["recoverable", "transition", "collapse"]
    assert b["intervals"][2] == {"label": "collapse", "lo": 0.8, "hi": 0.95}
    assert a["transition"] == {"lo": 0.8, "hi": 0.9}
    assert a["agreement"]["core_iou"] == pytest.approx(1.0)
    # band [.8475, .9525] vs hull [.7975, .9025]: inter .055, union .155
    assert a["agreement"]["band_iou"] == pytest.approx(0.055 / 0.155)
    assert a["agreement"]["band_coverage"] == pytest.approx(0.055 / 0.105)
    assert b["agreement"]["core_iou"] == 0.0  # B's transition is the single point 0.7
    assert a["points"][0]["run_ids"] == ["A-0.5-0", "A-0.5-1"]


def test_retention_threshold_setting_and_missing_n_eval():
    out = {b["healer"]: b for b in bands(_best(n_eval=float("nan")), None, BandSettings(retention=0.95))}
    # without n_eval no point can be called collapse; .85/.9 = .944 < .95 now transition
    assert [p["label"] for p in out["A"]["points"]] == ["recoverable"] + ["transition"] * 4
    assert out["A"]["agreement"]["core_iou"] is None  # no CTS: n/a, not 0


def test_iou_padding():
    assert iou((0.9, 0.9), (0.9, 0.9), 0.0025) == pytest.approx(1.0)
    assert iou((0.9, 0.9), (0.905, 0.905), 0.0025) == 0.0
    assert iou(None, (0.9, 0.9), 0.0025) == 0.0
