"""The noise a claim is tested against counts search noise (issue 34): contenders that another search could pick
widen a cell's noise, and a paired interval over few seeds is never narrower than the quoted numbers' noise."""
from __future__ import annotations

import math

import pandas as pd
import pytest

from analysis.ordering import claim_check, paired_ci
from analysis.reported import reported

pytestmark = pytest.mark.timeout(60)


def _trials(rival_acc: float) -> pd.DataFrame:
    """One cell: a winner (selection 0.900) and a contender (selection 0.899, within noise) whose evaluation
    accuracy is ``rival_acc``; a far-off third trial; two re-evaluations of the winner (sd 1 pp)."""
    base = {"cell_id": "c1", "model": "vit", "healer": "starfish", "grid": "main", "status": "FINISHED", "steps": 8,
            "epochs": 1, "dense_acc": 1.0, "pruner": "magnitude", "pattern": "0.9", "calib_size": 64, "seed": 0}
    rows = [dict(base, run_id="w", lr=1e-3, selection_acc=0.900, healed_acc=0.80, optuna_trial=0, stage="search"),
            dict(base, run_id="r", lr=3e-3, selection_acc=0.899, healed_acc=rival_acc, optuna_trial=1, stage="search"),
            dict(base, run_id="f", lr=1e-4, selection_acc=0.500, healed_acc=0.40, optuna_trial=2, stage="search"),
            dict(base, run_id="a1", lr=1e-3, selection_acc=0.9, healed_acc=0.79, optuna_trial=0, stage="reevaluate"),
            dict(base, run_id="a2", lr=1e-3, selection_acc=0.9, healed_acc=0.81, optuna_trial=1, stage="reevaluate")]
    return pd.DataFrame(rows)


def test_a_contender_with_another_number_widens_the_noise():
    close, far = reported(_trials(0.80)).iloc[0], reported(_trials(0.70)).iloc[0]
    assert close["rival_sd"] == pytest.approx(0.0, abs=1e-9)
    assert far["rival_sd"] == pytest.approx(0.05, abs=1e-6)  # std of 0.80 and 0.70; the far-off trial is no rival
    assert far["noise"] > 0.05 > close["noise"]


def test_paired_interval_is_at_least_the_noise_of_the_quoted_numbers():
    a = {(0,): 0.80, (1,): 0.81, (2,): 0.82}
    b = {(0,): 0.79, (1,): 0.80, (2,): 0.81}  # d = +1 pp on every seed: sd 0, the t-interval alone is [1, 1] pp
    assert paired_ci(a, b).sign == ">"
    noise = {k: 0.02 for k in a}
    ci = paired_ci(a, b, noise_a=noise, noise_b=noise)
    assert ci.half == pytest.approx(2 * math.sqrt(3 * 2 * 0.02 ** 2) / 3)
    assert ci.sign == "≈"
    words = {(x, y): w for x, y, _, w in claim_check({"starfish": a, "mse": b}, noise={"starfish": noise, "mse": noise})}
    assert words[("starfish", "mse")] == "within noise"


def test_the_selection_splits_own_error_makes_contenders():
    """Seed noise alone (re-evaluations 0.79 / 0.81: threshold 2 sqrt(2) x 1.4 pp = 4 pp) keeps a trial 5 pp below
    on selection out of the contenders; once selection and evaluation accuracy disagree from trial to trial (one
    more trial, 20 pp apart instead of 10), the threshold grows and it is a contender."""
    t = _trials(0.75)
    t.loc[t["run_id"] == "r", "selection_acc"] = 0.85  # selection - evaluation: 0.10 on every trial
    assert reported(t).iloc[0]["rival_sd"] == pytest.approx(0.0)
    extra = t[t["run_id"] == "f"].assign(run_id=["g"], optuna_trial=[3], selection_acc=[0.45], healed_acc=[0.25])
    assert reported(pd.concat([t, extra], ignore_index=True)).iloc[0]["rival_sd"] == pytest.approx(0.025, abs=1e-6)


def test_a_closed_form_cell_carries_the_evaluation_sets_sampling_error():
    row = {"cell_id": "c", "model": "vit", "healer": "crbn", "grid": "main", "status": "FINISHED", "steps": None,
           "epochs": 0, "dense_acc": 1.0, "pruner": "magnitude", "pattern": "0.9", "calib_size": 64, "seed": 0,
           "run_id": "c", "lr": 0.0, "selection_acc": 0.9, "healed_acc": 0.9, "optuna_trial": 0, "stage": "search",
           "n_eval": 360.0}
    (r,) = reported(pd.DataFrame([row])).to_dict("records")
    assert r["noise"] == pytest.approx(math.sqrt(0.9 * 0.1 / 360))  # 1.58 pp: two such cells 1 pp apart: not resolved
