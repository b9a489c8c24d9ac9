"""End to end: healers as a grid dimension on identical masks (none, a chain, starfish), 2 seeds, paired report."""
from __future__ import annotations

import os

import pytest

from orchestrator.spec import parse_spec
from orchestrator.sweep.run import run_sweep
from tests.e2e.test_e2e import child_runs, model_cache  # noqa: F401 (fixture)

pytestmark = pytest.mark.e2e

SPEC = {"name": "healers-e2e", "models": ["vit_digits"], "sparsities": [0.9], "calib_sizes": [64],
        "pruners": ["magnitude"], "seeds": [0, 1],
        "healers": ["starfish", "none", {"chain": ["none", "starfish"]}],
        # fixed lr/epochs: one trial per cell, so starfish and none+starfish see the same budget
        "search": {"trials_per_cell": 1, "lr": [3.0e-3, 3.0e-3], "epochs": [4, 4], "reevaluate": 0},
        # an extra grid with its own search budget: starfish alone on 128 images, 2 trials of 1 epoch
        "grids": [{"name": "wide", "calib_sizes": [128], "seeds": [0], "healers": ["starfish"],
                   "search": {"trials_per_cell": 2, "lr": [1.0e-3, 3.0e-3], "epochs": [1, 1],
                              "reevaluate": 0}}]}


@pytest.fixture(scope="module")
def sweep(tmp_path_factory, model_cache):  # noqa: F811
    root = tmp_path_factory.mktemp("e2e_healers")
    os.environ["HEALSWEEP_CHECKPOINT_INTERVAL_S"] = "0"  # a checkpoint every epoch, so the clean-up has work to do
    try:
        return run_sweep(parse_spec(SPEC), root / "run", root / "store", model_cache, progress=False, num_cpus=2)
    finally:
        os.environ.pop("HEALSWEEP_CHECKPOINT_INTERVAL_S", None)


def test_healers_share_masks_and_pair_in_the_report(sweep):
    client, runs = child_runs(sweep)
    runs = [r for r in runs if r.data.params["grid"] == "main"]
    assert len(runs) == 6 and sweep.trials_failed == 0  # 3 healers x 2 seeds, one trial each
    by = {(r.data.params["healer"], int(r.data.params["seed"])): r for r in runs}
    assert set(by) == {(h, s) for h in ("starfish", "none", "none+starfish") for s in (0, 1)}
    for seed in (0, 1):
        keys = {by[h, seed].data.tags["mask_key"] for h in ("starfish", "none", "none+starfish")}
        assert len(keys) == 1  # identical mask across healers of a cell
        assert len({by[h, seed].data.metrics["pruned_acc"] for h in ("starfish", "none", "none+starfish")}) == 1
    assert by["none", 0].data.tags["mask_key"] != by["none", 1].data.tags["mask_key"]  # the seed draws the mask
    for seed in (0, 1):
        none, sf, chain = by["none", seed], by["starfish", seed], by["none+starfish", seed]
        # none: no epochs, nothing searched, the pruned model as is
        assert (none.data.params["epochs"], float(none.data.params["lr"])) == ("0", 0.0)
        assert none.data.metrics["healed_acc"] == none.data.metrics["pruned_acc"]
        assert "selection_acc" in none.data.metrics and "train_loss" not in none.data.metrics
        assert client.get_metric_history(none.info.run_id, "selection_acc")[0].step == 0
        # none then starfish = starfish, bit for bit (same mask, seed, lr, epochs and batches)
        for m in ("healed_acc", "selection_acc", "train_loss"):
            assert chain.data.metrics[m] == sf.data.metrics[m], m
        assert len(client.get_metric_history(chain.info.run_id, "train_loss")) == 4
        assert sf.data.metrics["healed_acc"] > none.data.metrics["healed_acc"] + 0.05
    md = (sweep.out_dir / "report.md").read_text()
    section = md.split("### Healers on identical masks", 1)[1].split("\n### ", 1)[0]  # that table only
    assert "#### magnitude, pattern 0.9, calib size 64" in section
    rows = {ln.split(" | ")[0][2:]: ln for ln in section.splitlines() if ln.startswith("| ") and "---" not in ln}
    assert set(rows) == {"healer", "starfish", "none", "none+starfish"}
    assert rows["none+starfish"].endswith("| +0.00 ± 0.00 | 2 |")
    assert rows["starfish"].endswith("| reference | – |")


def test_extra_grid_runs_with_its_own_budget_and_checkpoints_are_dropped(sweep):
    client, runs = child_runs(sweep)
    assert len(runs) == 8 and sweep.trials_finished == 8
    wide = [r for r in runs if r.data.params["grid"] == "wide"]
    assert len(wide) == 2 and len({r.data.tags["cell_id"] for r in wide}) == 1  # one cell, 2 trials
    for r in wide:
        p = r.data.params
        assert (p["calib_size"], p["healer"], p["seed"], p["epochs"]) == ("128", "starfish", "0", "1")
        assert 1e-3 <= float(p["lr"]) <= 3e-3
        assert len(client.get_metric_history(r.info.run_id, "train_loss")) == 1
    assert len({float(r.data.params["lr"]) for r in wide}) == 2  # the search drew two learning rates
    # the mask of the wide cell is the main grid's seed-0 mask (masks do not depend on calibration size here)
    main0 = [r for r in runs if r.data.params["grid"] == "main" and r.data.params["seed"] == "0"]
    assert {r.data.tags["mask_key"] for r in wide} == {main0[0].data.tags["mask_key"]}
    # Tune's per-epoch checkpoints are gone once the fit is over; healed weights stay for export
    assert not list((sweep.out_dir / "tune").glob("*/*/checkpoint_*"))
    assert client.get_run(sweep.parent_run_id).data.metrics["tune_checkpoint_bytes_freed"] > 0
    assert len(list((sweep.out_dir / "trials").glob("*/healed.safetensors"))) == 8
