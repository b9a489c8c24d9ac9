"""analysis/findings.py: boundary flags, ranges with the grid step, best method with paired intervals, single-seed
points without a spread, closed-form rows; all against hand-computed values."""
from __future__ import annotations

import pandas as pd
import pytest

from analysis.findings import best_rows, boundary, fmt_range, headline, ranges
from analysis.report import model_table
from analysis.search_space import search_bounds

BOUNDS = {"lr": [1e-4, 3e-3], "epochs": [1, 8]}


def test_boundary_flags_lr_cap_floor_and_epoch_cap():
    # log position of 2.5e-3 in [1e-4, 3e-3]: ln(25)/ln(30) = 0.946 >= 0.9 -> on the cap
    assert boundary({"lr": 2.5e-3, "epochs": 4}, BOUNDS) == "lr 0.0025 at the 0.003 cap"
    assert boundary({"lr": 1.2e-4, "epochs": 8}, BOUNDS) == "lr 0.00012 at the 0.0001 floor; 8 of 8 epochs"
    assert boundary({"lr": 1e-3, "epochs": 8}, BOUNDS) == "8 of 8 epochs"
    assert boundary({"lr": 1e-3, "epochs": 5}, BOUNDS) == ""  # 0.68 of the log range, inside
    assert boundary({"lr": 0.0, "epochs": 0}, BOUNDS) == ""  # closed form (CR+BN): no search
    assert boundary({"lr": 3e-3, "epochs": 4}, {"lr": [3e-3, 3e-3], "epochs": [4, 4]}) == ""  # fixed: not searched


def test_search_bounds_per_grid_from_the_sweep_spec():
    spec = {"search": {"lr": [1e-4, 3e-3], "epochs": [1, 8], "trials_per_cell": 4},
            "grids": [{"name": "healers", "search": {"lr": [1e-3, 1.5e-2], "epochs": [3, 8]}}, {"name": "plain"}]}
    assert search_bounds(spec) == {"main": BOUNDS, "healers": {"lr": [1e-3, 1.5e-2], "epochs": [3, 8]},
                                   "plain": BOUNDS}


def _rec(labels, xs, n=2, std=0.01):
    return {"pruner": "magnitude", "healer": "starfish", "calib_size": "64",
            "points": [{"sparsity": x, "label": lab, "n_seeds": n, "healed_std": std} for x, lab in zip(xs, labels)]}


def test_ranges_name_the_edges_and_the_grid_step():
    rec = _rec(["recoverable", "recoverable", "transition", "transition", "collapse"], [0.5, 0.7, 0.8, 0.9, 0.95])
    (r,) = ranges([rec], {"band": {"lo": 0.85, "hi": 0.925}})
    assert (r.recoverable, r.transition, r.collapse) == ("up to 70 %", "80–90 %", "from 95 %")
    assert r.resolution == "grid step 5–20 pp" and r.seeds == "n=2, max std 1.0 pp" and r.cts == "85–92.5 %"
    (r,) = ranges([_rec(["transition", "transition"], [0.8, 0.9], n=1, std=0.0)], None)
    assert (r.recoverable, r.collapse, r.seeds, r.cts) == ("none in grid", "none in grid", "n=1 (no spread)",
                                                          "n/a (no CTS)")
    assert fmt_range(0.9, 0.95, 0.85, None) == "≥ 90 %"


def test_a_row_whose_classes_step_back_lists_its_sparsities():
    """collapse at 50 %, transition at 70 %, collapse at 90 % (a random-init model's noise): the hulls read
    'collapse from 50 %' beside 'transition 70 %'; such a row lists each class's sparsities and says why."""
    (r,) = ranges([_rec(["collapse", "transition", "collapse"], [0.5, 0.7, 0.9], n=1, std=0.0)], None)
    assert (r.recoverable, r.transition, r.collapse) == ("none in grid", "70 %", "50 %, 90 %")
    assert r.resolution == "grid step 20 pp; not monotone in sparsity"
    (r,) = ranges([_rec(["recoverable", "transition", "collapse"], [0.5, 0.7, 0.9])], None)  # monotone: hulls
    assert (r.recoverable, r.transition, r.collapse) == ("50 % (lowest tested)", "70 %", "from 90 %")


