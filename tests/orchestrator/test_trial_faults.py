"""orchestrator/raytune/trial_faults.py: which errors are node faults (not counted against max_failures), and the line a
user sees. The wraps themselves run on a real TuneController in tests/e2e/test_trial_faults.py."""
from __future__ import annotations

from types import SimpleNamespace

from ray.core.generated.common_pb2 import ActorDiedErrorContext, NodeDeathInfo
from ray.exceptions import ActorDiedError, ActorUnavailableError, RayTaskError

from orchestrator.raytune.trial_faults import NODE_FAULT_RETRIES, UNSEEN_RETRIES, fault_line, node_fault


def _died(message: str, reason=None) -> ActorDiedError:
    ctx = ActorDiedErrorContext(error_message=message, actor_id=b"\x01" * 16)
    if reason is not None:
        ctx.node_death_info.CopyFrom(NodeDeathInfo(reason=reason))
    return ActorDiedError(ctx)


def _task_error(cause: BaseException) -> RayTaskError:
    return RayTaskError("train", "Traceback ...", cause)


def test_an_unreachable_actor_or_a_dead_node_is_a_node_fault():
    unavailable = ActorUnavailableError("RpcError: failed to connect to all addresses", b"\x01" * 16)
    assert node_fault(unavailable) == "its node is unreachable"
    assert node_fault(_task_error(unavailable)) == "its node is unreachable"  # Tune unwraps these too
    node_died = _died("The actor died because its node has died. Node Id: 8a52")
    assert node_fault(node_died) == "its node died"
    assert node_fault(_died("drained", NodeDeathInfo.AUTOSCALER_DRAIN_PREEMPTED)) == "its node died"


def test_the_trials_own_failures_are_not_node_faults():
    assert node_fault(_died("The actor is dead because its worker process has died.")) is None  # crash, OOM kill
    assert node_fault(ActorDiedError()) is None
    assert node_fault(_task_error(ValueError("loss is nan"))) is None
    assert node_fault(RuntimeError("boom")) is None and node_fault(None) is None


def _trial(status: str, faults: int, unseen: int = 0):
    return SimpleNamespace(config={"trial_id": "cell-3"}, trial_id="abc", status=status, PENDING="PENDING",
                           temporary_state=SimpleNamespace(healsweep_node_faults=faults, healsweep_unseen_faults=unseen))


def test_the_fault_line_names_the_trial_what_happened_and_what_the_sweep_does():
    err = ActorUnavailableError("gone", None)
    line = fault_line(_trial("PENDING", 1), err, "its node is unreachable")
    assert line.startswith("trial cell-3 lost its actor: its node is unreachable (ActorUnavailableError); retrying")
    assert f"node fault 1 of {NODE_FAULT_RETRIES}" in line and "\n" not in line
    assert fault_line(_trial("ERROR", NODE_FAULT_RETRIES), err, "its node died").endswith("the trial ends FAILED")


def test_a_trial_that_refused_a_node_without_the_run_directory_is_a_node_fault_not_counted():
    """tasks/trial.py refuses to start on a node that does not see the run directory when the store is not remote
    (RunDirUnseen): a fault of the node (the guard fences it), retried without counting against max_failures, at most
    UNSEEN_RETRIES times; the trial's own exceptions still count. On a real Tune Trial (no Ray needed)."""
    from ray.tune.experiment.trial import Trial

    from orchestrator.raytune import trial_faults
    from orchestrator.raytune.trial_faults import UNSEEN_FAULT
    from tasks.errors import RunDirUnseen

    unseen = _task_error(RunDirUnseen("this node does not see the run directory /runs/a"))
    assert node_fault(unseen) == UNSEEN_FAULT
    assert node_fault(_task_error(RuntimeError("this node does not see the run directory /runs/a"))) is None
    trial_faults.install()
    t = Trial("__fake", stub=True, config={}, max_failures=0)
    counted = []
    for _ in range(UNSEEN_RETRIES + 1):
        t._handle_ray_task_error(unseen)
        counted.append(t.run_metadata.num_failures)
    assert counted == [0] * UNSEEN_RETRIES + [1] and trial_faults.node_faults(t) == UNSEEN_RETRIES
    own = Trial("__fake", stub=True, config={}, max_failures=0)
    own._handle_ray_task_error(_task_error(ValueError("loss is nan")))
    assert own.run_metadata.num_failures == 1 and not own.should_recover()


def _over_the_wire(exc: BaseException) -> BaseException:
    """What the driver gets: Ray pickles a task's error with cloudpickle (``__cause__`` does not survive)."""
    from ray import cloudpickle

    return cloudpickle.loads(cloudpickle.dumps(exc))


