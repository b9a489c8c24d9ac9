"""End to end: search.converge on a real sweep (Ray Tune): the searcher ends the sweep when every cell has stopped
(fewer trials than Tune's planned count), each cell's stop reason reaches the report, and the parent run logs the
settings (docs/methods.md#search-design)."""
from __future__ import annotations

import json
import os
from dataclasses import asdict
from pathlib import Path

import pytest
import yaml
from mlflow import MlflowClient

from analysis.search_stops import search_stops
from orchestrator.cli import main as cli_main
from orchestrator.spec.schema import Converge

REPO = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]
CACHE = os.environ.get("HEALSWEEP_TEST_CACHE", str(REPO / ".healsweep" / "models"))


def test_a_converging_sweep_stops_its_cells_and_the_report_says_why(tmp_path):
    spec = {"name": "converge", "models": ["vit_digits"], "sparsities": [0.5, 0.9, 0.95], "calib_sizes": [64],
            "pruners": ["magnitude"], "healers": ["starfish", "none"], "seeds": [0],
            "search": {"trials_per_cell": 5, "lr": [1.0e-3, 1.0e-2], "steps": [4, 16], "lattice": [3, 3],
                       "reevaluate": 2, "converge": {"batch": 2, "reevaluate_max": 3}}}
    (tmp_path / "spec.yaml").write_text(yaml.safe_dump(spec))
    run_dir = tmp_path / "run"
    rc = cli_main(["run", str(tmp_path / "spec.yaml"), "--out", str(run_dir), "--store", str(tmp_path / "store"),
                   "--cache", CACHE, "--num-cpus", "2", "--quiet"])
    assert rc == 0
    meta = json.loads((run_dir / "sweep.json").read_text())
    client = MlflowClient(meta["tracking_uri"])
    exp = client.get_experiment_by_name("healsweep")
    runs = client.search_runs([exp.experiment_id], f"tags.sweep_id = '{meta['sweep_id']}'")
    parent = [r for r in runs if r.data.tags.get("healsweep.role") == "sweep"][0]
    logged = json.loads(parent.data.params["search_converge"])  # every setting resolved, the defaults included
    assert logged == {**asdict(Converge()), "batch": 2, "reevaluate_max": 3} and logged["widen_growth"] == 2
    trials = [r for r in runs if r.data.tags.get("healsweep.role") == "trial"]
    stops = search_stops(run_dir)
    star = {r.data.tags["cell_id"] for r in trials if r.data.params["healer"] == "starfish"}
    assert set(stops) == star  # every searched cell recorded why it stopped; `none` searches nothing
    for cid, rec in stops.items():
        n = sum(r.data.tags["cell_id"] == cid and r.data.tags["stage"] == "search" for r in trials)
        assert 2 <= n <= 5 and rec["trials"] == n
        assert rec["reason"].startswith(("converged", "cap", "recovered"))
        mine = [r for r in trials if r.data.tags["cell_id"] == cid and r.data.tags["stage"] == "search"]
        dense = {r.data.metrics["dense_selection_acc"] for r in mine}  # every trial reports the dense model's
        assert len(dense) == 1 and 0.9 < dense.pop() <= 1
        if rec["reason"].startswith("recovered"):  # rule 0: stopped after the first wave, at the dense accuracy
            top = max(r.data.metrics["selection_acc"] for r in mine)
            assert n == 2 and top >= mine[0].data.metrics["dense_selection_acc"] - 0.02, rec
        again = sum(r.data.tags["cell_id"] == cid and r.data.tags["stage"] == "reevaluate" for r in trials)
        assert 2 <= again <= 3 and again == rec["reevaluate_target"]
    assert any(r["reason"].startswith("recovered") for r in stops.values())  # sparsity 0.5 recovers
    assert not all(r["reason"].startswith("recovered") for r in stops.values())  # 0.95 does not
    md = (run_dir / "report.md").read_text()
    assert "Why each cell's search stopped" in md and "Budget: bands and leads hold within 16 optimizer steps" in md