def test_a_dense_model_at_chance_is_warned_about_first():
    """10 classes, 16 evaluation images: chance limit 0.1 + 2 sqrt(0.09 / 16) = 0.25; a dense model at 12.5 % is
    within it (every point 'collapse'), one at 30 % is not."""
    from analysis.findings import _warnings, dense_at_chance

    mb = pd.DataFrame(dict(dense_acc=[0.125, 0.125], num_classes=[10, 10], n_eval=[16, 16], lr=[1e-3, 1e-3],
                           calib_size=[64, 64], batch_size=[32, 32], pruner="magnitude", healer="starfish",
                           pattern=["0.5", "0.9"], seed=[0, 1], search_boundary=""))
    assert dense_at_chance(mb).startswith("Dense model at chance: 12.5 % on 16 evaluation images is within 2 "
                                          "binomial standard errors of chance for 10 classes (25.0 %)")
    assert _warnings(mb, [])[0] == dense_at_chance(mb)
    assert dense_at_chance(mb.assign(dense_acc=0.30)) == "" and dense_at_chance(mb.drop(columns="n_eval")) == ""


def test_healing_that_lowers_accuracy_beyond_noise_is_warned_about():
    """Pruned 95.0 % healed to 14.7 % (noise 1.9 pp: a drop of 80.3 > 2 x 1.9) and 98.9 -> 97.6 % (noise 0.59: 1.3 >
    1.18) are named, worst first; 98.9 -> 97.6 % with noise 0.7 (1.3 < 1.4), a rise, the unhealed baseline and a
    cell of unknown noise are not."""
    from analysis.findings import _warnings, healing_lowered

    mb = pd.DataFrame(dict(
        pruner=["magnitude", "snapvit", "magnitude", "magnitude", "magnitude", "snapvit"],
        healer=["starfish", "crbn", "mse", "crbn", "none", "starfish"],
        pattern=["0.3", "0.5", "0.3", "0.5", "0.5", "0.7"], calib_size=128, seed=[7, 7, 7, 7, 7, 8],
        pruned_acc=[0.989, 0.950, 0.989, 0.90, 0.90, 0.90], healed_acc=[0.976, 0.147, 0.976, 0.95, 0.80, 0.10],
        noise=[0.0059, 0.019, 0.007, 0.01, 0.0, float("nan")], lr=0.0, batch_size=32, search_boundary=""))
    w = healing_lowered(mb)
    assert w == ("Healing lowered accuracy in 2 of 4 cells, by more than 2 noise units below the pruned model before "
                 "healing: snapvit/crbn 0.5 n=128 seed 7 (95.0 → 14.7 %), magnitude/starfish 0.3 n=128 seed 7 "
                 "(98.9 → 97.6 %).")
    assert w in _warnings(mb, [])
    assert healing_lowered(mb.assign(healed_acc=mb["pruned_acc"])) == "" and healing_lowered(mb.drop(columns="noise")) == ""
    assert healing_lowered(mb.assign(noise=0.0)) == ""  # zero noise: no evaluation-set size logged, nothing claimed


