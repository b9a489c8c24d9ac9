"""analysis/reported.py: the number the report quotes (the re-evaluations' mean, never the winner's own draw), its
noise, resolved differences and the identical-mask check, against hand-computed values."""
from __future__ import annotations

import math

import pandas as pd
import pytest

from analysis.reported import SHRINK, identical_masks, reported, resolved


def _trial(cell, stage, acc, sel, lr=0.005, steps=64, seed=0, heal_seed=None, pruner="magnitude", mask="m1",
           status="FINISHED", run=None, pattern="0.9"):
    return dict(run_id=run or f"{cell}-{stage}-{acc}-{heal_seed}", experiment_id="1", status=status, cell_id=cell,
                trial_id=f"{cell}-x", stage=stage, model="vit_digits", pruner=pruner, pattern=pattern, grid="main",
                healer="starfish", calib_size=64, seed=seed, heal_seed=heal_seed, lr=lr, steps=steps, epochs=32,
                optuna_trial=0, selection_acc=sel, healed_acc=acc, dense_acc=0.95, pruned_acc=0.1, mask_key=mask)


def test_the_quoted_number_is_the_reevaluations_mean_and_the_noise_is_the_documented_formula():
    rows = [_trial("a", "search", 0.90, 0.95), _trial("a", "search", 0.50, 0.60, lr=1e-4),
            _trial("a", "reevaluate", 0.80, 0.85, heal_seed=1000), _trial("a", "reevaluate", 0.84, 0.86, heal_seed=2000),
            _trial("b", "search", 0.70, 0.75), _trial("b", "reevaluate", 0.70, 0.7, heal_seed=1000),
            _trial("b", "reevaluate", 0.66, 0.7, heal_seed=2000),
            _trial("b", "reevaluate", 0.10, 0.1, lr=1e-4, heal_seed=3000)]  # another configuration: not the winner's
    out = reported(pd.DataFrame(rows)).set_index("cell_id")
    a, b = out.loc["a"], out.loc["b"]
    assert a["healed_acc_search"] == 0.90 and a["healed_acc"] == pytest.approx(0.82)  # not 0.90: the winner's curse
    assert a["n_reevaluated"] == 2 and a["healed_acc_sd"] == pytest.approx(math.sqrt(0.0008))
    assert b["healed_acc"] == pytest.approx(0.68) and b["n_reevaluated"] == 2  # the 3000 run repeats no winner
    assert a["retention"] == pytest.approx(0.82 / 0.95) and a["n_trials"] == 2  # re-evaluations are not trials
    # pooled var over the family = (1 * 0.0008 + 1 * 0.0008) / 2; each cell's std shrunk with K = SHRINK
    pooled = 0.0008
    seed_var = (1 * 0.0008 + SHRINK * pooled) / (1 + SHRINK)
    search_sd = statistics_median([abs(0.90 - 0.82), abs(0.70 - 0.68)])
    assert a["seed_sd"] == pytest.approx(math.sqrt(seed_var)) and a["search_sd"] == pytest.approx(search_sd)
    assert a["noise"] == pytest.approx(math.sqrt(seed_var / 2 + search_sd ** 2))


