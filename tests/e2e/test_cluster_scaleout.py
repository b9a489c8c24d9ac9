"""A cluster that grows mid-sweep: a 2-CPU node that joins after Tune started must run trials side by side with
the head's (the sweep no longer caps Tune's concurrency at the CPUs present at start)."""
from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
from mlflow import MlflowClient

from orchestrator.spec import parse_spec
from tests.cluster_fixtures import Background, add_node

pytestmark = pytest.mark.e2e
REPO = Path(__file__).resolve().parents[2]
CACHE = Path(os.environ.get("HEALSWEEP_TEST_CACHE", REPO / ".healsweep" / "models"))


def _spec(name: str, trials: int, epochs: int):
    return parse_spec({"name": name, "models": ["vit_digits"], "sparsities": [0.9], "calib_sizes": [64],
                       "pruners": ["magnitude"], "healers": ["starfish"], "resources": {"cpus_per_trial": 1},
                       "search": {"trials_per_cell": trials, "lr": [1e-3, 3e-3], "epochs": [epochs, epochs],
                                  "startup_trials": trials}})


def _trial_runs(res):
    client = MlflowClient(res.tracking_uri)
    exp = client.get_experiment_by_name("healsweep")
    return client.search_runs([exp.experiment_id], f"tags.sweep_id = '{res.sweep_id}' and "
                                                   "tags.`healsweep.role` = 'trial'")


def _max_overlap(intervals) -> int:
    events = sorted([(a, 1) for a, _ in intervals] + [(b, -1) for _, b in intervals], key=lambda e: (e[0], e[1]))
    cur = best = 0
    for _, d in events:
        cur += d
        best = max(best, cur)
    return best


def test_a_node_joining_after_tune_started_runs_trials_in_parallel(ray_cluster, tmp_path):
    from orchestrator.sweep import run_sweep

    out = tmp_path / "run"
    bg = Background(lambda: run_sweep(_spec("grow", 6, 30), out, tmp_path / "store", CACHE,
                                      address=ray_cluster.address, progress=False, report=False))
    t0 = time.monotonic()
    while not (out / "tune").exists() and bg.is_alive() and time.monotonic() - t0 < 120:
        time.sleep(0.2)  # Tune started: the cluster has only the head's 1 CPU now
    assert bg.is_alive(), "the sweep ended before Tune started"
    time.sleep(2)
    late = add_node(ray_cluster, num_cpus=2)
    res = bg.join_result(timeout=300)
    runs = _trial_runs(res)
    assert res.trials_finished == 6 and len(runs) == 6
    on_late = [r for r in runs if r.data.tags.get("node_id") == late.node_id]
    assert len(on_late) >= 2, [r.data.tags.get("node_id") for r in runs]
    # with the old cap (1 trial at a time: the head's CPU at start) the overlap could never exceed 1
    assert _max_overlap([(r.info.start_time, r.info.end_time) for r in runs]) >= 2