def test_the_single_seed_warning_says_whether_leads_were_tested_against_noise():
    """One seed per point: with re-evaluations (measured noise) the leads are tested against that noise, and the
    warning said "differences are not tested" beside "9 of 14 best-method leads resolved"."""
    from analysis.findings import _warnings

    mb = pd.DataFrame(dict(pruner="magnitude", healer=["starfish", "crbn"], pattern="0.5", calib_size=64, seed=0,
                           lr=1e-3, batch_size=32, search_boundary="", pruned_acc=0.5, healed_acc=[0.9, 0.8],
                           noise=[0.01, 0.02]))
    measured = [w for w in _warnings(mb, []) if w.startswith("Single seed")]
    assert measured == ["Single seed: no point has a spread or a confidence interval; differences are tested "
                        "against the measured noise only (search + re-healing), not across seeds."]
    unmeasured = [w for w in _warnings(mb.assign(noise=float("nan")), []) if w.startswith("Single seed")]
    assert unmeasured == ["Single seed: no point has a spread or a confidence interval; differences are not tested."]
    two = pd.concat([mb, mb.assign(seed=1)], ignore_index=True)  # each point on two seeds: no such warning
    assert not [w for w in _warnings(two, []) if w.startswith("Single seed")]


def test_best_rows_paired_interval_and_single_seed():
    rows = []
    for healer, accs in (("starfish", (0.80, 0.70, 0.75)), ("mse", (0.78, 0.69, 0.70))):
        for seed, a in enumerate(accs):
            rows.append(dict(pruner="magnitude", healer=healer, pattern="0.9", calib_size=64, seed=seed,
                             mask_key=f"m{seed}", healed_acc=a))
    rows.append(dict(pruner="magnitude", healer="starfish", pattern="0.5", calib_size=64, seed=0, mask_key="x",
                     healed_acc=0.9))
    rows.append(dict(pruner="magnitude", healer="mse", pattern="0.5", calib_size=64, seed=0, mask_key="x",
                     healed_acc=0.8))
    out = {r["pattern"]: r for r in best_rows(pd.DataFrame(rows))}
    # d = .02 .01 .05: mean 2.67 pp, sd 2.0817, t(.975, 2) = 4.3027 -> half 5.17 pp
    assert out["0.9"]["best"] == "magnitude × starfish" and out["0.9"]["healed"] == pytest.approx(0.75)
    assert out["0.9"]["vs_healer"] == ("+2.67 pp vs mse [95 % CI -2.50, +7.84], n=3 "
                                       "(not resolved: noise not measured)")
    assert out["0.5"]["vs_healer"] == "+10.00 pp vs mse (not resolved: noise not measured)"
    assert out["0.5"]["vs_pruner"] == "(the only one)"
    assert not out["0.5"]["resolved"] and not out["0.9"]["resolved"]


def test_a_lead_is_resolved_only_beyond_the_measured_noise():
    """Single seed, re-evaluated cells: a 10 pp lead with noise 3 and 2 pp per cell: 2 * hypot(3, 2) = 7.21 pp
    < 10 pp: resolved; the same lead with noise 4 and 4 pp: 2 * 5.66 = 11.31 pp > 10 pp: not resolved."""
    def rows(na, nb):
        return pd.DataFrame([dict(pruner="magnitude", healer=h, pattern="0.9", calib_size=64, seed=0, mask_key="x",
                                  healed_acc=a, noise=n) for h, a, n in (("starfish", 0.9, na), ("mse", 0.8, nb))])
    (r,) = best_rows(rows(0.03, 0.02))
    assert r["vs_healer"] == "+10.00 pp vs mse (resolved: 2 noise units = ±7.21 pp)" and r["resolved"]
    (r,) = best_rows(rows(0.04, 0.04))
    assert r["vs_healer"] == "+10.00 pp vs mse (not resolved: 2 noise units = ±11.31 pp)" and not r["resolved"]
    assert r["tied"] == ["magnitude × mse"]
    assert headline([r]) == "0.9: magnitude × starfish 90.0 % (≈ magnitude × mse: lead not resolved)"


