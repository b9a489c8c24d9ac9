"""orchestrator/raytune/node_guard.py without Ray: the recogniser and the line. The guard on real ``ray start`` nodes whose
Python lacks the project: tests/e2e/test_cluster_scaleout.py::test_a_node_without_the_project_is_named_once_and_kept_out."""
from __future__ import annotations

import json

from orchestrator.raytune.node_guard import install_hint, missing_project, node_line

# What Ray 2.60 raises on the driver (measured on a `ray start` node whose Python lacks healsweep): a trial actor
# (Tune's ImplicitFunc wrapping orchestrator.raytune.trainable) and a task of the project.
ACTOR = """The actor died unexpectedly before finishing this task.
	class_name: ImplicitFunc
	ip: 192.0.2.2
The actor is dead because its worker process has died. Worker exit type: SYSTEM_ERROR Worker exit detail: ...
RuntimeError: The actor with name ImplicitFunc failed to import on the worker. This may be because needed library \
dependencies are not installed in the worker environment:

  File "/x/site-packages/ray/_private/function_manager.py", line 696, in _load_actor_class_from_gcs
    actor_class = pickle.loads(pickled_class)
ModuleNotFoundError: No module named 'orchestrator'
"""
TASK = """ray::worker_env() (pid=10005, ip=192.0.2.2)
RuntimeError: The remote function failed to import on the worker. This may be because needed library \
dependencies are not installed in the worker environment or cannot be found from sys.path [...]:
ModuleNotFoundError: No module named 'tasks.trial'
"""


def test_a_worker_that_cannot_import_the_project_is_recognised():
    assert missing_project(ACTOR) == "No module named 'orchestrator'"
    assert missing_project(RuntimeError(TASK)) == "No module named 'tasks.trial'"
    assert missing_project(ModuleNotFoundError("No module named 'analysis'")) == "No module named 'analysis'"


def test_other_missing_modules_and_errors_are_not_the_project():
    assert missing_project("ModuleNotFoundError: No module named 'timm'") is None  # a dependency: not ours
    assert missing_project("No module named 'tasks_extra'") is None and missing_project("No module named 'tasksx'") is None
    assert missing_project(ValueError("loss is nan")) is None and missing_project(None) is None


def test_the_node_line_says_which_node_what_is_missing_and_what_to_do():
    node = {"NodeID": "8a5249332e49b4cb01e4aa8922cd3e" * 2, "NodeManagerAddress": "10.0.0.7",
            "Resources": {"CPU": 2.0, "GPU": 1.0, "memory": 1e9}}
    line = node_line(node, "No module named 'orchestrator'")
    assert line.startswith("node 8a5249332e49 (10.0.0.7) cannot import the project (No module named 'orchestrator')")
    assert "kept out of this sweep (2 CPU, 1 GPU held)" in line and install_hint() in line and "\n" not in line
    assert "restart Ray there" in line


def test_a_node_that_does_not_see_the_run_directory_is_a_problem_only_when_it_must(tmp_path):
    """What the probe reports (``node_facts``, run here as on a node) and what the guard makes of it: the run
    directory's sweep.json must name the sweep, and the node must be able to write there (a probe file, removed);
    not asked (a remote store holds Tune's storage): no problem."""
    from orchestrator.raytune.node_guard import UNSHARED, _problem, node_facts

    run = tmp_path / "run"
    run.mkdir()
    assert node_facts()["sees_run_dir"] is None and _problem(node_facts()) is None  # not asked
    assert node_facts(str(run), "0123456789ab")["sees_run_dir"] is False
    assert _problem(node_facts(str(run), "0123456789ab")) == UNSHARED
    (run / "sweep.json").write_text(json.dumps({"sweep_id": "0123456789ab"}))
    assert node_facts(str(run), "0123456789ab")["sees_run_dir"] is True  # and could write there: nothing left
    assert _problem(node_facts(str(run), "0123456789ab")) is None and [p.name for p in run.iterdir()] == ["sweep.json"]
    assert _problem(node_facts(str(run), "ffffffffffff")) == UNSHARED  # another sweep's directory at that path
    assert _problem({"missing": ["orchestrator"], "sees_run_dir": False}) == "No module named 'orchestrator'"
    node = {"NodeID": "8a5249332e49b4cb01e4aa8922cd3e" * 2, "NodeManagerAddress": "10.0.0.7", "Resources": {"CPU": 2.0}}
    assert node_line(node, UNSHARED, str(run)) == (
        f"node 8a5249332e49 (10.0.0.7) does not see the run directory {run}: kept out of this sweep (2 CPU held); "
        "share it with the nodes (Ray Tune writes the trials' checkpoints there), or set store.uri so that the nodes "
        "need only the store (docs/scaling.md, One storage URI)")


