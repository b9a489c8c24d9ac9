"""Tune schedulers that never hand a freed actor a trial whose own actor is already starting.

With ``reuse_actors`` Ray Tune (2.60) gives a freed trial actor the trial its scheduler's ``choose_trial_to_run``
returns (``TuneController._maybe_add_actors``, step 1). Tune's FIFO (and ASHA, a FIFO subclass) returns the oldest
PENDING trial; when that trial's own actor already holds resources and is starting (a node that joined while the
sweep runs: an actor takes seconds to import torch, timm and Tune), ``_maybe_reuse_cached_actor`` removes the
starting actor (its placement group is removed, the process gets SIGTERM) and the trial runs on the freed actor.
With trials of a few seconds a reused actor on the old nodes always frees first, so a late node's actors were
killed one after the other and it ran no trial. Here the scheduler passes over such trials: the oldest PENDING
trial whose actor holds no resources yet (none requested, or its request still waiting) takes the freed actor;
Tune cancels that trial's waiting request, which starts no process. On a cluster that does not change, the choice
is FIFO's whenever no actor is starting.

This reads two TuneController internals (``_trial_to_actor``, ``_actor_manager.is_actor_started``) through the
``TrialRunnerWrapper`` Tune passes to schedulers; pyproject pins the Ray versions they were checked on and
tests/e2e/test_trial_scheduler.py fails on a real TuneController if they change.
"""
from __future__ import annotations

from ray.tune.experiment import Trial
from ray.tune.schedulers import ASHAScheduler, FIFOScheduler


def actor_holding(controller) -> set:
    """PENDING trials of ``controller`` (a TuneController, or the wrapper Tune hands schedulers) whose own actor
    already holds its resources: starting, or being reset for the trial."""
    ctl = getattr(controller, "_tune_controller", controller)
    started = ctl._actor_manager.is_actor_started
    return {t for t, actor in ctl._trial_to_actor.items() if t.status == Trial.PENDING and started(actor)}


class SparesStartingActors:
    """Mixin for a FIFO-ordered ``TrialScheduler``: ``choose_trial_to_run`` skips PENDING trials whose actor holds
    resources (see the module docstring); then PAUSED trials, as Tune's FIFO."""

    def choose_trial_to_run(self, tune_controller) -> Trial | None:
        trials = tune_controller.get_trials()
        holding = None
        for trial in trials:
            if trial.status == Trial.PENDING:
                holding = actor_holding(tune_controller) if holding is None else holding
                if trial not in holding:
                    return trial
        return next((t for t in trials if t.status == Trial.PAUSED), None)


class FIFO(SparesStartingActors, FIFOScheduler):
    """Tune's FIFO order, sparing starting actors."""


class ASHA(SparesStartingActors, ASHAScheduler):
    """Tune's asynchronous successive halving (its decisions unchanged), sparing starting actors."""