def test_leads_are_counted_only_where_a_cell_has_a_second_method():
    """The noise line counts resolved leads over the sparsity × calib rows that have a runner-up: a row with one
    pruner × healer has no lead (it used to count as resolved: '2 of 2' for a one-method sweep)."""
    from analysis.findings import noise_line

    one = pd.DataFrame([dict(pruner="magnitude", healer="starfish", pattern=p, calib_size=64, seed=0, mask_key=p,
                             healed_acc=0.9, lr=1e-3) for p in ("0.5", "0.9")])
    rows = best_rows(one)
    assert [r["contested"] for r in rows] == [False, False]
    assert noise_line(one, rows).endswith("; no best-method lead to resolve (one pruner × healer per cell).")
    two = pd.concat([one, pd.DataFrame([dict(pruner="magnitude", healer="mse", pattern="0.9", calib_size=64, seed=0,
                                             mask_key="0.9", healed_acc=0.5, lr=1e-3, noise=0.01)])])
    two["noise"], two["n_reevaluated"] = 0.01, 2  # 40 pp lead >> 2 * hypot(1, 1) pp: resolved
    rows = best_rows(two)
    assert [r["contested"] for r in rows] == [False, True] and rows[1]["resolved"]
    assert noise_line(two, rows).endswith("; 1 of 1 best-method leads resolved.")
    # measured noise is one calibration draw's (a retest with calib_seed + 1 moved cells beyond it): said so
    assert "±1.00 pp, on this one draw of the calibration images (another draw can move" in noise_line(two, rows)
    assert "draw" not in noise_line(one, best_rows(one))  # no noise measured: nothing to qualify
    # search.calib_draws: the re-evaluations healed on other draws, so the noise holds the draw's spread: said so
    two["n_draws"] = 2
    line = noise_line(two, rows)
    assert ("mean of 2 re-evaluations of each searched cell's winner, healed on 2 other draws of the calibration "
            "images (search.calib_draws); noise median ±1.00 pp, max ±1.00 pp, the draw's spread included; ") in line
    assert "one draw" not in line
    two["n_draws"] = 1  # calib_draws 1: both re-evaluations on one other draw
    assert "winner, healed on 1 other draw of the calibration images (search.calib_draws);" in noise_line(two, rows)
    two["n_draws"] = 0  # every re-evaluation on the sweep's own draw
    assert "on this one draw of the calibration images" in noise_line(two, rows)
    # a closed-form cell (lr 0) that reads calibration images (CR+BN) run once, on the sweep's draw (a sweep before
    # the draws reached closed-form cells): the line says its noise is not the draw's
    closed = pd.concat([two.assign(n_draws=2), two.iloc[:1].assign(healer="crbn", lr=0.0, n_reevaluated=0, n_draws=0)])
    assert "the draw's spread included (not in 1 closed-form cell: healed once, on the sweep's draw);" in \
        noise_line(closed, best_rows(closed))
    # healed on each other draw too: their mean is quoted, and said so
    drawn = pd.concat([two.assign(n_draws=2), two.iloc[:1].assign(healer="crbn", lr=0.0, n_reevaluated=3, n_draws=2)])
    assert "the draw's spread included (closed-form cells: the mean over the sweep's draw and the others);" in \
        noise_line(drawn, best_rows(drawn))
    # `none` on a magnitude mask reads no calibration image: one number on every draw, nothing to qualify; on an RR
    # mask (it reads them) it is qualified like CR+BN
    inert = pd.concat([two.assign(n_draws=2), two.iloc[:1].assign(healer="none", lr=0.0, n_reevaluated=0, n_draws=0)])
    assert "the draw's spread included; " in noise_line(inert, best_rows(inert))
    rr = inert.assign(pruner=["magnitude"] * (len(inert) - 1) + ["rr"])
    assert "(not in 1 closed-form cell: healed once, on the sweep's draw)" in noise_line(rr, best_rows(rr))
    # a grid of closed-form cells only, healed on the draws: their mean and noise are what is quoted (it said "no
    # re-evaluation: noise not measured" while the leads were resolved with that noise)
    only = two.assign(healer=["crbn", "corp", "crbn"][:len(two)], lr=0.0, n_reevaluated=3, n_draws=2, noise=0.02)
    assert noise_line(only, best_rows(only)).startswith(
        "Quoted numbers are the mean of each closed-form cell over the sweep's draw of the calibration images and 2 "
        "others (search.calib_draws); noise median ±2.00 pp, max ±2.00 pp, the draw's spread included; ")


