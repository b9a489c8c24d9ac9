"""A trial whose actor is lost with its node is retried elsewhere, not failed.

Measured (2026-11-24, Ray 2.60, a 1-CPU head and a 2-CPU ``ray start`` node SIGKILLed mid-sweep): the trials the
node was given ended ERROR within milliseconds of the kill, long before Ray marked the node dead (~20 s), with no
MLflow child run and the sweep exiting 1, although ``resources.max_failures`` was 2. Tune's debug log shows why:

1. **One actor error, two failures.** With ``reuse_actors`` a trial is handed a freed (cached) actor and stays
   PENDING while Tune's ``reset`` task runs on it. When that actor is gone (its node died), the ``reset`` future
   fails with a ``RayActorError`` and Ray Tune's ``ActorManager`` calls two callbacks with the same exception: the
   actor's (``TuneController._actor_failed``: the trial is PENDING, "failed in its creation task", so it is
   processed as a failure: counted, recovered, requeued PENDING) and then the task's (``_trial_task_failure``:
   the same error processed again, now on a PENDING trial, which ``_process_trial_failure`` never recovers: it is
   told to the searcher as an error and ends ERROR). ``max_failures`` never gets a say.
2. **A stale reset.** The trial also stays in ``_resetting_trials`` (only a successful reset removes it), so even
   a correctly requeued trial would never get an actor: ``_maybe_reuse_cached_actor`` returns True for it and
   nothing is scheduled (it waits forever).
3. **Node faults count as the trial's failures.** A node that dies or cannot run the project's code fails every
   trial it holds (the running ones, and the cached actors on it handed to new trials); each counts against
   ``max_failures`` like a bug in the trial, so a sweep with ``max_failures: 0`` loses them all.

:func:`install` wraps two Tune methods (idempotent; the sweep calls it before every Tuner):

* ``TuneController._trial_task_failure``: an exception already handled for a trial is not handled again (1); a
  failed trial is no longer resetting (2); a node fault (:func:`node_fault`) gets no Tune traceback: a lost node
  is announced in one line per trial and the freed actors Tune keeps for reuse are stopped (the dead node's would
  fail every trial handed to them; healthy nodes' start new ones, seconds each, once); a node that cannot import
  the project is checked, named once and fenced by the sweep's NodeGuard (orchestrator/raytune/node_guard.py), and
  so is a node that joined without the run directory: a trial there refuses to start when its healed weights
  could not reach the run directory (``tasks.errors.RunDirUnseen``, a node fault), or its checkpoint there fails
  (Ray's "Unable to set up cluster storage"; that failure counts).
* ``Trial._handle_ray_actor_error`` (where Tune decides whether an actor error counts: a preempted node's does
  not), ``Trial._handle_ray_task_error`` (an exception in the trial: counted, but for ``RunDirUnseen``) and
  ``Trial._handle_restore_error`` (a retried trial whose checkpoint in the run directory its new node cannot see,
  :func:`restore_unseen`): a node fault does not count against ``max_failures``, at most
  :data:`NODE_FAULT_RETRIES` times per trial (:data:`UNSEEN_RETRIES` for a node without the run directory; a trial
  that takes its node down every time still ends); after that it counts like any failure, and its line says so.

The retried trial goes back to the queue (PENDING) and gets a new actor where resources are free: Ray's GCS does
not place the new actor on the dead node (its raylet no longer answers), so no sleep is needed for Ray to mark
the node dead. The wraps rely on Tune internals (``_trial_task_failure``, ``_resetting_trials``,
``_print_trial_errors``, ``_actor_cache``, ``_remove_actor``, ``Trial._handle_ray_actor_error``,
``Trial._handle_ray_task_error``, ``Trial._handle_restore_error``, ``Trial.is_restoring``,
``Trial.temporary_state``): pyproject pins Ray, and tests/e2e/test_trial_faults.py fails on a real TuneController
when they change (tests/orchestrator/test_trial_faults.py on a real Tune ``Trial``).
"""
from __future__ import annotations

import re
import sys

from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError, RayTaskError

from orchestrator.raytune import node_guard
from orchestrator.raytune.node_guard import missing_project
from tasks.errors import RunDirUnseen, unseen_node

# Ray Tune's error for a checkpoint written from a node that does not see its (local) storage: the run directory
UNSHARED_STORAGE = "Unable to set up cluster storage"
_RESTORE_MISSING = "Could not recover from checkpoint as it does not exist"  # Ray Tune's Trainable.restore
UNSEEN_FAULT = "its node does not see the run directory"  # a trial that refused to start there (RunDirUnseen)
NODE_FAULT_RETRIES = 3  # per trial: node faults not counted against resources.max_failures
# ... and refusals by a node without the run directory: such a trial fails before any work, and Tune may place its
# retries there again until the node's fence holds (Tune's own pending placement groups are placed first): measured
# 2026-12-02, a node joining mid-sweep: 1 and 4 refusals for the 2 trials it took
UNSEEN_RETRIES = 10
_MARK = "_healsweep_trial_faults"
_SEEN = "_healsweep_failures_seen"


