"""End to end: a sweep searched label-free (objective heldout_align) over optimizer steps, and a widening round
past a deliberately small lr range (docs/methods.md#search)."""
from __future__ import annotations

import json
import math
import os
from pathlib import Path

import optuna
import pytest
import yaml
from mlflow import MlflowClient

from orchestrator.cli import main as cli_main

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.e2e
CACHE = os.environ.get("HEALSWEEP_TEST_CACHE", str(REPO / ".healsweep" / "models"))


def _run(tmp_path: Path, spec: dict) -> tuple[Path, dict]:
    (tmp_path / "spec.yaml").write_text(yaml.safe_dump(spec))
    run_dir = tmp_path / "run"
    rc = cli_main(["run", str(tmp_path / "spec.yaml"), "--out", str(run_dir), "--store", str(tmp_path / "store"),
                   "--cache", CACHE, "--num-cpus", "2", "--quiet"])
    assert rc == 0
    return run_dir, json.loads((run_dir / "sweep.json").read_text())


def _runs(meta: dict) -> tuple[MlflowClient, list, object]:
    client = MlflowClient(meta["tracking_uri"])
    exp = client.get_experiment_by_name("healsweep")
    runs = client.search_runs([exp.experiment_id], f"tags.sweep_id = '{meta['sweep_id']}'")
    (parent,) = [r for r in runs if r.data.tags["healsweep.role"] == "sweep"]
    return client, [r for r in runs if r.data.tags["healsweep.role"] == "trial"], parent


def test_heldout_align_objective_over_steps_picks_the_lowest_and_runs_exact_steps(tmp_path):
    spec = {"name": "heldoutsteps", "models": ["resnet_digits"], "sparsities": [0.9], "calib_sizes": [64, 128],
            "pruners": ["magnitude"], "healers": ["starfish", "none"], "seeds": [0],
            "search": {"trials_per_cell": 3, "lr": [1.0e-3, 3.0e-3], "steps": [3, 7], "objective": "heldout_align"}}
    run_dir, meta = _run(tmp_path, spec)
    client, trials, parent = _runs(meta)
    assert parent.data.params["objective"] == "heldout_align"
    by_cell: dict[str, list] = {}
    for r in trials:
        by_cell.setdefault(r.data.tags["cell_id"], []).append(r)
    again = {c: [r for r in rs if r.data.tags["stage"] == "reevaluate"] for c, rs in by_cell.items()}
    by_cell = {c: [r for r in rs if r.data.tags["stage"] == "search"] for c, rs in by_cell.items()}
    starfish = {c: rs for c, rs in by_cell.items() if rs[0].data.params["healer"] == "starfish"}
    none = {c: rs for c, rs in by_cell.items() if rs[0].data.params["healer"] == "none"}
    assert len(starfish) == 2 and all(len(rs) == 3 for rs in starfish.values())
    assert len(none) == 2 and all(len(rs) == 1 for rs in none.values())  # nothing to search: one trial
    assert all(not again[c] for c in none) and all(len(again[c]) == 2 for c in starfish)  # winners healed again
    for rs in starfish.values():
        for r in rs:  # the budget is steps, whatever the calibration size; epochs = the epochs they need
            steps, n = int(r.data.params["steps"]), int(r.data.params["calib_size"])
            assert 3 <= steps <= 7
            assert int(r.data.params["epochs"]) == math.ceil(steps / math.ceil(n / 32))
            assert r.data.metrics["optimizer_steps"] == steps
            # one loss per epoch at its step, though the epochs reached Tune in one result (epoch_history)
            hist = client.get_metric_history(r.info.run_id, "train_loss")
            assert sorted(m.step for m in hist) == list(range(1, int(r.data.params["epochs"]) + 1))
    # Each cell's recorded winner (bands.json run ids) is the trial with the lowest heldout_align.
    bands = json.loads((run_dir / "bands.json").read_text())["models"]["resnet_digits"]["bands"]
    winners = {rid for b in bands for p in b["points"] for rid in p["run_ids"]}
    for cell, rs in starfish.items():
        low = min(rs, key=lambda r: (r.data.metrics["heldout_align"], int(r.data.params["optuna_trial"])))
        assert low.info.run_id in winners
        assert not ({r.info.run_id for r in rs} - {low.info.run_id}) & winners
        # the re-evaluations heal the winner's point on fresh healing seeds
        assert {(r.data.params["lr"], r.data.params["steps"]) for r in again[cell]} == {
            (low.data.params["lr"], low.data.params["steps"])}
        assert len({r.data.params["heal_seed"] for r in again[cell]}) == 2
        storage = optuna.storages.JournalStorage(
            optuna.storages.journal.JournalFileBackend(str(run_dir / "optuna.journal")))
        (name,) = [n for n in optuna.get_all_study_names(storage) if n.endswith(f"· {cell}")]  # the search study
        study = optuna.load_study(study_name=name, storage=storage)
        assert study.direction == optuna.study.StudyDirection.MINIMIZE
        assert study.best_value == pytest.approx(low.data.metrics["heldout_align"])
    md = (run_dir / "report.md").read_text()
    assert "Winners were picked label-free" in md and "Label-free selection (heldout_align" in md
    assert "different optimisation budgets" not in md  # a steps search gives every calibration size one budget