def test_the_unseen_fault_survives_full_tracebacks_and_its_node_is_fenced_at_once(monkeypatch):
    """Tune keeps its StartTraceback in front of the trial's exception with RAY_AIR_FULL_TRACEBACKS=1 (its cause lost
    on the way to the driver: the remote traceback's text tells); the trainable appends the node id to RunDirUnseen's
    message, and the node guard fences that node at once (a probe takes a second, the retries come within
    milliseconds); without a node id the unchecked nodes are probed and the line says the trial did not start."""
    import traceback

    from ray.air._internal.util import StartTraceback

    from orchestrator.raytune import node_guard, trial_faults
    from orchestrator.raytune.node_guard import UNSHARED, NodeGuard
    from orchestrator.raytune.trial_faults import UNSEEN_FAULT, _after_fault
    from tasks.errors import UNSEEN_NODE, RunDirUnseen, unseen_node

    node = "8a5249332e49b4cb01e4aa8922cd3e8a5249332e49b4cb01e4aa89"
    unseen = RunDirUnseen(f"this node does not see the run directory /runs/a {UNSEEN_NODE.format(node)}")
    try:
        try:
            raise unseen
        except RunDirUnseen as e:
            raise StartTraceback from e
    except StartTraceback as wrapped:
        full = RayTaskError("train", "".join(traceback.format_exception(wrapped)), _over_the_wire(wrapped))
    assert full.cause.__cause__ is None and node_fault(full) == UNSEEN_FAULT  # from the traceback's text
    assert node_fault(_over_the_wire(_task_error(unseen))) == UNSEEN_FAULT
    assert unseen_node(str(unseen)) == node and unseen_node("no node here") is None

    probed, marked, said, cleaned = [], [], [], []
    guard = NodeGuard(say=said.append, run_dir="/runs/a", sweep_id="0123456789ab")
    guard.check = lambda: probed.append(dict(guard.checked)) or []  # what the probe would start from
    guard.mark = lambda node_id, problem: not marked.append((node_id, problem)) and len(marked) == 1  # named once
    controller = SimpleNamespace(_cleanup_cached_actors=lambda force_all: cleaned.append(force_all))
    monkeypatch.setattr(trial_faults, "_say", said.append)
    monkeypatch.setattr(node_guard, "_active", [guard])

    def fault(exc, trial=None):
        _after_fault(controller, trial or _trial("PENDING", 0, unseen=1), exc, UNSEEN_FAULT)
        if (t := guard._thread) is not None:
            t.join(5)

    fault(_task_error(unseen))  # the trial names its node: fenced now, no probe, no trial line (the guard's says it)
    assert marked == [(node, UNSHARED)] and probed == [] and said == [] and cleaned == [True]
    fault(_task_error(unseen))  # a retry Tune placed there before the fence held: nothing more to say
    assert len(marked) == 2 and said == []
    spent = _trial("PENDING", 0, unseen=UNSEEN_RETRIES)
    spent.temporary_state.healsweep_fault_counted = True
    fault(_task_error(unseen), spent)  # ... unless it was counted: the line says so
    assert said == [f"trial cell-3 did not start: {UNSEEN_FAULT} (node {node[:12]}); retrying it (counted against "
                    f"resources.max_failures: its {UNSEEN_RETRIES} node faults are spent)"]
    said.clear()
    fault(_task_error(RunDirUnseen("this node does not see the run directory /runs/a")))  # no node id: probed
    assert probed == [{}] and said == [f"trial cell-3 did not start: {UNSEEN_FAULT}; retrying it on another node "
                                       f"(not counted against resources.max_failures: node fault 1 of "
                                       f"{UNSEEN_RETRIES} for this trial)"]


def test_a_retried_trial_whose_checkpoint_its_new_node_cannot_see_is_a_node_fault(monkeypatch):
    """Without a store URI Ray Tune's storage is the run directory: a retried trial's ``restore`` on a node without
    it fails before the trainable runs ("Could not recover from checkpoint ..."). A node fault (not counted, the
    guard probes the unchecked nodes), but only with the run directory in the message and while restoring; past
    UNSEEN_RETRIES it counts and the line says so."""
    from ray.tune.experiment.trial import Trial

    from orchestrator.raytune import node_guard, trial_faults
    from orchestrator.raytune.node_guard import NodeGuard
    from orchestrator.raytune.trial_faults import UNSEEN_FAULT, restore_unseen

    trial_faults.install()
    missing = ValueError("Could not recover from checkpoint as it does not exist on storage anymore. Got storage fs "
                         "type `local` and path: /runs/a/tune/exp/trial_1/checkpoint_000001")
    guard = NodeGuard(run_dir="/runs/a", sweep_id="0123456789ab")
    monkeypatch.setattr(node_guard, "_active", [guard])
    t = Trial("__fake", stub=True, config={"trial_id": "cell-3"}, max_failures=0)
    assert not restore_unseen(t, missing)  # not restoring: not this fault
    t.temporary_state.restoring_from = object()
    assert restore_unseen(t, missing) and not restore_unseen(t, ValueError("Could not recover from checkpoint as it "
                                                                           "does not exist ... path: /elsewhere/x"))
    counted = []
    for _ in range(UNSEEN_RETRIES + 1):
        t._handle_restore_error(missing)
        counted.append(t.run_metadata.num_failures)
    assert counted == [0] * UNSEEN_RETRIES + [1]
    t.status = t.PENDING
    assert fault_line(t, missing, UNSEEN_FAULT) == (
        f"trial cell-3 did not start: {UNSEEN_FAULT}; retrying it (counted against resources.max_failures: its "
        f"{UNSEEN_RETRIES} node faults are spent)")
    monkeypatch.setattr(node_guard, "_active", [NodeGuard(run_dir=None)])  # Tune's storage in the bucket
    assert not restore_unseen(t, missing)
    # a node that died while the trial restored (Tune sends every error of a restoring trial there): a node fault of
    # the other kind, with its own count (refusals before do not use up its 3)
    t.temporary_state.healsweep_unseen_faults = 4
    t._handle_restore_error(_died("The actor died because its node has died. Node Id: 8a52"))
    assert t.run_metadata.num_failures == 1 and _counts(t) == (1, 4)


def _counts(t) -> tuple[int, int]:
    from orchestrator.raytune.trial_faults import node_faults

    return node_faults(t, unseen=False), node_faults(t, unseen=True)
