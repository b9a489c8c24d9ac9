"""A cluster that grows mid-sweep, with real ``ray start`` processes and short trials (the tiny spec with 8 trials
per cell: 32 trials of a few seconds, as the default sweep's): a 1-CPU head, the sweep through the console script
with ``--address``, and a 2-CPU node started on 127.0.0.1 once the first trials are COMPLETE. Read back from MLflow
(node id tag of each trial): the late node runs at least a third of the trials that start after it joined, no
trial runs twice or fails, and none of the late node's trial actors is stopped before it ran a trial (Ray's worker
logs). Before the fix the late node ran 0 of 32: a freed actor on the head took the trial whose actor was still
starting there, and Tune removed that actor."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.ray_nodes import (REPO, completed, join_after, kill_node_after, python_without_project, run_on_nodes,
                             scaleout_spec)

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]
CACHE = Path(os.environ.get("HEALSWEEP_TEST_CACHE", REPO / ".healsweep" / "models"))
JOIN_AFTER = 3  # trials COMPLETE before the second node starts


def test_a_node_joining_mid_sweep_takes_its_share_of_short_trials(tmp_path):
    spec = scaleout_spec(tmp_path / "spec.yaml")
    r = run_on_nodes(spec, tmp_path, tmp_path / "store", CACHE, head_cpus=1, event=join_after(JOIN_AFTER, 2))
    t = r.trials
    assert sum(r.data.tags.get("stage") != "reevaluate" for r in t.runs) == 32  # + the winners' re-evaluations
    assert len(set(t.trial_ids)) == len(t.runs) == completed(tmp_path / "run")  # each told to Optuna once
    assert t.failed == 0 and t.run_twice == 0, [(r.data.tags.get("trial_id"), r.info.status) for r in t.runs]
    assert set(t.per_node()) <= {r.head_id, r.late_id}  # every trial has the node id it ran on
    after = t.per_node(r.event_ms)
    assert sum(after.values()) >= 16, after  # the node joined while most of the sweep was still ahead
    assert 3 * after.get(r.late_id, 0) >= sum(after.values()), after
    assert r.started_actors[r.late_id] >= 1 and r.killed_actors[r.late_id] == 0, r


def test_a_node_dying_mid_trial_loses_nothing(tmp_path):
    """A 1-CPU head and a 2-CPU node; the node is killed (SIGKILL, every process of it) once it finished a trial,
    so it dies while running (or being handed) its next ones: their attempts are retried on the head without
    counting against max_failures, every trial finishes once, with one MLflow child run each (the retried ones
    tagged ``retries`` and ``node_faults``), and the sweep exits 0 (run_on_nodes raises otherwise). Before
    orchestrator/raytune/trial_faults.py (2026-11-24): the 2 trials the node held ended FAILED with no child run within
    milliseconds of the kill (Tune handled one actor error twice), the sweep exited 1 (14 of 16 finished)."""
    spec = scaleout_spec(tmp_path / "spec.yaml", trials_per_cell=4)
    r = run_on_nodes(spec, tmp_path, tmp_path / "store", CACHE, head_cpus=1, node_cpus=2, event=kill_node_after(1))
    t = r.trials
    assert sum(x.data.tags.get("stage") != "reevaluate" for x in t.runs) == 16
    assert len(set(t.trial_ids)) == len(t.runs) == completed(tmp_path / "run") and t.failed == 0  # told once each
    retried = [x for x in t.runs if x.data.tags.get("retries")]
    log = (tmp_path / "sweep.log").read_text()
    lost = [ln for ln in log.splitlines() if "lost its actor: its node" in ln]
    assert retried or lost, "the node died between trials: nothing was running on it"
    for x in retried:  # started on the node, finished on the head; the node's loss did not use max_failures
        assert x.data.tags["node_id"] == r.head_id and int(x.data.tags["node_faults"]) >= 1, x.data.tags
    assert len(lost) >= len(retried) and all("retrying it on another node" in ln for ln in lost), lost
    assert not [ln for ln in log.splitlines() if "retrying it (attempt" in ln]  # one line per loss, not two
    assert "Traceback" not in log, log[-3000:]  # one line per lost trial, not Tune's traceback
    # nothing ran on the dead node after it died: every trial whose final result came from it ended before the kill
    # (``finished_at``: the node's clock; MLflow's run start time is the driver writer's, which may lag the trial)
    late = [(x.data.tags["trial_id"], x.data.metrics["finished_at"] * 1000 - r.event_ms) for x in t.runs
            if x.data.tags["node_id"] != r.head_id and x.data.metrics["finished_at"] * 1000 > r.event_ms]
    assert late == [], late


@pytest.fixture(scope="module")
def bare_python(tmp_path_factory) -> str:
    """This environment's Python without the project (Ray, torch, timm, ... but no healsweep)."""
    return python_without_project(tmp_path_factory.mktemp("bare-env"))


def _missing_project_lines(work: Path) -> list[str]:
    log = (work / "sweep.log").read_text()
    assert "Traceback" not in log, log[-3000:]  # Ray's import traceback is not shown, nor Tune's
    return [ln for ln in log.splitlines() if "cannot import the project" in ln]


@pytest.mark.parametrize("when", ["at start", "joining after 3 trials"])
def test_a_node_without_the_project_is_named_once_and_kept_out(tmp_path, bare_python, when):
    """A 1-CPU head and a 2-CPU node whose Python lacks healsweep (ray start from a venv with every other package),
    there from the start or joining mid-sweep; the driver runs outside the checkout (Ray puts its working directory
    on every worker's sys.path). One line names the node, what is missing and what to do; the node gets no work;
    every trial finishes once on the head and the sweep exits 0."""
    spec = scaleout_spec(tmp_path / "spec.yaml", trials_per_cell=4)
    kw = (dict(node_cpus=2, node_python=bare_python) if when == "at start"
          else dict(event=join_after(3, 2, python=bare_python)))
    r = run_on_nodes(spec, tmp_path, tmp_path / "store", CACHE, head_cpus=1, cwd=tmp_path, **kw)
    t = r.trials
    assert sum(x.data.tags.get("stage") != "reevaluate" for x in t.runs) == 16
    assert len(set(t.trial_ids)) == len(t.runs) == completed(tmp_path / "run") and t.failed == 0
    assert set(t.per_node()) == {r.head_id}  # nothing ran on the node without the project
    [line] = _missing_project_lines(tmp_path)  # once for that node
    assert f"node {r.late_id[:12]} " in line and "(No module named 'orchestrator')" in line, line
    assert "kept out of this sweep (2 CPU held)" in line and "install healsweep" in line, line
    assert r.killed_actors[r.late_id] == r.started_actors[r.late_id]  # its actors (if any) never ran a trial