def test_the_noise_line_says_where_the_mask_depends_on_the_seed():
    """Cells whose siblings' masks differ (reported.py mask_sd): the line names their pruners and the largest
    spread; without such cells it says nothing more."""
    from analysis.findings import noise_line

    gb = pd.DataFrame([dict(pruner=pr, healer="mse", pattern="0.7", calib_size=128, seed=s, mask_key=f"{pr}{s}",
                            healed_acc=a, lr=1e-3, noise=0.01, n_reevaluated=2, mask_sd=sd)
                       for pr, s, a, sd in [("snapvit", 0, 0.96, 0.0424), ("snapvit", 1, 0.90, 0.0424),
                                            ("magnitude", 0, 0.98, float("nan")), ("magnitude", 1, 0.98, float("nan"))]])
    line = noise_line(gb, best_rows(gb))
    assert line.endswith(" The mask depends on the seed for snapvit (2 cells): their noise is at least the spread of "
                         "their seeds' numbers (another seed, another mask), up to ±4.24 pp."), line
    magnitude = gb[gb["pruner"] == "magnitude"]
    assert "seed" not in noise_line(magnitude, best_rows(magnitude))
    # one seed per cell: SnapViT's spread between masks cannot be measured, and the line says its noise misses it
    one = gb[gb["seed"] == 0].assign(mask_sd=float("nan"))
    assert noise_line(one, best_rows(one)).endswith(
        "; 0 of 1 best-method leads resolved. The mask of snapvit depends on the seed, but 1 of its cells has one "
        "seed quoted: their noise misses the spread between masks (docs/methods.md#reading-the-noise); list two seeds "
        "or more to measure it.")
    assert noise_line(one.drop(columns="mask_sd"), best_rows(one)) == noise_line(one, best_rows(one))
    # two seeds quoted, no mask digests (a sweep before the param): their spread is in the noise, nothing is missed
    two = gb.assign(mask_sd=float("nan"), sibling_sd=0.0424)
    assert "one seed quoted" not in noise_line(two, best_rows(two))
    # a plugin pruner the static table does not list: its trials' logged ``seeded_mask`` metric says it; the
    # metric also overrides the table (a logged 0 for snapvit: no warning)
    plugin = one.assign(pruner=["my_plugin", "magnitude"], seeded_mask=[1.0, 0.0])
    assert "The mask of my_plugin depends on the seed, but 1 of its cells" in noise_line(plugin, best_rows(plugin))
    assert "depends on the seed" not in noise_line(one.assign(seeded_mask=0.0), best_rows(one))
    assert "The mask of snapvit" in noise_line(one.assign(seeded_mask=float("nan")), best_rows(one))  # not logged


def test_a_best_line_names_every_combo_it_is_not_resolved_from():
    """Four healers on one mask, single seed, each quoted with noise 1 pp (2 noise units of a difference: 2.83 pp):
    starfish 90 %, mse 88 % (2 pp behind: tied), kl 87.5 % (2.5 pp: tied), ce 80 % (10 pp: resolved worse)."""
    from analysis.findings_render import findings_md
    from analysis.findings import Findings

    df = pd.DataFrame([dict(pruner="magnitude", healer=h, pattern="0.9", calib_size=64, seed=0, mask_key="x",
                            healed_acc=a, noise=0.01)
                       for h, a in (("starfish", 0.90), ("mse", 0.88), ("kl", 0.875), ("ce", 0.80))])
    (r,) = best_rows(df)
    assert r["best"] == "magnitude × starfish" and r["tied"] == ["magnitude × kl", "magnitude × mse"]
    assert not r["resolved"]
    assert headline([r]) == ("0.9: magnitude × starfish 90.0 % (≈ magnitude × kl, magnitude × mse: lead not "
                             "resolved)")
    md = "\n".join(findings_md([Findings("vit_digits", "healers", [], [r])], ""))
    assert "magnitude × starfish 90.00 %<br>≈ magnitude × kl, magnitude × mse (not resolved)<br>" in md
    (r,) = best_rows(df[df["healer"].isin(["starfish", "ce"])])  # a resolved lead: nothing tied
    assert r["tied"] == [] and r["resolved"] and headline([r]) == "0.9: magnitude × starfish 90.0 %"
    five = pd.concat([df, df.assign(healer=lambda d: d["healer"] + "2", healed_acc=lambda d: d["healed_acc"] - 0.001)])
    (r,) = best_rows(five)
    assert len(r["tied"]) == 5 and "(≈ 5 others: lead not resolved)" in headline([r])


