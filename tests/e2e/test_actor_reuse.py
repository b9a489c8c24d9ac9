"""orchestrator/raytune/actor_reuse.py on a real TuneController, real Trials and real Ray actors (2 CPUs): trial A runs,
trial B's actor holds the second CPU and is still starting (a slow constructor, like an actor on a node that just
joined), and trial C, when there is one, waits for a CPU. When A ends, its freed (reused) actor must leave B's
starting actor alone: it takes C, or stays cached when B is the only PENDING trial. Tune's own code hands it B and
stops B's starting actor: asserted too, so this test fails when the Tune internals the guard reads change or when
Tune itself changes how a freed actor picks its trial."""
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

    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    try:
        yield
    finally:
        ray.shutdown()


def _step_until(ctl, cond, what: str, timeout: float = 120):
    t0 = time.monotonic()
    while not cond():
        assert time.monotonic() - t0 < timeout, f"timed out waiting for {what}"
        ctl.step()


def _scheduler(kind: str):
    from ray.tune.schedulers import ASHAScheduler, FIFOScheduler

    if kind == "asha":
        return ASHAScheduler(metric="score", mode="max", time_attr="training_iteration", max_t=1)
    return FIFOScheduler()


@pytest.mark.parametrize("guard,kind,waiting", [(True, "fifo", True), (True, "asha", True), (True, "fifo", False),
                                                (False, "fifo", True), (False, "fifo", False)])
def test_a_freed_actor_never_replaces_a_starting_actor(ray_2cpu, tmp_path, monkeypatch, guard, kind, waiting):
    from ray.train._internal.storage import StorageContext
    from ray.tune import PlacementGroupFactory
    from ray.tune.execution.tune_controller import TuneController
    from ray.tune.experiment import Trial
    from ray.tune.registry import register_trainable

    from orchestrator.raytune.actor_reuse import holds_starting_actor, spare_starting_actors

    spare_starting_actors()
    if not guard:  # Tune's own code
        monkeypatch.setattr(TuneController, "_maybe_reuse_cached_actor",
                            TuneController._maybe_reuse_cached_actor.tune_reuse)
    monkeypatch.setenv("TUNE_MAX_PENDING_TRIALS_PG", "8")
    register_trainable("hs_gated", _trainable())
    storage = StorageContext(storage_path=str(tmp_path / "tune"), experiment_dir_name="exp")
    ctl = TuneController(scheduler=_scheduler(kind), storage=storage, reuse_actors=True)
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
        _step_until(ctl, lambda: holds_starting_actor(ctl, b), "B's actor holding the second CPU")
        if waiting:
            ctl.add_trial(c)  # no CPU left: its actor request waits
            _step_until(ctl, lambda: c in ctl._trial_to_actor, "C's actor requested")
            assert not holds_starting_actor(ctl, c) and c.status == Trial.PENDING
        a_actor, b_actor = ctl._trial_to_actor[a], ctl._trial_to_actor[b]
        c_request = ctl._trial_to_actor.get(c)
        gate.touch()  # A ends; its actor is cached for reuse
        _step_until(ctl, lambda: a.status == Trial.TERMINATED, "A finished")
        took = []  # the trials A's freed actor was handed, in order
        for _ in range(20):  # 20 controller steps (>= 2 s): time for Tune to hand the cached actor out
            if ctl.is_finished():
                break
            ctl.step()
            t = ctl._actor_to_trial.get(a_actor)
            if t is not None and t not in took:
                took.append(t)
        if not guard:  # the race: B takes A's actor and B's starting actor is stopped before it ran a trial
            assert took[0] is b and b_actor not in ctl._actor_to_trial and b_actor in ctl._stopping_actors
            return
        assert ctl._trial_to_actor[b] is b_actor and b_actor in am.live_actors  # B's actor keeps starting
        assert b.status == Trial.PENDING
        if waiting:  # the trial whose request was waiting took the freed actor; its request was cancelled
            assert took == [c] and c_request not in am.pending_actors
            assert c.status in (Trial.RUNNING, Trial.TERMINATED)
        else:  # nothing else to run: the freed actor stays cached for the next trial
            assert not took and ctl._actor_cache.num_cached_objects == 1
    finally:
        ctl.cleanup()


def test_freed_actors_are_kept_while_the_searcher_may_hand_out_trials():
    from orchestrator.raytune.actor_reuse import KeepWhileSearching

    searching = [True]
    cache = KeepWhileSearching(lambda: searching[0])
    assert cache.cache_object("1cpu", "a1") and cache.cache_object("1cpu", "a2")  # no trial staged: kept anyway
    assert list(cache.flush_cached_objects()) == [] and cache.num_cached_objects == 2
    assert cache.pop_cached_object("1cpu") == "a1" and cache.num_cached_objects == 1
    cache.cache_object("1cpu", "a1")
    searching[0] = False  # the searcher is finished: Tune's policy (nothing staged: no more than one kept)
    assert not cache.cache_object("1cpu", "a3")
    assert list(cache.flush_cached_objects()) == ["a2", "a1"] and cache.num_cached_objects == 0
    assert cache.cache_object("1cpu", "a3") and list(cache.flush_cached_objects()) == []  # keeps one
