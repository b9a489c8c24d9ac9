"""orchestrator/raytune/trial_faults.py on a real TuneController, real Trials and real Ray actors on a real multi-node Ray
(ray.cluster_utils.Cluster: a head for the driver and two 1-CPU worker nodes, each its own raylet).

* A freed (cached) actor whose process dies before it is handed to the next trial: Tune's ``reset`` on it fails
  with an actor error that Tune handles twice (its actor callback, then its task callback). With the wrap it is one
  failure and the trial is retried on a new actor; Tune's own code is asserted too (the trial ends ERROR after one
  actor error, two failures counted, the searcher told it failed), so this test fails when Tune changes it.
* A trial whose node is killed (its raylet SIGKILLed) while it runs: retried on the other node although
  ``max_failures`` is 0, the loss announced in one line; Tune's own code ends it ERROR.
"""
from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]


def _trainable():
    """Step 1 reports where it runs; step 2 waits for the file ``gate`` (when given) and ends the trial there."""
    from ray import tune

    class Gated(tune.Trainable):
        def step(self):
            import ray

            node = ray.get_runtime_context().get_node_id()
            if self.iteration == 0:
                return {"score": 0.0, "node": node}
            while self.config.get("gate") and not Path(self.config["gate"]).exists():
                time.sleep(0.05)
            return {"score": 1.0, "node": node, "done": True}

        def reset_config(self, new_config):
            return True

    return Gated


@pytest.fixture(scope="module")
def cluster():
    import ray
    from ray.cluster_utils import Cluster

    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})
    for _ in range(2):
        c.add_node(num_cpus=1)
    ray.init(address=c.address, include_dashboard=False, log_to_driver=False, configure_logging=False)
    try:
        c.wait_for_nodes()
        yield c
    finally:
        ray.shutdown()
        c.shutdown()


def _step_until(ctl, cond, what: str, timeout: float = 120):
    t0 = time.monotonic()
    while not cond():
        assert time.monotonic() - t0 < timeout, f"timed out waiting for {what}"
        ctl.step()


def _controller(tmp_path, monkeypatch, guard: bool):
    """A TuneController with healsweep's wraps installed (or Tune's own methods back when not ``guard``), the lines
    trial_faults prints and the searcher's tells recorded."""
    from ray.train._internal.storage import StorageContext
    from ray.tune.execution.tune_controller import TuneController
    from ray.tune.experiment.trial import Trial
    from ray.tune.registry import register_trainable
    from ray.tune.schedulers import FIFOScheduler

    from orchestrator.raytune import trial_faults
    from orchestrator.raytune.actor_reuse import spare_starting_actors

    spare_starting_actors()
    trial_faults.install()
    lines: list[str] = []
    monkeypatch.setattr(trial_faults, "_say", lines.append)
    if not guard:  # Tune's own code
        monkeypatch.setattr(TuneController, "_trial_task_failure", TuneController._trial_task_failure.tune_failure)
        monkeypatch.setattr(Trial, "_handle_ray_actor_error", Trial._handle_ray_actor_error.tune_actor_error)
    register_trainable("hs_gated_faults", _trainable())
    storage = StorageContext(storage_path=str(tmp_path / "tune"), experiment_dir_name="exp")
    ctl = TuneController(scheduler=FIFOScheduler(), storage=storage, reuse_actors=True)
    monkeypatch.setattr(ctl._search_alg, "is_finished", lambda: False)  # more trials may come: actors are kept
    tells: list[tuple[str, bool]] = []
    tune_tell = ctl._search_alg.on_trial_complete
    monkeypatch.setattr(ctl._search_alg, "on_trial_complete",
                        lambda trial_id, result=None, error=False: (tells.append((trial_id, error)),
                                                                    tune_tell(trial_id, result=result, error=error)))
    return ctl, storage, lines, tells