def test_closed_form_rows_show_no_lr_or_epochs():
    best = pd.DataFrame([dict(pruner="magnitude", pattern="0.9", achieved_sparsity=0.9, calib_size=64,
                              dense_acc=0.9, pruned_acc=0.1, healed_acc=0.5, retention=0.55, lr=0.0, epochs=0,
                              n_trials=1, n_failed=0, healer="crbn", scope="all", granularity="example", seed=0,
                              run_id="r1", experiment_id="1")])
    row = model_table(best).rows[0]
    assert row[8:10] == ["closed form", "–"]


def test_budget_warning_names_steps_per_epoch():
    from analysis.findings import _budget_warning

    mb = pd.DataFrame(dict(lr=[1e-3, 1e-3, 0.0], calib_size=[64, 256, 100], batch_size=[32, 32, 32]))
    assert _budget_warning(mb) == (
        "Calibration sizes get different optimisation budgets for the same epochs (64 images: 2 steps/epoch "
        "(batch 32), 256 images: 8 steps/epoch (batch 32)): comparing calibration sizes also compares budgets "
        "(docs/methods.md#search).")  # the closed-form row (lr 0) has no budget
    assert _budget_warning(mb.iloc[:1]) == ""
    # 16 and 32 images at batch 32 are 1 step per epoch each: the same budget, no warning (it said they differ)
    assert _budget_warning(mb.assign(calib_size=[16, 32, 100])) == ""
    assert "16 images: 1 step/epoch (batch 32), 64 images: 2 steps/epoch" in _budget_warning(
        mb.assign(calib_size=[16, 64, 100]))


def test_heldout_agreement_spearman_and_accuracy_lost():
    from analysis.heldout_agreement import agreement, agreement_line

    rows = []
    # cell a: heldout ranks the 3 trials exactly as selection does (rho 1), same pick -> 0 pp lost
    for i, (ho, sel, acc) in enumerate([(0.1, 0.9, 0.80), (0.2, 0.8, 0.70), (0.3, 0.7, 0.60)]):
        rows.append(dict(cell_id="a", status="FINISHED", heldout_align=ho, selection_acc=sel, healed_acc=acc,
                         epochs=3, optuna_trial=i))
    # cell b: reversed (rho -1): heldout picks the trial with eval 0.50 instead of 0.75 -> 25 pp lost
    for i, (ho, sel, acc) in enumerate([(0.3, 0.9, 0.75), (0.2, 0.8, 0.60), (0.1, 0.7, 0.50)]):
        rows.append(dict(cell_id="b", status="FINISHED", heldout_align=ho, selection_acc=sel, healed_acc=acc,
                         epochs=3, optuna_trial=i))
    a = agreement(pd.DataFrame(rows))
    assert a["cells"] == 2 and a["rho_median"] == pytest.approx(0.0) and a["rho_min"] == pytest.approx(-1.0)
    assert a["lost_mean"] == pytest.approx(12.5) and a["lost_max"] == pytest.approx(25.0)
    assert "loses 12.50 pp evaluation accuracy on average (worst cell: loses 25.00 pp) over 2 cells" in agreement_line(a)
    # the default sweep's "loses -0.02 pp ... (worst +0.00 pp)": a gain, and no cell worse
    assert "gains 0.02 pp evaluation accuracy on average (no cell loses)" in agreement_line(
        {**a, "lost_mean": -0.02, "lost_max": 0.0})
    assert "instead of selection accuracy leaves evaluation accuracy unchanged on average (no cell loses)" in \
        agreement_line({**a, "lost_mean": 0.001, "lost_max": 0.0})
    assert agreement(pd.DataFrame(rows).drop(columns="heldout_align")) is None
    # re-evaluations are no candidates (they repeat the winner on other seeds or draws): a re-evaluation of cell a
    # with the best heldout_align and a poor accuracy changes nothing; neither do a closed-form cell's runs on other
    # calibration draws (one search trial: nothing to pick among)
    again = [dict(cell_id="a", status="FINISHED", heldout_align=0.05, selection_acc=0.6, healed_acc=0.1, epochs=3,
                  optuna_trial=0, stage="reevaluate")]
    again += [dict(cell_id="c", status="FINISHED", heldout_align=h, selection_acc=s, healed_acc=s, epochs=0,
                   optuna_trial=0, stage=st) for h, s, st in [(0.3, 0.5, "search"), (0.2, 0.6, "reevaluate"),
                                                             (0.1, 0.4, "reevaluate")]]
    assert agreement(pd.DataFrame(rows + again)) == a