def node_fault(exc: BaseException | None) -> str | None:
    """What went wrong with the trial's node, when ``exc`` is not the trial's own failure: its actor is
    unreachable (the node is down or cut off; Ray has not marked it dead yet), died with its node, or could not
    import the project there (orchestrator/raytune/node_guard.py). None for everything else (an exception in the trial,
    an actor process that crashed on a live node, ...)."""

    if isinstance(exc, RayActorError) and missing_project(exc):  # the actor died importing the trainable
        return f"its node cannot import the project ({missing_project(exc)})"
    if isinstance(exc, RayTaskError):
        if _unseen(exc) is not None:  # the trial refused to start there
            return UNSEEN_FAULT  # (tasks/trial.py weights_home, called first by the trainable)
        cause = exc.as_instanceof_cause()
        exc = cause if isinstance(cause, RayActorError) else None
    if isinstance(exc, ActorUnavailableError):
        return "its node is unreachable"
    if isinstance(exc, ActorDiedError) and (exc.preempted or "because its node has died" in str(exc)):
        return "its node died"
    return None


def _unseen(exc: BaseException) -> str | None:
    """The message of the RunDirUnseen a trial task failed with, or None: its exception, what that was raised from,
    or (with ``RAY_AIR_FULL_TRACEBACKS=1`` Tune's StartTraceback is the exception, and pickling to the driver drops
    ``__cause__``) the remote traceback's text."""
    e, depth = getattr(exc, "cause", None), 0
    while e is not None and depth < 8:
        if isinstance(e, RunDirUnseen):
            return str(e)
        e, depth = e.__cause__ or e.__context__, depth + 1
    m = re.search(r"RunDirUnseen: (.+)", str(getattr(exc, "traceback_str", "") or ""))
    return m.group(1) if m else None


def _unseen_node(exc: BaseException) -> str | None:
    """The node a RunDirUnseen names (the trainable appends it), or None."""
    return unseen_node(_unseen(exc) or "")


def restore_unseen(trial, exc: BaseException) -> bool:
    """A retried trial whose checkpoint (in the run directory: Ray Tune's storage without a store URI) its new node
    cannot find: Tune's ``restore`` fails before the trainable runs. A fault of the node, as RunDirUnseen."""
    guard = node_guard.active()
    return (guard is not None and guard.run_dir is not None and trial.is_restoring
            and _RESTORE_MISSING in str(exc) and guard.run_dir in str(exc))


_COUNTERS = {False: "healsweep_node_faults", True: "healsweep_unseen_faults"}  # lost/unusable nodes, refusals


def node_faults(trial, unseen: bool | None = None) -> int:
    """Node faults of ``trial`` not counted against max_failures so far (this driver session): of one kind
    (``unseen``: refusals by a node without the run directory; False: nodes lost or without the project), or all."""
    kinds = (False, True) if unseen is None else (unseen,)
    return sum(getattr(trial.temporary_state, _COUNTERS[k], 0) for k in kinds)


def install() -> None:
    """Wrap TuneController._trial_task_failure and Trial's _handle_ray_actor_error, _handle_ray_task_error and
    _handle_restore_error (see the module docstring)."""
    from ray.tune.execution.tune_controller import TuneController
    from ray.tune.experiment.trial import Trial

    if getattr(TuneController._trial_task_failure, _MARK, False):
        return
    tune_failure, tune_actor_error = TuneController._trial_task_failure, Trial._handle_ray_actor_error

    def _trial_task_failure(self, trial, exception):
        seen = self.__dict__.setdefault(_SEEN, {})
        if seen.get(trial.trial_id) is exception:
            return  # the same actor error, handed over twice (the actor's and the task's callback)
        seen[trial.trial_id] = exception
        self._resetting_trials.discard(trial)  # its actor is gone: no reset is running any more
        fault = node_fault(exception) or (UNSEEN_FAULT if restore_unseen(trial, exception) else None)
        if fault is None:
            if UNSHARED_STORAGE in str(exception) and (guard := node_guard.active()) is not None:
                guard.check_soon()  # a node that joined without the run directory: named once and fenced
                self._cleanup_cached_actors(force_all=True)  # its freed actors would take the next trials
            return tune_failure(self, trial, exception)
        printing, self._print_trial_errors = self._print_trial_errors, False  # our line instead of a traceback
        try:
            tune_failure(self, trial, exception)
        finally:
            self._print_trial_errors = printing
        _after_fault(self, trial, exception, fault)

    def _handle_ray_actor_error(self, exc):
        if _uncounted(self, node_fault(exc) if not exc.preempted else None):
            return  # not counted: the trial is retried while max_failures stays for its own failures
        return tune_actor_error(self, exc)

    def _handle_ray_task_error(self, exc):
        if _uncounted(self, node_fault(exc) if node_fault(exc) == UNSEEN_FAULT else None):
            return  # not counted either: the node, not the trial, was at fault
        return tune_task_error(self, exc)

    def _handle_restore_error(self, exc):  # Tune sends every error of a restoring trial here (a lost node's too)
        if _uncounted(self, UNSEEN_FAULT if restore_unseen(self, exc) else node_fault(exc)):
            return
        return tune_restore_error(self, exc)

    tune_task_error, tune_restore_error = Trial._handle_ray_task_error, Trial._handle_restore_error
    setattr(_trial_task_failure, _MARK, True)
    _trial_task_failure.tune_failure, _handle_ray_actor_error.tune_actor_error = tune_failure, tune_actor_error
    _handle_ray_task_error.tune_task_error, _handle_restore_error.tune_restore_error = tune_task_error, tune_restore_error
    TuneController._trial_task_failure, Trial._handle_ray_actor_error = _trial_task_failure, _handle_ray_actor_error
    Trial._handle_ray_task_error, Trial._handle_restore_error = _handle_ray_task_error, _handle_restore_error