@pytest.mark.parametrize("guard", [True, False])
def test_a_dead_cached_actor_is_one_failure_and_the_trial_is_retried(cluster, tmp_path, monkeypatch, guard):
    from ray.tune import PlacementGroupFactory
    from ray.tune.experiment import Trial

    ctl, storage, lines, tells = _controller(tmp_path, monkeypatch, guard)
    trial = lambda: Trial("hs_gated_faults", config={}, storage=storage, max_failures=2,  # noqa: E731
                          placement_group_factory=PlacementGroupFactory([{"CPU": 1}]))
    a, b = trial(), trial()
    try:
        ctl.add_trial(a)
        _step_until(ctl, lambda: a.status == Trial.TERMINATED, "A finished")
        assert ctl._actor_cache.num_cached_objects == 1  # A's actor kept for the next trial
        os.kill(a.last_result["pid"], signal.SIGKILL)  # the cached actor's process dies
        while Path(f"/proc/{a.last_result['pid']}").exists():
            time.sleep(0.05)
        ctl.add_trial(b)  # handed the dead cached actor: its reset fails with ActorDiedError
        _step_until(ctl, lambda: b.status in (Trial.TERMINATED, Trial.ERROR), "B done")
        b_tells = [e for t, e in tells if t == b.trial_id]
        if not guard:  # Tune: the one actor error counted twice, the requeued trial failed, told as an error
            assert b.status == Trial.ERROR and b.run_metadata.num_failures == 2 and b_tells == [True]
            return
        assert b.status == Trial.TERMINATED and b.run_metadata.num_failures == 1, b.run_metadata.num_failures
        assert b_tells == [False] and b not in ctl._resetting_trials  # told once, as complete
        assert b.last_result["pid"] != a.last_result["pid"]  # on a new actor
        assert not lines  # a process that died on a live node is not a node fault: counted, no line
    finally:
        ctl.cleanup()


@pytest.mark.parametrize("guard", [True, False])
def test_a_trial_whose_node_dies_is_retried_on_another_node(cluster, tmp_path, monkeypatch, guard):
    from ray.tune import PlacementGroupFactory
    from ray.tune.experiment import Trial

    from orchestrator.raytune.trial_faults import NODE_FAULT_RETRIES, node_faults

    c = cluster
    if len(c.worker_nodes) < 2:  # the other parametrization killed one: a fresh node
        c.add_node(num_cpus=1)
        c.wait_for_nodes()
    ctl, storage, lines, tells = _controller(tmp_path, monkeypatch, guard)
    gate = tmp_path / "gate"
    a = Trial("hs_gated_faults", config={"gate": str(gate)}, storage=storage, max_failures=0,
              placement_group_factory=PlacementGroupFactory([{"CPU": 1}]))
    try:
        ctl.add_trial(a)
        _step_until(ctl, lambda: a.status == Trial.RUNNING and "node" in (a.last_result or {}), "A running")
        first = a.last_result["node"]
        [victim] = [n for n in c.worker_nodes if n.node_id == first]
        c.remove_node(victim, allow_graceful=False)  # its raylet SIGKILLed: every worker there goes with it
        _step_until(ctl, lambda: a.status != Trial.RUNNING, "A's actor lost")  # requeued (PENDING) or ERROR
        gate.touch()  # only now: the lost attempt must not finish first
        _step_until(ctl, lambda: a.status in (Trial.TERMINATED, Trial.ERROR), "A done", timeout=180)
        if not guard:  # Tune: the lost node counts as the trial's failure; max_failures 0 ends it
            assert a.status == Trial.ERROR and [e for t, e in tells if t == a.trial_id] == [True]
            return
        assert a.status == Trial.TERMINATED and a.run_metadata.num_failures == 0, a.run_metadata.num_failures
        assert node_faults(a) == 1 and a.last_result["node"] != first
        assert len(lines) == 1 and "lost its actor: its node" in lines[0], lines
        assert f"node fault 1 of {NODE_FAULT_RETRIES}" in lines[0], lines
        assert [e for t, e in tells if t == a.trial_id] == [False]
    finally:
        ctl.cleanup()