def test_the_refusal_counts_each_kind_of_node_and_says_what_to_do():
    from orchestrator.raytune.node_guard import UNSHARED, NodeGuard

    guard = NodeGuard(run_dir="/runs/a", sweep_id="0123456789ab")
    guard.checked = {"a": UNSHARED, "b": UNSHARED, "c": "No module named 'orchestrator'", "d": None}
    assert guard.refusal() == ("no node of the cluster can run the sweep: 2 nodes without the run directory /runs/a "
                               "(share it with the nodes, or set store.uri: docs/scaling.md, One storage URI); 1 node "
                               f"that cannot import the project ({install_hint()} on them and restart Ray there)")
    guard.checked = {"c": "No module named 'tasks'"}
    assert guard.refusal() == ("no node of the cluster can run the sweep: 1 node that cannot import the project "
                               f"({install_hint()} on them and restart Ray there)")


def test_what_a_sweep_asks_for_and_whether_a_node_left_can_place_it():
    """A GPU sweep whose GPU nodes are all fenced cannot run on the CPU nodes left (before 2026-12-02 any unfenced
    node with CPUs counted, and such a sweep waited for ever); each request on its own, every kind it asks for."""
    from orchestrator.raytune.node_guard import UNSHARED, NodeGuard, placeable, requests
    from orchestrator.spec.schema import ResourceSpec

    gpu = ResourceSpec(cpus_per_trial=2, gpus_per_trial=0.25, cpus_per_dense_task=1, gpus_per_dense_task=1)
    assert requests(gpu) == {"trial": {"CPU": 2.0, "GPU": 0.25}, "dense task": {"CPU": 1.0, "GPU": 1.0}}
    assert requests(ResourceSpec()) == {"trial": {"CPU": 1.0}, "dense task": {"CPU": 1.0}}  # 0 GPU: not asked
    cpu_head, small_gpu = {"CPU": 8.0, "memory": 1e9}, {"CPU": 1.0, "GPU": 1.0}
    assert not placeable([cpu_head], {"CPU": 2.0, "GPU": 0.25}) and placeable([cpu_head], {"CPU": 2.0})
    assert not placeable([small_gpu], {"CPU": 2.0, "GPU": 0.25})  # the GPU, but one CPU: never placed
    assert placeable([cpu_head, {"CPU": 2.0, "GPU": 0.25}], {"CPU": 2.0, "GPU": 0.25})  # exactly enough
    assert not placeable([], {"CPU": 1.0}) and placeable([{}], {})
    guard = NodeGuard(run_dir="/runs/a", sweep_id="0123456789ab")
    guard.checked = {"g": UNSHARED, "h": None}
    assert guard.refusal({"trial": {"CPU": 2.0, "GPU": 0.25}}) == (
        "no node of the cluster can run the sweep: 1 node without the run directory /runs/a (share it with the "
        "nodes, or set store.uri: docs/scaling.md, One storage URI); no node left can place a trial (2 CPU, 0.25 GPU)")


def test_check_soon_asks_again_after_a_failed_or_busy_check_and_a_node_is_claimed_once():
    """A check that raises (the cluster going away) is said and ends its thread: the next request starts a new one
    (before, a dead thread kept every later check from running); a request while a check runs makes it check once
    more; a node recorded bad (by a trial's finding or a probe) is claimed once: one fence, one line."""
    import threading

    from orchestrator.raytune.node_guard import UNSHARED, NodeGuard

    said, calls, gate = [], [], threading.Event()
    guard = NodeGuard(say=said.append, run_dir="/runs/a", sweep_id="0123456789ab")

    def check():
        calls.append(len(calls))
        if len(calls) == 1:
            raise ConnectionError("GCS gone")
        gate.wait(5)  # the second check is busy while another request comes
        return []

    guard.check = check

    def settle():
        for _ in range(100):
            if (t := guard._thread) is None:
                return
            t.join(0.1)

    guard.check_soon()
    settle()
    assert calls == [0] and said == ["checking the cluster's nodes failed (ConnectionError: GCS gone); asked again "
                                     "at the next node fault"]
    guard.check_soon()  # a new thread
    for _ in range(100):
        if len(calls) == 2:
            break
        threading.Event().wait(0.05)
    guard.check_soon()  # while it is busy (its node list taken): once more afterwards
    gate.set()
    settle()
    assert calls == [0, 1, 2] and guard._thread is None
    assert guard._claim("n1", UNSHARED) and not guard._claim("n1", UNSHARED) and guard.checked == {"n1": UNSHARED}
    assert guard._claim("n2", None) and guard._claim("n2", UNSHARED)  # a node that passed can be found bad later


def test_after_release_no_check_starts_and_a_late_fence_is_removed_at_once(monkeypatch):
    """release() (the sweep is over) used to wait 60 s for a probing check and then clear the fences it held: a
    check still probing past that added its fence afterwards, which held that node's CPUs and GPUs until Ray shut
    down. Now a fence made after release is removed at once, and no check starts after release."""
    import orchestrator.raytune.node_guard as node_guard
    from orchestrator.raytune.node_guard import NodeGuard

    removed = []
    monkeypatch.setattr(node_guard, "_remove", removed.extend)  # Ray's remove_placement_group, recorded
    guard = NodeGuard(say=lambda _: None)
    early, late = object(), object()
    assert guard._keep([early]) and guard.fences == [early] and removed == []
    guard.release()
    assert removed == [early] and guard.fences == []
    assert not guard._keep([late]) and removed == [early, late] and guard.fences == []
    guard.check_soon()
    assert guard._thread is None and not guard._pending