@pytest.mark.parametrize("how", ["spec", "refine --widen"])
def test_widen_round_searches_past_the_boundary(tmp_path, how):
    """The same widening round asked for by the spec (search.widen: run after the sweep) or afterwards on the
    command line (`healsweep refine DIR --widen`: it once died of an UnboundLocalError before its first round)."""
    # lr far too low to heal in 1-2 epochs of 64 images: the search box is wrong, and the winner sits on its edge
    spec = {"name": "widen", "models": ["resnet_digits"], "sparsities": [0.9], "calib_sizes": [64],
            "pruners": ["magnitude"], "healers": [{"name": "starfish", "settings": {"bn": "frozen"}}], "seeds": [0],
            # a 2 x 2 lattice: every point is a corner, so whichever wins sits on an edge (all of them fail to heal)
            "search": {"trials_per_cell": 3, "lr": [1.0e-6, 1.0e-4], "epochs": [1, 2], "lattice": [2, 2],
                       **({"widen": {"rounds": 1, "factor": 10}} if how == "spec" else {})}}
    run_dir, meta = _run(tmp_path, spec)
    if how != "spec":
        assert "widenings" not in meta
        assert cli_main(["refine", str(run_dir), "--widen", "--widen-factor", "10", "--num-cpus", "2", "--quiet"]) == 0
        meta = json.loads((run_dir / "sweep.json").read_text())
    client, trials, parent = _runs(meta)
    trials = [r for r in trials if r.data.tags["stage"] == "search"]  # not the winners' re-evaluations
    first = [r for r in trials if int(r.data.params["optuna_trial"]) < 3]
    best = max(first, key=lambda r: (r.data.metrics["selection_acc"], -int(r.data.params["epochs"]),
                                     -int(r.data.params["optuna_trial"])))
    pos = (math.log10(float(best.data.params["lr"])) + 6) / 2  # where the first round's winner sits in log lr
    cap, floor, long = pos >= 0.9, pos <= 0.1, best.data.params["epochs"] == "2"
    assert cap or floor  # -> widened
    (w,) = meta["widenings"]
    assert list(w["cells"]) == [best.data.tags["cell_id"]]
    box = w["cells"][best.data.tags["cell_id"]]
    lr = [1e-7, 1e-5] if floor else [1e-5, 1e-3] if cap else [1e-6, 1e-4]  # shifted ×10 past the edge hit
    assert box["lr"] == [pytest.approx(lr[0]), pytest.approx(lr[1])]
    assert box["epochs"] == ([2, 20] if long else [1, 2])
    assert parent.data.tags["widened_cells"] == best.data.tags["cell_id"] and parent.data.tags["widen_rounds"] == "1"
    # 3 more trials in the same study (trial numbers 3..5), inside the new box, some past the old one
    assert sorted(int(r.data.params["optuna_trial"]) for r in trials) == [0, 1, 2, 3, 4, 5]
    later = [r for r in trials if int(r.data.params["optuna_trial"]) >= 3]
    lrs = [float(r.data.params["lr"]) for r in later]
    assert all(box["lr"][0] <= x <= box["lr"][1] for x in lrs)
    assert any(x < 1e-6 or x > 1e-4 for x in lrs) or any(int(r.data.params["epochs"]) > 2 for r in later)
    md = (run_dir / "report.md").read_text()
    assert "Widened search: 1 cell(s)" in md and "round 1: lr" in md
