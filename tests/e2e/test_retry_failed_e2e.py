"""``healsweep run --resume DIR --retry-failed`` as a user meets it (the real console script, real Ray, the run
directory's SQLite MLflow store): a healer that fails while a marker file exists fails its trials (no retries
left); the sweep says how to run them again; a plain resume has nothing to do; once the fault is mended the retry
runs them (and the re-evaluation of the winner they make), their new runs replace the failed ones, and the
report quotes the cell."""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import yaml
from mlflow import MlflowClient
from mlflow.entities import ViewType

from orchestrator.rundir import records
from orchestrator.rundir.files import read_sweep
from tests.orchestrator.run_cli import healsweep

REPO = Path(__file__).resolve().parents[2]
CACHE = os.environ.get("HEALSWEEP_TEST_CACHE", str(REPO / ".healsweep" / "models"))
pytestmark = pytest.mark.e2e


def _runs(out: Path, view=ViewType.ACTIVE_ONLY) -> list:
    info = read_sweep(out)
    client = MlflowClient(info["tracking_uri"])
    exp = client.get_experiment_by_name(info["experiment"])
    return client.search_runs([exp.experiment_id], f"tags.sweep_id = '{info['sweep_id']}' and "
                                                   "tags.`healsweep.role` = 'trial'", run_view_type=view)


@pytest.mark.timeout(900)
def test_failed_trials_run_again_after_the_fault_is_mended(tmp_path):
    marks = tmp_path / "marks"
    marks.mkdir()
    (marks / "broken").touch()
    spec = {"name": "retry", "models": ["vit_digits"], "sparsities": [0.9], "calib_sizes": [128],
            "pruners": ["magnitude"], "plugins": ["tests.fault_plugins"],
            "healers": ["starfish", {"name": "test_broken", "settings": {"marker_dir": str(marks)}}],
            "search": {"trials_per_cell": 2, "lr": [1.0e-3, 3.0e-3], "epochs": [2, 3], "reevaluate": 1},
            "resources": {"max_failures": 0}}
    (tmp_path / "retry.yaml").write_text(yaml.safe_dump(spec))
    out = tmp_path / "run"
    common = ("--store", str(tmp_path / "store"), "--cache", CACHE, "--num-cpus", "2", "--quiet")
    first = healsweep("run", tmp_path / "retry.yaml", "--out", out, *common, cwd=tmp_path)
    assert first.returncode == 1, first.stderr[-3000:]  # a trial failed
    assert "3 trials finished, 2 failed" in first.stdout  # starfish: 2 + its winner's re-evaluation
    hint = f"2 failed trial(s) can run again: healsweep run --resume {out} --retry-failed"
    assert hint in first.stderr
    failed = {r.info.run_name: r.info.run_id for r in _runs(out) if r.info.status == "FAILED"}
    assert len(failed) == 2 and all(r.data.params["healer"] == "test_broken" for r in _runs(out)
                                    if r.info.status == "FAILED")

    recs = records.trials(records.scan(out / records.TRIALS_FILE))  # the record holds why (a doctor rebuild keeps it)
    assert sorted(r["mlflow"]["tags"].get("failure_reason") for r in recs.values() if r["optuna"]["state"] == "FAIL") \
        == ["RuntimeError: injected failure: the marker file 'broken' exists"] * 2

    plain = healsweep("run", "--resume", out, *common[:4], "--quiet", cwd=tmp_path)  # nothing to resume
    assert plain.returncode == 0 and "nothing to resume" in plain.stderr and hint in plain.stderr

    (marks / "broken").unlink()  # the fault mended
    again = healsweep("run", "--resume", out, "--retry-failed", *common[:4], "--quiet", cwd=tmp_path)
    assert again.returncode == 0, again.stderr[-3000:]
    assert ", 0 failed" in again.stdout and "can run again" not in again.stderr
    runs = _runs(out)
    by_name = {r.info.run_name: r for r in runs}
    assert len(by_name) == len(runs) == 6 and all(r.info.status == "FINISHED" for r in runs)  # 2 cells x (2 + 1)
    assert set(failed) <= set(by_name) and not {by_name[n].info.run_id for n in failed} & set(failed.values())
    deleted = {r.info.run_id for r in _runs(out, ViewType.DELETED_ONLY)}
    assert set(failed.values()) <= deleted  # the failed runs replaced (MLflow keeps them as deleted)
    broken = [r for r in runs if r.data.params["healer"] == "test_broken"]
    assert sorted(r.data.tags["stage"] for r in broken) == ["reevaluate", "search", "search"]
    assert all(r.data.metrics["mask_violations"] == 0 for r in broken)
    recs = records.trials(records.scan(out / records.TRIALS_FILE))
    assert len(recs) == 6 and all(r["optuna"]["state"] == "COMPLETE" for r in recs.values())
    report = (out / "report.md").read_text()
    assert "Trials: 6 (6 finished, 0 failed)" in report and "test_broken" in report
