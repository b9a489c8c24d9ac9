"""A freed trial actor never replaces a trial's own actor that is already starting.

With ``reuse_actors`` Ray Tune (2.60) hands a freed (cached) trial actor to a PENDING trial in
``TuneController._maybe_add_actors``: first the trial its scheduler's ``choose_trial_to_run`` returns (FIFO and ASHA:
the oldest PENDING trial), then, while an actor is still cached, any PENDING trial (``_resources_to_pending_trials``,
a set: an arbitrary one). Both go through ``_maybe_reuse_cached_actor``, which removes the trial's own actor when it
has one, even one that already holds its resources and is starting (its placement group is removed, the process gets
SIGTERM). A node that joins a running sweep starts actors for PENDING trials; an actor takes seconds to start
(imports of torch, timm and Tune) and a trial lasts seconds, so a reused actor on the old nodes always freed first
and took the trial: the late node's actors were killed one after the other and it ran no trial (0 of 32 measured).
No scheduler can prevent the second path, and Tune has no setting for it.

:func:`spare_starting_actors` wraps ``TuneController._maybe_reuse_cached_actor``: a trial whose own actor holds
resources (starting, not failed) keeps it; the cached actor stays cached and goes to another PENDING trial (one
whose actor request still waits: Tune cancels that request, which starts no process) or to the next trial the
searcher hands out. Every other case is Tune's own code.

It also keeps freed actors while the searcher may still hand out trials (:class:`KeepWhileSearching`). Tune caches a
freed actor only when a staged trial needs one (plus one actor in all): a searcher that hands out trials in waves
(a cell's next trial waits for its earlier ones) has none staged when a wave ends, so every actor but one was
stopped and the next wave started new ones (seconds each; on a node that joined, every trial it ran cost an actor
start). Kept actors hold their CPUs only until the next wave takes them; once the searcher is finished Tune's own
policy applies again.

Both rely on TuneController internals (``__init__``'s ``_actor_cache``, ``_maybe_reuse_cached_actor``,
``_trial_to_actor``, ``_resetting_trials``, ``_search_alg``, ``_actor_manager.is_actor_started``): pyproject pins the
Ray versions they were checked on, and tests/e2e/test_actor_reuse.py fails on a real TuneController when they
change or when Tune changes how a freed actor picks its trial.
"""
from __future__ import annotations

from ray.tune.utils.object_cache import _ObjectCache

_MARK = "_healsweep_spares_starting_actors"


def spare_starting_actors() -> None:
    """Install both on Ray Tune's TuneController (idempotent; the sweep calls it before every Tuner)."""
    from ray.tune.execution.tune_controller import TuneController

    tune_reuse, tune_init = TuneController._maybe_reuse_cached_actor, TuneController.__init__
    if getattr(tune_reuse, _MARK, False):
        return

    def _maybe_reuse_cached_actor(self, trial) -> bool:
        if holds_starting_actor(self, trial):
            return False  # keep the starting actor; the cached one stays for another trial
        return tune_reuse(self, trial)

    def __init__(self, *args, **kwargs):
        tune_init(self, *args, **kwargs)
        self._actor_cache = KeepWhileSearching(lambda: not self._search_alg.is_finished())

    setattr(_maybe_reuse_cached_actor, _MARK, True)
    _maybe_reuse_cached_actor.tune_reuse, __init__.tune_init = tune_reuse, tune_init
    TuneController._maybe_reuse_cached_actor, TuneController.__init__ = _maybe_reuse_cached_actor, __init__


class KeepWhileSearching(_ObjectCache):
    """Tune's actor cache that, while ``searching()``, caches every freed actor and evicts none."""

    def __init__(self, searching):
        super().__init__(may_keep_one=True)
        self._searching = searching

    def cache_object(self, key, obj) -> bool:
        if not self._searching():
            return super().cache_object(key, obj)
        self._cached_objects[key].append(obj)
        self._num_cached_objects += 1
        return True

    def flush_cached_objects(self, force_all: bool = False):
        if force_all or not self._searching():
            yield from super().flush_cached_objects(force_all=force_all)


def holds_starting_actor(controller, trial) -> bool:
    """True when ``trial``'s own actor holds its resources (starting, or being reset) and has not failed."""
    actor = controller._trial_to_actor.get(trial)
    return (actor is not None and trial not in controller._resetting_trials
            and controller._actor_manager.is_actor_started(actor))