def test_a_cell_with_siblings_claims_at_least_their_spread():
    """Two sparsities x two seeds of one family: the easy siblings (0.85) re-evaluate identically, the hard ones
    (0.9) spread. The family's pooled variance and median gap are floors; the hard cells take their siblings'
    larger figures (the family's median alone under-claimed them: docs/methods.md#reading-the-noise)."""
    rows = []
    for cell, pattern, seed, own, again in [("e0", "0.85", 0, 0.95, (0.95, 0.95)), ("e1", "0.85", 1, 0.95, (0.95, 0.95)),
                                            ("h0", "0.9", 0, 0.80, (0.90, 0.84)), ("h1", "0.9", 1, 0.95, (0.86, 0.88))]:
        rows.append(_trial(cell, "search", own, own, seed=seed, pattern=pattern))
        rows += [_trial(cell, "reevaluate", a, a, seed=seed, pattern=pattern, heal_seed=1000 * (k + 1) + seed)
                 for k, a in enumerate(again)]
    out = reported(pd.DataFrame(rows)).set_index("cell_id")
    family_pooled, hard_pooled = (0 + 0 + 0.0018 + 0.0002) / 4, (0.0018 + 0.0002) / 2
    family_gap, hard_gap = statistics_median([0, 0, 0.07, 0.08]), statistics_median([0.07, 0.08])
    h0_var = (0.0018 + SHRINK * hard_pooled) / (1 + SHRINK)
    assert out.loc["h0", "seed_sd"] == pytest.approx(math.sqrt(h0_var))
    assert out.loc["h0", "search_sd"] == pytest.approx(hard_gap)
    assert out.loc["h0", "noise"] == pytest.approx(math.sqrt(h0_var / 2 + hard_gap ** 2))
    e_var = SHRINK * family_pooled / (1 + SHRINK)  # the easy siblings' own figures (0) are below the family's
    assert out.loc["e0", "seed_sd"] == pytest.approx(math.sqrt(e_var))
    assert out.loc["e0", "noise"] == pytest.approx(math.sqrt(e_var / 2 + family_gap ** 2))


def _siblings(digests, healer_lr=0.005):
    """Two seeds of one question (same pruner, pattern, calibration size), each searched once and re-healed twice
    on its mask; the seed-1 mask heals 6 pp worse."""
    rows = []
    for cell, seed, dig, again in [("s0", 0, digests[0], (0.96, 0.96)), ("s1", 1, digests[1], (0.90, 0.90))]:
        rows.append(dict(_trial(cell, "search", again[0], again[0], seed=seed, lr=healer_lr), mask_digest=dig))
        rows += [dict(_trial(cell, "reevaluate", a, a, seed=seed, lr=healer_lr, heal_seed=1000 * (k + 1) + seed),
                      mask_digest=dig) for k, a in enumerate(again)]
    return reported(pd.DataFrame(rows)).set_index("cell_id")


def test_siblings_spread_is_a_floor_of_the_noise_and_a_seeded_mask_is_named():
    """Re-healing each seed's winner twice gives the same number (noise 0 from the re-evaluations), but the other
    seed quotes 6 pp less. Siblings are draws of what a rerun on other seeds would quote, so each cell's noise is at
    least their quoted numbers' std (ddof 1: 6 pp / sqrt 2) and the two seeds' difference is not resolved, whether
    the mask differs between the seeds (SnapViT: also ``mask_sd``, which the report names) or not (a pruner that
    ignores the seed: the healing seed alone moved it; grid `healers` 2026-12-01: a 17.6 pp move against a claimed
    3.7 pp). A cell without a quoted sibling keeps the model's noise."""
    spread = 0.06 / math.sqrt(2)
    for digests in (("aaaa", "bbbb"), ("aaaa", "aaaa"), (None, None)):  # None: a sweep before the mask_digest param
        out = _siblings(digests)
        assert out["sibling_sd"].tolist() == pytest.approx([spread, spread]), digests
        assert out.loc["s1", "noise"] == pytest.approx(spread), digests
        assert not resolved(0.96, out.loc["s0", "noise"], 0.90, out.loc["s1", "noise"]), digests
        assert out["mask_sd"].notna().all() == (digests == ("aaaa", "bbbb")), digests
    closed = _siblings(("aaaa", "bbbb"), healer_lr=0.0)  # closed form: at least the spread, not the binomial error
    assert closed.loc["s1", "noise"] == pytest.approx(spread)
    alone = reported(pd.DataFrame([dict(_trial("s0", st, 0.96, 0.96, seed=0, lr=0.005,
                                               heal_seed=None if st == "search" else 1000 * k), mask_digest="aaaa")
                                   for k, st in enumerate(("search", "reevaluate", "reevaluate"))])).set_index("cell_id")
    assert alone["sibling_sd"].isna().all() and alone.loc["s0", "noise"] < 0.01