def test_first_screen_summaries_headline_flags_and_folded_columns():
    from analysis.findings import Range, flag_of, headline
    from analysis.findings_render import _folded

    rows = [dict(pattern="0.5", calib_size="64", best="magnitude × crbn", healed=0.972),
            dict(pattern="0.5", calib_size="256", best="magnitude × starfish", healed=0.9717),
            dict(pattern="0.9", calib_size="64", best="magnitude × starfish", healed=0.6167),
            dict(pattern="0.9", calib_size="256", best="global × starfish", healed=0.9389)]
    assert headline(rows) == ("0.5: magnitude × crbn 97.2 % (calib 64) · "
                              "0.9: global × starfish 93.9 % (calib 256)")
    assert headline(rows[2:3]) == "0.9: magnitude × starfish 61.7 %"  # one calibration size: not named
    assert flag_of("23 of 34 searched cells' winners sit on the search boundary, so those accuracies may be "
                   "under-tuned: global/starfish 0.9 n=64 seed 0 (lr 0.01 at the 0.01 cap).") == (
        "23 of 34 searched cells' winners sit on the search boundary")
    assert flag_of("Calibration sizes get different optimisation budgets for the same epochs (64 images: 2 "
                   "steps/epoch (batch 32)): comparing ...") == "Calibration sizes get different optimisation budgets for the same epochs"
    assert flag_of("Single seed: no point has a spread.") == "Single seed"
    r = [Range("erk", "crbn", "64", "90 %", "≥ 95 %", "none in grid", "grid step 5 pp", "n=1 (no spread)", "none",
               "95–97 %"),
         Range("rr", "crbn", "64", "none in grid", "90–95 %", "none in grid", "grid step 5 pp", "n=3, max std 1.0 pp",
               "none", "95–97 %")]
    assert _folded(r) == {"resolution": "grid step 5 pp", "unresolved": "none", "cts": "95–97 %"}  # seeds differ: stays a column
    assert _folded(r[:1]) == {}  # one row: nothing to fold


def test_uniform_grid_step_is_one_number_despite_float_differences():
    pts = [dict(sparsity=x, label="transition", n_seeds=3, healed_std=0.01) for x in (0.85, 0.9, 0.95)]
    (r,) = ranges([{"pruner": "magnitude", "healer": "mse", "calib_size": 128, "points": pts}], None)
    assert r.resolution == "grid step 5 pp"  # 0.9-0.85 and 0.95-0.9 differ in the 17th digit


