"""End to end: the default search design on a real sweep: every searched cell's winner is healed again on two
fresh healing seeds, the report quotes their mean (never the winner's own draw), the study names a person can
find, and the noise the report reads (docs/methods.md#search-design)."""
from __future__ import annotations

import json
import os
import statistics
from pathlib import Path

import optuna
import pytest
import yaml
from mlflow import MlflowClient

from analysis.reported import cell_results
from orchestrator.cli import main as cli_main
from orchestrator.search import open_journal

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.e2e
CACHE = os.environ.get("HEALSWEEP_TEST_CACHE", str(REPO / ".healsweep" / "models"))


def _run(tmp_path, spec: dict):
    """``healsweep run`` of ``spec`` in ``tmp_path`` -> (run dir, sweep.json, MLflow client, experiment)."""
    (tmp_path / "spec.yaml").write_text(yaml.safe_dump(spec))
    run_dir = tmp_path / "run"
    rc = cli_main(["run", str(tmp_path / "spec.yaml"), "--out", str(run_dir), "--store", str(tmp_path / "store"),
                   "--cache", CACHE, "--num-cpus", "2", "--quiet"])
    assert rc == 0
    meta = json.loads((run_dir / "sweep.json").read_text())
    client = MlflowClient(meta["tracking_uri"])
    return run_dir, meta, client, client.get_experiment_by_name("healsweep")


def test_winners_are_reevaluated_on_fresh_seeds_and_the_report_quotes_their_mean(tmp_path):
    spec = {"name": "reeval", "models": ["vit_digits"], "sparsities": [0.9], "calib_sizes": [64],
            "pruners": ["magnitude"], "healers": ["starfish", "none"], "seeds": [0],
            "search": {"trials_per_cell": 3, "lr": [1.0e-3, 1.0e-2], "steps": [4, 16], "lattice": [3, 3],
                       "reevaluate": 2}}
    run_dir, meta, client, exp = _run(tmp_path, spec)
    runs = [r for r in client.search_runs([exp.experiment_id], f"tags.sweep_id = '{meta['sweep_id']}'")
            if r.data.tags["healsweep.role"] == "trial"]
    star = [r for r in runs if r.data.params["healer"] == "starfish"]
    search = [r for r in star if r.data.tags["stage"] == "search"]
    again = [r for r in star if r.data.tags["stage"] == "reevaluate"]
    assert len(search) == 3 and len(again) == 2 and all(r.info.status == "FINISHED" for r in star)
    assert len([r for r in runs if r.data.params["healer"] == "none"]) == 1  # nothing to search or repeat
    win = max(search, key=lambda r: (r.data.metrics["selection_acc"], -int(r.data.params["steps"])))
    assert sorted(int(r.data.params["heal_seed"]) for r in again) == [1000, 2000]
    assert all((r.data.params["lr"], r.data.params["steps"]) == (win.data.params["lr"], win.data.params["steps"])
               for r in again)
    accs = [r.data.metrics["healed_acc"] for r in again]
    assert accs[0] != accs[1]  # another healing seed is another draw (batch order)
    res = cell_results(meta["tracking_uri"], meta["sweep_id"]).set_index("healer")
    assert res.loc["starfish", "healed_acc"] == pytest.approx(statistics.mean(accs))
    assert res.loc["starfish", "healed_acc_sd"] == pytest.approx(statistics.stdev(accs))
    assert res.loc["starfish", "healed_acc_search"] == pytest.approx(win.data.metrics["healed_acc"])
    assert res.loc["starfish", "n_reevaluated"] == 2 and res.loc["starfish", "noise"] > 0
    assert res.loc["none", "n_reevaluated"] == 0
    md = (run_dir / "report.md").read_text()
    assert f"{100 * statistics.mean(accs):.2f}" in md  # the quoted number is the re-evaluations' mean
    # the studies are named so a person finds the cell in optuna-dashboard, with the seeds recorded
    names = {s.study_name for s in open_journal(run_dir / "optuna.journal").get_all_studies()}
    cid = search[0].data.tags["cell_id"]
    assert f"vit_digits / magnitude 0.9 / calib 64 / starfish / seed 0 · {cid}" in names
    st = optuna.load_study(study_name=f"vit_digits / magnitude 0.9 / calib 64 / starfish / seed 0 · {cid} · reevaluate",
                           storage=open_journal(run_dir / "optuna.journal"))
    assert sorted(t.user_attrs["heal_seed"] for t in st.trials) == [1000, 2000]


