"""MLflow: a run directory holds all of its run (SQLite store and artifacts) so a copy keeps its artifacts; a sweep
logging to a real MLflow server on PostgreSQL, and its resume running no finished trial."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from mlflow import MlflowClient

pytestmark = pytest.mark.e2e
REPO = Path(__file__).resolve().parents[2]
CACHE = os.environ.get("HEALSWEEP_TEST_CACHE", str(REPO / ".healsweep" / "models"))
EXE = os.path.join(os.path.dirname(sys.executable), "healsweep")
RAW = {"name": "ml", "models": ["vit_digits"], "sparsities": [0.9], "calib_sizes": [64], "pruners": ["magnitude"],
       "healers": ["starfish"], "search": {"trials_per_cell": 2, "lr": [1e-3, 3e-3], "epochs": [1, 1], "reevaluate": 0}}


def _healsweep(*args, cwd, env=None, timeout=600):
    p = subprocess.run([EXE, *args], capture_output=True, text=True, cwd=cwd, timeout=timeout,
                       env={**os.environ, "MLFLOW_TRACKING_URI": "", **(env or {})})
    assert p.returncode == 0, p.stderr[-4000:]
    return p


def test_a_copied_run_directory_keeps_its_artifacts(tmp_path):
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    (tmp_path / "spec.yaml").write_text(yaml.safe_dump(RAW))
    orig = tmp_path / "orig"
    _healsweep("run", str(tmp_path / "spec.yaml"), "--out", str(orig), "--cache", CACHE, "--store",
               str(tmp_path / "store"), "--num-cpus", "1", "--quiet", cwd=cwd)
    assert not (cwd / "mlruns").exists()  # artifacts not in $PWD/mlruns
    assert (orig / "artifacts").is_dir()
    copy = tmp_path / "copy"
    shutil.copytree(orig, copy)
    shutil.rmtree(orig)  # the copy alone must be enough
    (copy / "report.md").unlink()
    _healsweep("report", str(copy), cwd=cwd)
    meta = json.loads((copy / "sweep.json").read_text())
    assert meta["tracking_uri"] == f"sqlite:///{copy.resolve() / 'mlflow.db'}"
    client = MlflowClient(meta["tracking_uri"])
    spec = json.loads(Path(client.download_artifacts(meta["parent_run_id"], "spec.json", str(tmp_path))).read_text())
    assert spec["name"] == "ml" and (copy / "report.md").exists()
    assert client.get_run(meta["parent_run_id"]).info.artifact_uri.startswith((copy.resolve() / "artifacts").as_uri())


def test_sweep_on_an_mlflow_server_backed_by_postgresql_and_its_resume(tmp_path, mlflow_server):
    (tmp_path / "spec.yaml").write_text(yaml.safe_dump({**RAW, "name": "pg"}))
    out = tmp_path / "run"
    env = {"MLFLOW_TRACKING_URI": mlflow_server}
    _healsweep("run", str(tmp_path / "spec.yaml"), "--out", str(out), "--cache", CACHE, "--store",
               str(tmp_path / "store"), "--num-cpus", "1", "--quiet", "--no-report", cwd=tmp_path, env=env)
    meta = json.loads((out / "sweep.json").read_text())
    assert meta["tracking_uri"] == mlflow_server
    client = MlflowClient(mlflow_server)
    exp = client.get_experiment_by_name("healsweep")
    flt = f"tags.sweep_id = '{meta['sweep_id']}' and tags.`healsweep.role` = 'trial'"
    runs = client.search_runs([exp.experiment_id], flt)
    assert len(runs) == 2 and all(r.info.status == "FINISHED" for r in runs)
    assert "spec.json" in [a.path for a in client.list_artifacts(meta["parent_run_id"])]  # proxied artifacts
    p = _healsweep("run", "--resume", str(out), "--quiet", "--no-report", cwd=tmp_path, env=env)
    assert "the sweep ended complete and its files are unchanged since: nothing to resume" in p.stderr
    hist = client.get_metric_history(meta["parent_run_id"], "trials_run")
    assert [m.value for m in hist] == [2.0]  # nothing started: no session logged
    data = (out / "trials.jsonl").read_bytes().splitlines(keepends=True)
    (out / "trials.jsonl").write_bytes(b"".join(data[:-1]) + data[-1][: len(data[-1]) // 2])  # a torn last record
    _healsweep("run", "--resume", str(out), "--quiet", "--no-report", "--num-cpus", "1", cwd=tmp_path, env=env)
    parent = client.get_run(meta["parent_run_id"])
    hist = client.get_metric_history(meta["parent_run_id"], "trials_run")
    assert sorted(m.value for m in hist) == [1.0, 2.0]  # the resume ran the torn trial again, no finished one
    assert parent.info.status == "FINISHED"
    runs = client.search_runs([exp.experiment_id], flt)
    assert len(runs) == 2 and all(r.info.status == "FINISHED" for r in runs)  # its run replaced, not doubled