def test_failed_cells_are_named_by_what_they_are():
    """'Cells without a finished trial (1): a53415a4fef8.' named a hash only; the row it leaves out said nothing."""
    from analysis.findings import _warnings

    mb = pd.DataFrame(dict(pruner="magnitude", healer="starfish", pattern=["0.5", "0.9"], calib_size=64, seed=[0, 1],
                           lr=1e-3, batch_size=32, search_boundary=""))
    trials = pd.DataFrame(dict(cell_id=["a53415a4fef8", "a53415a4fef8"], pruner="magnitude", healer="starfish",
                               pattern="0.95", calib_size=64, seed=0))
    (w,) = [w for w in _warnings(mb, ["a53415a4fef8", "ffff"], "", trials) if w.startswith("Cells without")]
    assert w == ("Cells without a finished trial (2): magnitude/starfish 0.95 n=64 seed 0 (cell a53415a4fef8), ffff; "
                 "their sparsities are missing from the ranges above.")


def test_identical_mask_groups_that_agree_are_one_note_and_each_disagreement_a_warning():
    """The default sweep's uniform and magnitude masks are one mask at 0.9 and 0.95 (8 groups): one note sums
    them up; a group whose numbers differ beyond noise is a warning of its own."""
    from analysis.findings import identical_mask_lines

    rows = [dict(grid="main", model="m", calib_size=c, healer="starfish", seed=0, mask_key=f"k-{p}",
                 mask_digest=f"d{pat}{c}", pruner=p, pattern=pat, healed_acc=a, noise=0.01)
            for pat, c, a in (("0.9", 64, 0.95), ("0.95", 64, 0.80), ("0.95", 256, 0.84))
            for p in ("uniform", "magnitude")]
    rows[-1]["healed_acc"] = 0.50  # magnitude 0.95 calib 256: 34 pp from uniform's, noise 1 pp
    lines = identical_mask_lines(pd.DataFrame(rows))
    assert lines == [
        (False, "Identical masks (starfish, 0.95, calib 256, seed 0): uniform 84.0 % vs magnitude 50.0 %: DISAGREE "
                "beyond noise (gap 34.00 pp)."),
        (True, "Identical masks: in 2 cell group(s) two pruners produced the same mask (magnitude = uniform at 0.9, "
               "0.95); their quoted numbers agree within noise (largest gap 0.00 pp).")]



def test_identical_masks_without_measured_noise_are_not_said_to_agree():
    """search.reevaluate 0: no noise to judge a gap by; 'agree within noise (largest gap 40.00 pp)' was printed."""
    from analysis.findings import identical_mask_lines

    rows = [dict(grid="main", model="m", calib_size=64, healer="starfish", seed=0, mask_key=f"k-{p}", mask_digest="d",
                 pruner=p, pattern="0.9", healed_acc=a, noise=float("nan")) for p, a in (("uniform", 0.9), ("magnitude", 0.5))]
    assert identical_mask_lines(pd.DataFrame(rows)) == [(False, (
        "Identical masks (starfish, 0.9, calib 64, seed 0): uniform 90.0 % vs magnitude 50.0 %: differ, noise not "
        "measured (search.reevaluate 0) (gap 40.00 pp)."))]
    rows[1]["healed_acc"] = 0.9  # the same number: agree, noise or not
    assert identical_mask_lines(pd.DataFrame(rows))[0][0] is True


def test_single_seed_warning_counts_only_the_searched_cells_noise():
    """A closed-form cell's noise is binomial, always there: with no re-evaluation of the searched cells the leads
    were not tested against search noise, and the warning said they were."""
    from analysis.findings import _warnings

    mb = pd.DataFrame(dict(pruner="magnitude", healer=["starfish", "crbn"], pattern="0.5", calib_size=64, seed=0,
                           lr=[1e-3, 0.0], batch_size=32, search_boundary="", pruned_acc=0.5, healed_acc=[0.9, 0.8],
                           noise=[float("nan"), 0.02]))
    assert [w for w in _warnings(mb, []) if w.startswith("Single seed")] == [
        "Single seed: no point has a spread or a confidence interval; differences are not tested."]