def test_reevaluations_on_other_calibration_draws_heal_on_their_own_targets_masks_and_images(tmp_path):
    """search.calib_draws 2: re-evaluation k heals on draw k (calib_seed 1000, 2000): targets computed for each
    draw's images, a mask of its own where the pruner reads calibration images (RR) and the same mask where it does
    not (magnitude); a closed-form cell heals once on each draw where its mask reads the images (RR x none) and
    once in all where nothing does (magnitude x none); the report says its noise spans the draws
    (orchestrator/sweep/draws.py)."""
    from tasks.models import load_model
    from tasks.store import TargetStore

    spec = {"name": "draws", "models": ["vit_digits"], "sparsities": [0.9], "calib_sizes": [64],
            "pruners": ["magnitude", "rr"], "healers": ["starfish", "none"], "seeds": [0],
            "search": {"trials_per_cell": 3, "lr": [1.0e-3, 1.0e-2], "steps": [4, 16], "lattice": [3, 3],
                       "reevaluate": 2, "calib_draws": 2}}
    run_dir, meta, client, exp = _run(tmp_path, spec)
    assert sum(meta["dense_forward_images"].values()) == 3 * 64  # the sweep's draw and two others, 64 images each
    runs = client.search_runs([exp.experiment_id], f"tags.sweep_id = '{meta['sweep_id']}'")
    parent = [r for r in runs if r.data.tags["healsweep.role"] != "trial"]
    assert parent[0].data.params["calib_draws"] == "2"
    trials = [r for r in runs if r.data.tags["healsweep.role"] == "trial"]
    assert len(trials) == 14 and all(r.info.status == "FINISHED" for r in trials)
    closed = [r for r in trials if r.data.params["healer"] == "none"]
    assert sorted((r.data.params["pruner"], r.data.tags["stage"], r.data.params.get("calib_seed")) for r in closed) == [
        ("magnitude", "search", None),  # no draw changes a magnitude mask healed by nothing: one trial
        ("rr", "reevaluate", "1000"), ("rr", "reevaluate", "2000"), ("rr", "search", None)]  # RR's mask reads them
    rr_none = {r.data.params.get("calib_seed"): r for r in closed if r.data.params["pruner"] == "rr"}
    trials = [r for r in trials if r.data.params["healer"] == "starfish"]
    search = [r for r in trials if r.data.tags["stage"] == "search"]
    again = [r for r in trials if r.data.tags["stage"] == "reevaluate"]
    assert all("calib_seed" not in r.data.params for r in search)
    assert sorted((r.data.params["pruner"], r.data.params["calib_seed"]) for r in again) == [
        ("magnitude", "1000"), ("magnitude", "2000"), ("rr", "1000"), ("rr", "2000")]
    own = {r.data.tags["store_key"] for r in search}
    key_of = {r.data.params["calib_seed"]: r.data.tags["store_key"] for r in again}
    assert len(own) == 1 and len({*own, *key_of.values()}) == 3  # a target key per draw
    keys = json.loads((run_dir / "targets.json").read_text())["keys"]
    assert keys == {"vit_digits": own.pop(), "vit_digits@1000": key_of["1000"], "vit_digits@2000": key_of["2000"]}
    store = TargetStore(str(tmp_path / "store" / "targets"))
    for draw, key in key_of.items():  # each draw's targets are of that draw's images (what its trials load)
        lm = load_model("vit_digits", CACHE, data_seed=0, progress=False, calib_seed=int(draw))
        assert store.open(key, num_rows=64).meta["calibration"] == lm.dataset.split_digest("calibration")
    masks = {(r.data.params["pruner"], r.data.params.get("calib_seed")): r.data.tags["mask_key"] for r in trials}
    assert masks[("magnitude", None)] == masks[("magnitude", "1000")] == masks[("magnitude", "2000")]
    assert len({masks[("rr", None)], masks[("rr", "1000")], masks[("rr", "2000")]}) == 3  # RR reads the images
    res = cell_results(meta["tracking_uri"], meta["sweep_id"]).set_index(["pruner", "healer"]).sort_index()
    assert res["n_draws"].tolist() == [0, 2, 2, 2] and res["n_reevaluated"].tolist() == [0, 2, 3, 2]  # none, starfish
    for draw, r in rr_none.items():  # each draw's RR x none trial prunes with that draw's RR mask
        assert r.data.tags["mask_key"] == masks[("rr", draw)]
    accs = [r.data.metrics["healed_acc"] for r in rr_none.values()]
    assert res.loc[("rr", "none"), "healed_acc"] == pytest.approx(statistics.mean(accs))  # every draw, its own too
    assert res.loc[("rr", "none"), "healed_acc_search"] == pytest.approx(rr_none[None].data.metrics["healed_acc"])
    md = (run_dir / "report.md").read_text()
    assert "healed on 2 other draws of the calibration images (search.calib_draws)" in md
    assert "(closed-form cells: the mean over the sweep's draw and the others)" in md
    assert "on this one draw" not in md
