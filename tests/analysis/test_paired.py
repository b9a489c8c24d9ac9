"""analysis/paired.py: healers on identical masks, from a synthetic MLflow store (hand-computed numbers)."""
from __future__ import annotations

import time

import pytest
from mlflow import MlflowClient
from mlflow.entities import Metric, Param

from analysis import best_per_cell, load_trials, write_report_from
from analysis.paired import paired_groups

SWEEP = "sw-paired"


def _run(client, exp, parent, *, model, healer, seed, pattern, healed, sel, pruned, mask, cell=None, trial="0"):
    cell = cell or f"{model}-{healer}-{pattern}-{seed}"
    tags = {"mlflow.parentRunId": parent, "sweep_id": SWEEP, "cell_id": cell, "trial_id": f"{cell}-{trial}",
            "healsweep.role": "trial", "pattern": pattern, "mask_key": mask, "store_key": "k"}
    rid = client.create_run(exp, tags=tags).info.run_id
    params = dict(model=model, pruner="magnitude", scope="qkv_out_mlp", sparsity=pattern, calib_size="64",
                  healer=healer, granularity="token", seed=str(seed), lr="0.001", epochs="3", batch_size="32")
    ts = int(time.time() * 1000)
    metrics = dict(selection_acc=sel, healed_acc=healed, pruned_acc=pruned, dense_acc=0.95,
                   retention=healed / 0.95, heal_seconds=1.0, achieved_sparsity=float(pattern), mask_violations=0.0)
    client.log_batch(rid, metrics=[Metric(k, v, ts, 3) for k, v in metrics.items()],
                     params=[Param(k, v) for k, v in params.items()])
    client.set_terminated(rid, "FINISHED")
    return rid


# vit @ 0.9, seeds 0..2 (mask key m<seed>; none's seed-2 run sits on another mask, so it is not paired):
#   starfish  .80 .70 .75 -> 75.00 ± 5.00
#   mse       .78 .69 .70 -> 72.33 ± 4.93;  d = -.02 -.01 -.05 -> -2.67 ± 2.08
#   none      .10 .12 .08 -> 10.00 ± 2.00;  d = -.70 -.58 (seed 2 unpaired) -> -64.00 ± 8.49
#   pruned    .05 .06 .07 (same for every healer of a seed) -> 6.00
# vit @ 0.5: starfish only -> no paired table.  cnn @ 0.9, one seed: starfish .5, kl .4 -> Δ -10.00, no ± (n=1).
HEALED = {"starfish": (0.80, 0.70, 0.75), "mse": (0.78, 0.69, 0.70), "none": (0.10, 0.12, 0.08)}


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    root = tmp_path_factory.mktemp("paired")
    uri = f"sqlite:///{root / 'mlflow.db'}"
    client = MlflowClient(uri)
    exp = client.create_experiment("healsweep", artifact_location=(root / "art").as_uri())
    parent = client.create_run(exp, tags={"sweep_id": SWEEP, "healsweep.role": "sweep"}, run_name="paired").info.run_id
    R = dict(client=client, exp=exp, parent=parent)
    for healer, values in HEALED.items():
        for seed, h in enumerate(values):
            mask = "other" if (healer, seed) == ("none", 2) else f"m{seed}"
            _run(**R, model="vit", healer=healer, seed=seed, pattern="0.9", healed=h, sel=0.5, pruned=0.05 + 0.01 * seed,
                 mask=mask)
    # a second mse trial on seed 0: better healed, worse selection -> must not be used
    _run(**R, model="vit", healer="mse", seed=0, pattern="0.9", healed=0.99, sel=0.1, pruned=0.05, mask="m0",
         cell="vit-mse-0.9-0", trial="1")
    _run(**R, model="vit", healer="starfish", seed=0, pattern="0.5", healed=0.9, sel=0.9, pruned=0.5, mask="q")
    _run(**R, model="cnn", healer="starfish", seed=0, pattern="0.9", healed=0.5, sel=0.5, pruned=0.1, mask="c")
    _run(**R, model="cnn", healer="kl", seed=0, pattern="0.9", healed=0.4, sel=0.5, pruned=0.1, mask="c")
    return uri


def test_paired_groups_hand_values(store):
    best = best_per_cell(load_trials(store, SWEEP))
    groups = paired_groups(best[best["model"] == "vit"])
    assert len(groups) == 1  # the 0.5 group has one healer only
    group, rows = groups[0]
    assert (group["pruner"], group["pattern"], group["calib_size"]) == ("magnitude", "0.9", 64)
    got = {r.healer: r for r in rows}
    assert [r.healer for r in rows] == ["starfish", "mse", "none"]  # by mean healed accuracy
    assert got["starfish"].healed_mean == pytest.approx(0.75) and got["starfish"].healed_std == pytest.approx(0.05)
    assert got["starfish"].diff_mean is None and got["starfish"].pairs == 0
    assert got["mse"].healed_mean == pytest.approx(0.723333, abs=1e-6)
    assert got["mse"].healed_std == pytest.approx(0.0493288, abs=1e-6)
    assert got["mse"].diff_mean == pytest.approx(-0.0266667, abs=1e-6)
    assert got["mse"].diff_std == pytest.approx(0.0208167, abs=1e-6)
    assert (got["mse"].pairs, got["mse"].unpaired, got["mse"].seeds) == (3, 0, 3)
    assert got["none"].diff_mean == pytest.approx(-0.64) and got["none"].diff_std == pytest.approx(0.0848528, abs=1e-6)
    assert (got["none"].pairs, got["none"].unpaired) == (2, 1)
    assert all(r.pruned_mean == pytest.approx(0.06) for r in rows)