def _uncounted(trial, fault: str | None) -> bool:
    """Whether a failure of ``trial`` (``fault``: its node fault, None for its own failure) is left out of
    max_failures: at most NODE_FAULT_RETRIES node faults per trial, UNSEEN_RETRIES refusals by a node without the run
    directory, each kind its own count; one past that is counted, and the trial remembers it (its line says so)."""
    unseen = fault == UNSEEN_FAULT
    limit = UNSEEN_RETRIES if unseen else NODE_FAULT_RETRIES
    trial.temporary_state.healsweep_fault_counted = fault is not None and node_faults(trial, unseen) >= limit
    if fault is not None and node_faults(trial, unseen) < limit:
        setattr(trial.temporary_state, _COUNTERS[unseen], node_faults(trial, unseen) + 1)
        return True
    return False


def _after_fault(controller, trial, exc, fault: str) -> None:
    """A node that cannot import the project, or that does not see the run directory (a trial refused to start
    there): the sweep's NodeGuard checks the new nodes, names the bad one once and fences it. A lost node: one
    line per trial. Both but the first: the actors Tune keeps for reuse are stopped (those on the lost node would
    fail every trial handed to them; those on a node without the run directory would take the next trials)."""

    guard, project = node_guard.active(), fault.startswith("its node cannot import")
    if not project:
        controller._cleanup_cached_actors(force_all=True)
    if project and guard is not None:
        guard.check_soon()
        return
    if fault == UNSEEN_FAULT and guard is not None:
        node = _unseen_node(exc) or _node_at(getattr(exc, "ip", None))  # a failed restore names only its address
        if node is None:
            guard.check_soon()  # the unchecked nodes are probed
        elif guard.mark(node, node_guard.UNSHARED) or not getattr(trial.temporary_state, "healsweep_fault_counted",
                                                                    False):
            return  # named and fenced now (the guard's line), or a retry Tune placed there before the fence held
    _say(fault_line(trial, exc, fault))


def _node_at(ip: str | None) -> str | None:
    """The one alive node at address ``ip`` (None: unknown, or several nodes share it)."""
    import ray

    if not ip:
        return None
    try:
        ids = [n["NodeID"] for n in ray.nodes() if n.get("Alive") and n.get("NodeManagerAddress") == ip]
    except Exception:  # noqa: BLE001 - Tune's loop must go on
        return None
    return ids[0] if len(ids) == 1 else None


def _say(text: str) -> None:
    from tqdm.auto import tqdm

    tqdm.write(f"healsweep: {text}", file=sys.stderr)  # above the trials' progress bar, not through it


def fault_line(trial, exc: BaseException, fault: str) -> str:
    """One line for a trial hit by a node fault: which trial, what happened, what the sweep does about it."""
    key = trial.config.get("trial_id", trial.trial_id)
    node = _unseen_node(exc) if fault == UNSEEN_FAULT else None
    what = (f"trial {key} did not start: {fault}" + (f" (node {node[:12]})" if node else "") if fault == UNSEEN_FAULT
            else f"trial {key} lost its actor: {fault} ({type(exc).__name__})")
    unseen = fault == UNSEEN_FAULT
    limit = UNSEEN_RETRIES if unseen else NODE_FAULT_RETRIES
    if trial.status == trial.PENDING and getattr(trial.temporary_state, "healsweep_fault_counted", False):
        return f"{what}; retrying it (counted against resources.max_failures: its {limit} node faults are spent)"
    if trial.status == trial.PENDING:
        return (f"{what}; retrying it on another node (not counted against resources.max_failures: node fault "
                f"{node_faults(trial, unseen)} of {limit} for this trial)")
    return f"{what}; no retries left, the trial ends FAILED"