def statistics_median(xs):
    xs = sorted(xs)
    return (xs[(len(xs) - 1) // 2] + xs[len(xs) // 2]) / 2


def test_without_reevaluations_the_winner_is_quoted_and_its_noise_is_unknown():
    out = reported(pd.DataFrame([_trial("a", "search", 0.9, 0.95), _trial("a", "search", 0.5, 0.6, lr=1e-4)]))
    (r,) = out.to_dict("records")
    assert r["healed_acc"] == 0.9 and r["n_reevaluated"] == 0 and math.isnan(r["noise"])


def test_a_sweep_whose_every_trial_failed_quotes_nothing():
    """No finished trial (a model whose trials all failed): an empty table with the noise columns, not a pandas
    error that ended the report (issue 33)."""
    out = reported(pd.DataFrame([_trial("a", "search", float("nan"), float("nan"), status="FAILED"),
                                 _trial("b", "search", float("nan"), float("nan"), status="FAILED")]))
    assert out.empty and {"seed_sd", "search_sd", "noise", "retention", "grid"} <= set(out.columns)


def test_closed_form_cells_have_no_noise():
    (r,) = reported(pd.DataFrame([_trial("c", "search", 0.7, 0.7, lr=0.0, steps=None)])).to_dict("records")
    assert r["noise"] == 0.0 and r["n_reevaluated"] == 0


def test_a_closed_form_cell_on_other_draws_quotes_the_mean_of_every_draw_and_its_standard_error():
    """search.calib_draws re-evaluates a CR+BN cell once on each other draw: nothing was searched, so its own trial
    is one more draw (no winner's curse) and the quoted number is the mean of all three; the noise is that mean's
    standard error with the family's shrinkage, at least the evaluation set's binomial error; no search gap."""
    def crbn(stage, acc, draw=None, n_eval=360.0):
        return {**_trial("c", stage, acc, acc, lr=0.0, steps=None, heal_seed=draw), "healer": "crbn", "epochs": 0,
                "calib_seed": draw, "n_eval": n_eval}
    rows = [crbn("search", 0.70), crbn("reevaluate", 0.60, 1000), crbn("reevaluate", 0.65, 2000)]
    (r,) = reported(pd.DataFrame(rows)).to_dict("records")
    assert r["healed_acc"] == pytest.approx(0.65) and r["healed_acc_search"] == 0.70  # own draw included
    assert r["n_reevaluated"] == 3 and r["n_draws"] == 2 and r["healed_acc_sd"] == pytest.approx(0.05)
    # one cell in its family: pooled = its own variance 0.0025; shrunk (2 * 0.0025 + SHRINK * 0.0025) / (2 + SHRINK)
    assert r["noise"] == pytest.approx(0.05 / math.sqrt(3)) and math.isnan(r["search_sd"])
    assert 0.05 / math.sqrt(3) > math.sqrt(0.65 * 0.35 / 360)  # 2.89 pp > 2.51 pp: the draws' error is the larger
    same = [crbn("search", 0.70), crbn("reevaluate", 0.70, 1000), crbn("reevaluate", 0.70, 2000)]
    (r,) = reported(pd.DataFrame(same)).to_dict("records")  # the draws agree: the binomial error is the floor
    assert r["noise"] == pytest.approx(math.sqrt(0.7 * 0.3 / 360)) and r["n_reevaluated"] == 3
    # both in one frame, the second on an RR mask (a draw moves the mask itself): a closed-form cell's spread is
    # pooled with its family's cells of the same pruner only, so the magnitude cell's agreeing draws do not shrink
    # the RR cell's (pooled over both its variance would be (2 * 0.0025 + 2 * 0.00125) / 4: noise 2.5 pp, not 2.89)
    both = pd.DataFrame(same + [{**r, "cell_id": "rr", "pruner": "rr", "run_id": f"rr{i}"} for i, r in enumerate(rows)])
    out = reported(both).set_index("cell_id")
    assert out.loc["rr", "noise"] == pytest.approx(0.05 / math.sqrt(3))
    assert out.loc["c", "noise"] == pytest.approx(math.sqrt(0.7 * 0.3 / 360))


def test_resolved_needs_the_difference_beyond_two_noise_units():
    assert resolved(0.90, 0.03, 0.80, 0.02)  # 10 pp > 2 * 3.61 pp
    assert not resolved(0.90, 0.04, 0.80, 0.04)  # 10 pp < 2 * 5.66 pp
    assert not resolved(0.90, float("nan"), 0.10, 0.01)  # unknown noise: never resolved


def test_identical_masks_must_agree_within_noise():
    rows = [dict(grid="main", model="resnet_digits", calib_size=64, healer="starfish", seed=0, mask_key="same",
                 pruner=p, pattern="0.9", healed_acc=a, noise=n)
            for p, a, n in (("uniform", 0.97, 0.01), ("magnitude", 0.48, 0.01))]
    rows.append(dict(rows[0], pruner="erk", mask_key="other", healed_acc=0.9))
    (g,) = identical_masks(pd.DataFrame(rows))
    assert {c["pruner"] for c in g["cells"]} == {"uniform", "magnitude"} and not g["agree"]
    assert g["gap"] == pytest.approx(0.49)
    rows[1]["healed_acc"] = 0.965
    (g,) = identical_masks(pd.DataFrame(rows))
    assert g["agree"]
    # the mask's content decides: two pruners' keys always differ (the default sweep's uniform and magnitude masks
    # at 0.9 had one digest and two keys, and the check never fired); a digest seen once is no group
    digests = pd.DataFrame([dict(r, mask_key=f"key-{r['pruner']}", mask_digest=d)
                            for r, d in zip(rows, ("91559190b432932e", "91559190b432932e", "71287704d1d67e3e"))])
    (g,) = identical_masks(digests)
    assert {c["pruner"] for c in g["cells"]} == {"uniform", "magnitude"} and g["same_mask"] == "91559190b432932e"
    assert identical_masks(digests.assign(mask_digest=["a", "b", "c"])) == []


def test_the_quoted_row_is_the_configuration_the_design_reevaluated_not_always_the_best_draw():
    """search.converge's pick (orchestrator/search/pick.py) may re-evaluate the centre of a plateau of ties rather
    than the best draw: the report's winner row (its lr, edges, own draw) is the search trial at the configuration
    healed again, and every one of those re-evaluations counts. A widening round's later re-evaluations (higher
    ``optuna_trial``) name the configuration quoted then."""
    def t(stage, acc, sel, lr, n, **kw):
        return {**_trial("a", stage, acc, sel, lr=lr, **kw), "optuna_trial": n, "run_id": f"{stage}{n}"}
    rows = [t("search", 0.91, 0.95, 1e-2, 0), t("search", 0.92, 0.94, 5e-3, 1), t("search", 0.5, 0.6, 1e-4, 2),
            t("reevaluate", 0.90, 0.9, 5e-3, 0, heal_seed=1), t("reevaluate", 0.88, 0.9, 5e-3, 1, heal_seed=2)]
    (r,) = reported(pd.DataFrame(rows)).to_dict("records")
    assert r["lr"] == 5e-3 and r["healed_acc_search"] == 0.92 and r["n_trials"] == 3
    assert r["n_reevaluated"] == 2 and r["healed_acc"] == pytest.approx(0.89)
    rows += [t("search", 0.93, 0.97, 2e-2, 3), t("reevaluate", 0.8, 0.9, 2e-2, 2, heal_seed=3)]  # a widening round
    (r,) = reported(pd.DataFrame(rows)).to_dict("records")
    assert r["lr"] == 2e-2 and r["n_reevaluated"] == 1 and r["healed_acc"] == pytest.approx(0.8) and r["n_trials"] == 4
    # re-evaluations of the best draw (the fixed designs): the same row as best_per_cell
    from analysis.runs import best_per_cell, quoted_per_cell
    fixed = pd.DataFrame(rows[:3] + [t("reevaluate", 0.9, 0.9, 1e-2, 0, heal_seed=1)])
    assert quoted_per_cell(fixed)["run_id"].tolist() == best_per_cell(fixed)["run_id"].tolist() == ["search0"]


def test_two_settings_of_one_pruner_are_not_siblings():
    """erk with two floors at one sparsity, two seeds each: each setting's seeds are siblings of each other only
    (pruner_settings is a sibling key), so each pair's spread is its own: 0 for the first, 6 pp / sqrt 2 for the
    second."""
    rows = []
    for cell, seed, settings, acc in [("a0", 0, "{'floor': 0.025}", 0.96), ("a1", 1, "{'floor': 0.025}", 0.96),
                                      ("b0", 0, "{'floor': 0.3}", 0.96), ("b1", 1, "{'floor': 0.3}", 0.90)]:
        rows += [dict(_trial(cell, st, acc, acc, seed=seed, pruner="erk", heal_seed=None if st == "search" else k),
                      pruner_settings=settings) for k, st in enumerate(("search", "reevaluate", "reevaluate"))]
    out = reported(pd.DataFrame(rows)).set_index("cell_id")
    assert out.loc[["a0", "a1"], "sibling_sd"].tolist() == [0.0, 0.0]
    assert out.loc[["b0", "b1"], "sibling_sd"].tolist() == pytest.approx([0.06 / math.sqrt(2)] * 2)


def test_the_draws_a_cells_reevaluations_healed_on_are_counted():
    """search.calib_draws: each re-evaluation logs its draw's calib_seed (absent: the sweep's own draw); a cell
    counts the distinct other draws of the re-evaluations that repeat its winner."""
    rows = [_trial("a", "search", 0.90, 0.95), _trial("a", "reevaluate", 0.80, 0.85, heal_seed=1000),
            _trial("a", "reevaluate", 0.84, 0.86, heal_seed=2000), _trial("a", "reevaluate", 0.83, 0.86, heal_seed=3000),
            _trial("b", "search", 0.70, 0.75), _trial("b", "reevaluate", 0.70, 0.7, heal_seed=1000),
            _trial("b", "reevaluate", 0.66, 0.7, heal_seed=2000), _trial("c", "search", 0.5, 0.5)]
    for r, seed in zip(rows[1:4], (1000, 2000, 1000)):  # cell a: 3 re-evaluations cycling through 2 draws
        r["calib_seed"] = seed
    out = reported(pd.DataFrame(rows)).set_index("cell_id")
    assert out.loc["a", "n_draws"] == 2 and out.loc["a", "n_reevaluated"] == 3
    assert out.loc["b", "n_draws"] == 0  # both on the sweep's own draw (no calib_seed logged)
    assert out.loc["c", "n_draws"] == 0  # no re-evaluation
    plain = reported(pd.DataFrame([{k: v for k, v in r.items() if k != "calib_seed"} for r in rows]))
    assert plain.set_index("cell_id")["n_draws"].to_dict() == {"a": 0, "b": 0, "c": 0}  # sweeps before the key


@pytest.mark.timeout(60)
def test_the_quoted_number_names_the_runs_it_averages():
    """The report quoted a re-evaluation mean beside the search winner's run id alone: the runs behind the number
    appeared nowhere, and an export of the winner gave another number (99.72 in the report, 99.44 on the card)."""
    rows = [_trial("a", "search", 0.90, 0.95, run="w"), _trial("a", "reevaluate", 0.80, 0.85, heal_seed=1000, run="r2"),
            _trial("a", "reevaluate", 0.84, 0.86, heal_seed=2000, run="r1"),
            _trial("a", "reevaluate", 0.10, 0.1, lr=1e-4, heal_seed=3000, run="r9"),  # another configuration
            _trial("b", "search", 0.70, 0.75, run="wb")]
    out = reported(pd.DataFrame(rows)).set_index("cell_id")
    assert out.loc["a", "quoted_run_ids"] == "r1;r2" and out.loc["a", "healed_acc"] == pytest.approx(0.82)
    assert out.loc["b", "quoted_run_ids"] == "wb"  # no re-evaluations: the winner's own number