def test_report_has_the_paired_section(store, tmp_path):
    paths = write_report_from(store, SWEEP, tmp_path)
    md = paths["md"].read_text()
    vit = md.split("## vit\n", 1)[1]
    assert vit.count("### Healers on identical masks") == 1
    assert "#### magnitude, pattern 0.9, calib size 64" in vit and "pattern 0.5" not in vit
    assert "| starfish | 3 | 6.00 | 75.00 ± 5.00 | reference | – |" in vit
    assert "| mse | 3 | 6.00 | 72.33 ± 4.93 | -2.67 ± 2.08 | 3 |" in vit
    assert "| none | 3 | 6.00 | 10.00 ± 2.00 | -64.00 ± 8.49 | 2 (1 on other masks) |" in vit
    cnn = md.split("## cnn\n", 1)[1].split("\n## ", 1)[0]
    # cnn: two healers, one seed each: a two-row table would repeat the main table, so no paired section
    assert "Healers on identical masks" not in cnn
    page = paths["html"].read_text()
    assert page.count("<h3>Healers on identical masks</h3>") == 1
    assert '<td class="l">none</td><td>3</td><td>6.00</td><td>10.00 ± 2.00</td><td>-64.00 ± 8.49</td>' in page


def test_report_states_the_ordering_with_its_noise(store, tmp_path):
    md = write_report_from(store, SWEEP, tmp_path)["md"].read_text()
    vit = md.split("## vit\n", 1)[1].split("\n## ", 1)[0]
    # starfish - mse: d = .02 .01 .05 -> +2.67 pp, 95 % CI ± t(0.975, 2) 4.3027 x 2.0817 / sqrt(3) = ± 5.17 pp;
    # mse - none: two pairs only (seed 2 on another mask), ± 12.706 x 7.78 / sqrt(2) = ± 69.9 pp: within noise
    assert "Measured ordering (paired, 95 % CI): starfish ≈ mse ≈ none" in vit
    assert "Paper's claim cosine ≥ MSE ≥ KL ≥ CE: starfish − mse = +2.67 pp [95 % CI -2.50, +7.84] (within noise)" in vit
    cnn = md.split("## cnn\n", 1)[1].split("\n## ", 1)[0]
    assert "Measured ordering" not in cnn and "Paper's claim" not in cnn  # one seed: no noise estimate
    # the paired figure: vit (3 seeds) only
    assert "![vit: healers on identical masks](fig_vit_healers.png)" in vit and (tmp_path / "fig_vit_healers.png").is_file()
    assert "healers on identical masks](" not in cnn and not (tmp_path / "fig_cnn_healers.png").exists()


def test_healer_panels_hold_every_seed_on_its_mask(store):
    from analysis.paired import healer_panels

    best = best_per_cell(load_trials(store, SWEEP))
    (title, values), = healer_panels(best[best["model"] == "vit"])
    assert title == "magnitude, pattern 0.9, calib size 64"
    assert values["starfish"] == {(0, "m0"): 0.80, (1, "m1"): 0.70, (2, "m2"): 0.75}
    assert values["mse"][(0, "m0")] == 0.78  # the best trial by selection accuracy, not the 0.99 one
    assert set(values["none"]) == {(0, "m0"), (1, "m1"), (2, "other")}
    assert healer_panels(best[best["model"] == "cnn"]) == []


def test_paired_interval_and_verdicts_by_hand():
    from analysis.ordering import claim_check, measured_ordering, paired_ci

    ci = paired_ci({0: 0.80, 1: 0.70, 2: 0.75}, {0: 0.78, 1: 0.69, 2: 0.70, 9: 0.0})  # key 9 has no pair
    assert ci.n == 3 and ci.mean == pytest.approx(0.0266667, abs=1e-6)
    assert ci.half == pytest.approx(4.302653 * 0.0208167 / 3 ** 0.5, rel=1e-5) and ci.sign == "≈"
    one = paired_ci({0: 0.9}, {0: 0.1, 1: 0.2})
    assert (one.n, one.mean, one.half, one.sign) == (1, pytest.approx(0.8), None, "?")
    assert paired_ci({0: 0.9}, {1: 0.1}) is None
    a = {0: 0.90, 1: 0.91, 2: 0.92}
    b = {0: 0.80, 1: 0.805, 2: 0.83}  # a - b = .1 .105 .09: interval well above 0
    c = {0: 0.81, 1: 0.79, 2: 0.83}  # b - c = -.01 .015 0: contains 0
    d = {7: 0.10}  # shares no seed with c
    assert paired_ci(a, b).sign == ">" and paired_ci(b, a).sign == "<"
    assert measured_ordering({"c": c, "a": a, "d": d, "b": b}) == "a > b ≈ c ? d"
    got = {(x, y): w for x, y, _, w in claim_check({"starfish": b, "mse": a, "kl": c, "ce": d})}
    assert got == {("starfish", "mse"): "reversed", ("mse", "kl"): "holds"}  # kl - ce: no shared seed
    assert {(x, y): w for x, y, _, w in claim_check({"starfish": b, "mse": c})} == {("starfish", "mse"): "within noise"}
