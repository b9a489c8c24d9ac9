"""orchestrator/trial_scheduler.py on a real TuneController, real Trials and real Ray actors (2 CPUs): trial A
runs, trial B's actor holds its CPU and is still starting (a slow constructor, like a node that just joined), trial
C waits for a CPU. When A ends, its freed (reused) actor must take C and leave B's starting actor alone. Tune's own
FIFO hands it B and removes B's starting actor: that case is asserted too, so this test fails when the Tune
internals the scheduler reads change or when Tune itself changes how a freed actor picks its trial."""
from __future__ import annotations

import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]


def _trainable():
    """A trainable whose constructor sleeps ``setup_s`` and whose one step waits for the file ``gate``."""
    from ray import tune

    class Gated(tune.Trainable):
        def setup(self, config):
            time.sleep(config["setup_s"])

        def step(self):
            while not Path(self.config["gate"]).exists():
                time.sleep(0.05)
            return {"score": 1.0, "done": True}

        def reset_config(self, new_config):
            return True

    return Gated


@pytest.fixture(scope="module")
def ray_2cpu():
    import ray

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    try:
        yield
    finally:
        ray.shutdown()


def _step_until(ctl, cond, what: str, timeout: float = 120):
    t0 = time.monotonic()
    while not cond():
        assert time.monotonic() - t0 < timeout, f"timed out waiting for {what}"
        ctl.step()


def _make_scheduler(kind: str):
    from ray.tune.schedulers import FIFOScheduler

    from orchestrator.trial_scheduler import ASHA, FIFO

    if kind == "tune_fifo":
        return FIFOScheduler()
    if kind == "fifo":
        return FIFO()
    return ASHA(metric="score", mode="max", time_attr="training_iteration", max_t=1)


@pytest.mark.parametrize("kind", ["fifo", "asha", "tune_fifo"])
def test_a_freed_actor_never_takes_a_trial_whose_actor_is_starting(ray_2cpu, tmp_path, monkeypatch, kind):
    from ray.train._internal.storage import StorageContext
    from ray.tune import PlacementGroupFactory
    from ray.tune.execution.tune_controller import TuneController
    from ray.tune.experiment import Trial
    from ray.tune.registry import register_trainable

    from orchestrator.trial_scheduler import actor_holding

    monkeypatch.setenv("TUNE_MAX_PENDING_TRIALS_PG", "8")
    register_trainable("hs_gated", _trainable())
    storage = StorageContext(storage_path=str(tmp_path / "tune"), experiment_dir_name="exp")
    ctl = TuneController(scheduler=_make_scheduler(kind), storage=storage, reuse_actors=True)
    gate = tmp_path / "gate"

    def trial(setup_s: float):
        return Trial("hs_gated", config={"setup_s": setup_s, "gate": str(gate)}, storage=storage,
                     placement_group_factory=PlacementGroupFactory([{"CPU": 1}]))

    a, b, c = trial(0), trial(120), trial(0)
    am = ctl._actor_manager
    try:
        ctl.add_trial(a)
        _step_until(ctl, lambda: a.status == Trial.RUNNING, "A running")
        ctl.add_trial(b)  # its actor takes the second CPU and stays in its constructor
        _step_until(ctl, lambda: b in ctl._trial_to_actor and am.is_actor_started(ctl._trial_to_actor[b]),
                    "B's actor holding the second CPU")
        ctl.add_trial(c)  # no CPU left: its actor request waits
        _step_until(ctl, lambda: c in ctl._trial_to_actor, "C's actor requested")
        a_actor, b_actor, c_request = ctl._trial_to_actor[a], ctl._trial_to_actor[b], ctl._trial_to_actor[c]
        assert b.status == c.status == Trial.PENDING and not am.is_actor_started(c_request)
        assert actor_holding(ctl) == {b}
        gate.touch()  # A ends; its actor is cached for reuse
        _step_until(ctl, lambda: a.status == Trial.TERMINATED and a_actor in ctl._actor_to_trial,
                    "A's actor reused")
        if kind == "tune_fifo":  # the race: B takes A's actor and B's starting actor is removed
            assert ctl._actor_to_trial[a_actor] is b and b_actor not in ctl._actor_to_trial
            assert b_actor in ctl._stopping_actors  # stopped before it ever ran a trial
            return
        assert ctl._actor_to_trial[a_actor] is c  # the trial whose request was waiting takes the freed actor
        assert ctl._trial_to_actor[b] is b_actor and b_actor in am.live_actors  # B's actor keeps starting
        assert c_request not in am.pending_actors  # C's waiting request cancelled: no process was started for it
        _step_until(ctl, lambda: c.status == Trial.TERMINATED, "C finished on A's actor")
        assert b.status == Trial.PENDING and ctl._trial_to_actor[b] is b_actor
    finally:
        ctl.cleanup()
