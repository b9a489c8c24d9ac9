"""Nodes that cannot run the project's code: found, named in one line, kept out of the sweep.

On a cluster (``--address``) every task and trial actor of a sweep runs the project's code on the node Ray picks,
in that node's Python (the one its ``ray start`` runs). A node whose Python lacks healsweep fails each of them at
import, with Ray's traceback ("The actor with name ImplicitFunc failed to import on the worker ...
ModuleNotFoundError: No module named 'orchestrator'"): the trial's actor dies before it runs, Tune counted it
against ``max_failures`` and placed the retry wherever CPUs were free (that node's, freed at once, among them).

:class:`NodeGuard` runs a tiny task on every node that has CPUs or GPUs (pinned with a hard node affinity, 0
CPUs: it does not wait for a free one) before any work: the task is a function of this module, so it can only
run where the project imports, and it reports the node's healsweep version. A node that fails it gets one line
(which node, what is missing, what to do) and its CPUs and GPUs are held by placement groups pinned to it
(``ray.io/node-id`` label), so no task or trial of this sweep is placed there; the rest of the cluster runs the
sweep. With no node left that could run it the sweep stops in one line (:class:`~orchestrator.raytune.cluster.ClusterError`,
exit 2). A node that joins later and fails a trial the same way is checked when it does (orchestrator/raytune/trial_faults.py
recognises the error with :func:`missing_project`, retries the trial without counting it and calls
:meth:`NodeGuard.check_soon`); Ray's copy of that worker's traceback is not printed while the trials run
(:class:`guarding`). A stage task (models, dense, masks) that fails this way on a node that joined after the
check stops the sweep in one line (orchestrator/sweep/run.py, resumable). A node running another healsweep version
gets a one-line warning.
"""
from __future__ import annotations

import importlib.util
import os
import re
import sys
import tempfile
import threading
from importlib.metadata import PackageNotFoundError, version

from tasks.saved_trial import sees_run_dir

PACKAGES = ("orchestrator", "tasks", "analysis")
_NO_MODULE = re.compile(r"No module named '((?:%s)(?:\.[\w.]+)?)'" % "|".join(PACKAGES))
PROBE_TIMEOUT_S = 60.0
_active: list = []  # the NodeGuard of the sweep whose trials run now (trial_faults calls check_soon on it)


def missing_project(exc: BaseException | str | None) -> str | None:
    """"No module named 'orchestrator'" when ``exc`` (a task error, or a trial actor that died at import) says a
    worker could not import one of the project's packages; None otherwise."""
    m = _NO_MODULE.search(str(exc or ""))
    return f"No module named '{m.group(1)}'" if m else None


def driver_version() -> str | None:

    try:
        return version("healsweep")
    except PackageNotFoundError:  # a checkout on PYTHONPATH, never installed
        return None


def node_facts(run_dir: str | None = None, sweep_id: str = "") -> dict:
    """Runs on a node (a Ray task): its packages of the project that do not import, its healsweep version and,
    given ``run_dir``, whether it sees that run directory (its sweep.json naming ``sweep_id``). Ray unpickles this
    function by importing this module first: where ``orchestrator`` is missing it never runs (the task fails with
    ModuleNotFoundError)."""
    return {"missing": [p for p in PACKAGES if importlib.util.find_spec(p) is None], "version": driver_version(),
            "sees_run_dir": None if run_dir is None else _writes_run_dir(run_dir, sweep_id)}


def _writes_run_dir(run_dir: str, sweep_id: str) -> bool | None:
    """Whether this node sees the run directory and can write there (what Tune's checkpoints need): False when
    its sweep.json is missing or names another sweep, or a file cannot be created; None (ask again later) when
    reading it failed otherwise (a stale NFS handle, an I/O error)."""
    path = os.path.join(run_dir, "sweep.json")
    try:
        os.stat(path)
    except FileNotFoundError:
        return False
    except OSError:
        return None
    if not sees_run_dir(run_dir, sweep_id):
        return False
    try:
        fd, tmp = tempfile.mkstemp(dir=run_dir, prefix=".node-probe-")
    except OSError:  # read-only there
        return False
    os.close(fd)
    os.unlink(tmp)
    return True


def install_hint() -> str:
    """What to install on a node: the driver's healsweep version (or its checkout, when it was never installed)."""
    v = driver_version()
    return f"install healsweep {v} (the driver's version)" if v else "install the project (the driver's checkout)"


UNSHARED = "does not see the run directory"  # a node problem other than a missing project (``_problem``)


def node_line(node: dict, problem: str, run_dir: str | None = None) -> str:
    """The one line for a node that cannot run the project, or does not see the run directory (``run_dir``):
    which node, what is wrong, what the sweep does about it and what to do."""
    res = node.get("Resources", {})
    held = ", ".join(f"{res[k]:g} {k}" for k in ("CPU", "GPU") if res.get(k))
    name = f"node {node['NodeID'][:12]} ({node.get('NodeManagerAddress', '?')})"
    if problem == UNSHARED:
        return (f"{name} {UNSHARED} {run_dir}: kept out of this sweep ({held} held); share it with the nodes (Ray "
                f"Tune writes the trials' checkpoints there), or set store.uri so that the nodes need only the store "
                f"(docs/scaling.md, One storage URI)")
    return (f"{name} cannot import the project ({problem}): kept out of this sweep ({held} held); {install_hint()} "
            f"on it and restart Ray there")


class NodeGuard:
    """Checks the nodes of the connected cluster (once each) and fences the ones that cannot run the project."""

    def __init__(self, say=None, run_dir: str | None = None, sweep_id: str = "") -> None:
        """``run_dir``: a run directory every node must see (Ray Tune's storage is in it), named by its sweep.json
        (``sweep_id``); None: nodes need not see it (a remote store holds Tune's storage)."""
        self.say = say or _say
        self.run_dir, self.sweep_id = run_dir, sweep_id
        self.checked: dict[str, str | None] = {}  # node id -> problem (None: fine)
        self.fences: list = []  # placement groups holding a bad node's CPUs/GPUs
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._pending = False  # check_soon was called since the running check took its node list
        self._soon = threading.Lock()  # the thread and the flag (``_lock``: the checks themselves)
        self._released = False  # release() was called: no check starts, no fence is kept

    @property
    def bad(self) -> list[str]:
        return [n for n, problem in self.checked.items() if problem]

    def check(self) -> list[str]:
        """Check every alive node with CPUs/GPUs not checked yet; fence and name the bad ones. -> their ids."""
        import ray

        with self._lock:
            nodes = [n for n in ray.nodes() if n.get("Alive") and n["NodeID"] not in self.checked
                     and (n.get("Resources", {}).get("CPU") or n.get("Resources", {}).get("GPU"))]
            found = []
            for node, facts in zip(nodes, _probe([n["NodeID"] for n in nodes], self.run_dir, self.sweep_id)):
                if facts is None:  # no answer (in time, or the node went away): checked again next time
                    continue
                problem = _problem(facts)
                if not self._claim(node["NodeID"], problem):
                    continue  # marked bad by a trial meanwhile (:meth:`mark`): fenced and named there
                if problem:
                    if not self._keep(fence(node)):
                        continue  # the sweep ended while this node was probed: nothing to keep it out of
                    self.say(node_line(node, problem, self.run_dir))
                    found.append(node["NodeID"])
                elif facts.get("version") and driver_version() and facts["version"] != driver_version():
                    theirs = "another healsweep" if facts["version"] == "another" else f"healsweep {facts['version']}"
                    self.say(f"node {node['NodeID'][:12]} ({node.get('NodeManagerAddress', '?')}) runs {theirs}, "
                             f"the driver {driver_version()}: install the same version on it")
            return found

    def check_soon(self) -> None:
        """:meth:`check` in a thread (called from Tune's loop, which must not wait for the probe). A call while a
        check runs makes that thread check once more when it is done (its node list was taken before)."""
        with self._soon:  # never held through a probe
            if self._released:
                return
            self._pending = True
            if self._thread is None:
                self._thread = threading.Thread(target=self._check_while_asked, name="healsweep-node-guard",
                                                daemon=True)
                self._thread.start()

    def _check_while_asked(self) -> None:
        while True:
            with self._soon:
                if not self._pending:
                    self._thread = None  # under the lock: a later check_soon starts a new thread
                    return
                self._pending = False
            try:
                self.check()
            except Exception as e:  # noqa: BLE001 - the cluster going away: said; the next fault asks again
                with self._soon:
                    self._thread = None
                self.say(f"checking the cluster's nodes failed ({type(e).__name__}: {str(e)[:200]}); asked again at "
                         "the next node fault")
                return

    def _claim(self, node_id: str, problem: str | None) -> bool:
        """Record ``problem`` for ``node_id`` unless a problem is recorded already (one fence, one line per node)."""
        with self._soon:
            if self.checked.get(node_id):
                return False
            self.checked[node_id] = problem
            return True

    def mark(self, node_id: str, problem: str) -> bool:
        """A node a trial found bad (a RunDirUnseen names it), probed or not: named and fenced now, from Tune's loop
        (a probe takes a second, a trial refused there is retried within milliseconds). -> whether this call named
        it (False: named before, gone, or the cluster did not answer: the unchecked nodes are probed instead)."""
        import ray

        try:
            node = next((n for n in ray.nodes() if n["NodeID"] == node_id and n.get("Alive")), None)
            if node is None or not self._claim(node_id, problem) or not self._keep(fence(node)):
                return False
        except Exception:  # noqa: BLE001 - Tune's loop must go on: a probe decides instead
            self.check_soon()
            return False
        self.say(node_line(node, problem, self.run_dir))
        return True

    def wait_fenced(self, timeout: float = PROBE_TIMEOUT_S) -> None:
        """Until every fence holds its node's CPUs and GPUs (a task submitted before could still land there)."""
        import ray

        if self.fences:
            ray.wait([pg.ready() for pg in self.fences], num_returns=len(self.fences), timeout=timeout)

    def unplaced(self, requests: dict[str, dict[str, float]]) -> dict[str, dict[str, float]]:
        """Those of ``requests`` (:func:`requests`) that no alive, unfenced node of the cluster can place."""
        import ray

        left = [n.get("Resources", {}) for n in ray.nodes() if n.get("Alive") and n["NodeID"] not in self.bad]
        return {name: want for name, want in requests.items() if not placeable(left, want)}

    def refusal(self, unplaced: dict[str, dict[str, float]] | None = None) -> str:
        """The line when no node is left that could run the sweep: how many nodes of each kind, what to do, and
        what no node left can place (``unplaced``: :meth:`unplaced`)."""
        unshared = sum(self.checked[n] == UNSHARED for n in self.bad)
        why = ([f"{_nodes(unshared)} without the run directory {self.run_dir} (share it with the nodes, or set "
                "store.uri: docs/scaling.md, One storage URI)"] if unshared else []) + (
            [f"{_nodes(len(self.bad) - unshared)} that cannot import the project ({install_hint()} on them and "
             "restart Ray there)"] if len(self.bad) > unshared else [])
        wants = [f"a {name} ({_amount(want)})" for name, want in (unplaced or {}).items()]
        left = f"; no node left can place {' or '.join(wants)}" if wants else ""
        return f"no node of the cluster can run the sweep: {'; '.join(why)}{left}"

    def _keep(self, pgs: list) -> bool:
        """Keep a node's fences (``pgs``) until :meth:`release`; once released they are removed at once (a check
        still probing when the sweep ended would otherwise hold that node's CPUs and GPUs after it). -> kept."""
        with self._soon:
            if not self._released:
                self.fences += pgs
                return True
        _remove(pgs)
        return False

    def release(self) -> None:
        """The sweep is over: no check starts any more, every fence is removed (also those a check still probing
        adds later: :meth:`_keep`); waits up to a probe's time for a running check."""
        with self._soon:
            self._released, self._pending, thread = True, False, self._thread
        if thread is not None:
            thread.join(PROBE_TIMEOUT_S)
        with self._soon:
            pgs, self.fences = self.fences, []
        _remove(pgs)


def _remove(pgs: list) -> None:
    """Remove these placement groups (fences)."""
    if pgs:
        from ray.util.placement_group import remove_placement_group

        for pg in pgs:
            remove_placement_group(pg)


def requests(resources) -> dict[str, dict[str, float]]:
    """What one trial and one dense task of a sweep ask Ray for (a ResourceSpec), as Ray resource names; a kind
    asked for 0 is left out ({"trial": {"CPU": 1.0, "GPU": 0.5}, "dense task": {"CPU": 1.0}})."""
    def one(cpus: float, gpus: float) -> dict[str, float]:
        return {k: float(v) for k, v in (("CPU", cpus), ("GPU", gpus)) if v > 0}

    return {"trial": one(resources.cpus_per_trial, resources.gpus_per_trial),
            "dense task": one(resources.cpus_per_dense_task, resources.gpus_per_dense_task)}


def placeable(nodes: list[dict[str, float]], want: dict[str, float]) -> bool:
    """Whether one of ``nodes`` (their Ray resources) has at least ``want`` of every resource: a placement that
    fits no single node waits for ever."""
    return any(all(res.get(k, 0.0) >= v for k, v in want.items()) for res in nodes)


def _amount(want: dict[str, float]) -> str:
    return ", ".join(f"{v:g} {k}" for k, v in want.items()) or "nothing"


def _nodes(k: int) -> str:
    return f"{k} node{'s' if k > 1 else ''}"


def _problem(facts: dict) -> str | None:
    if facts.get("missing"):
        return f"No module named '{facts['missing'][0]}'"
    return UNSHARED if facts.get("sees_run_dir") is False else None


def _probe(node_ids: list[str], run_dir: str | None = None, sweep_id: str = "") -> list[dict | None]:
    """:func:`node_facts` on each node, in parallel: its dict (a node whose worker could not import this module:
    ``missing`` names the package), or None (no answer within PROBE_TIMEOUT_S, or another error: the node died,
    left, ...)."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    task = ray.remote(node_facts)
    args = () if run_dir is None else (run_dir, sweep_id)  # no arguments: what an older healsweep's probe takes
    refs = [task.options(num_cpus=0, max_retries=0, scheduling_strategy=NodeAffinitySchedulingStrategy(n, soft=False))
            .remote(*args) for n in node_ids]
    ready, _ = ray.wait(refs, num_returns=len(refs), timeout=PROBE_TIMEOUT_S) if refs else ([], [])
    out = []
    for ref in refs:
        if ref not in ready:
            out.append(None)
            continue
        try:
            facts = ray.get(ref)
            unsure = run_dir is not None and facts.get("sees_run_dir", False) is None  # asked again next time
            out.append(None if unsure else facts)
        except ray.exceptions.RayError as e:
            missing = missing_project(e)
            if missing is None and isinstance(e, ray.exceptions.RayTaskError) and "node_facts()" in str(e):
                out.append({"missing": [], "version": "another"})  # an older probe without arguments: warned
                continue
            out.append({"missing": [missing.split("'")[1]], "version": None} if missing else None)
    return out


def fence(node: dict) -> list:
    """Placement groups holding every CPU and GPU of ``node`` (one per unit: each is placed as soon as that unit is
    free, ahead of the trials that request one later), pinned to it by its ``ray.io/node-id`` label."""
    from ray.util.placement_group import placement_group

    res, pin = node.get("Resources", {}), [{"ray.io/node-id": node["NodeID"]}]
    return [placement_group([{kind: 1.0}], bundle_label_selector=pin)
            for kind in ("CPU", "GPU") for _ in range(int(res.get(kind, 0)))]


def _say(text: str) -> None:
    from tqdm.auto import tqdm

    tqdm.write(f"healsweep: {text}", file=sys.stderr)  # above a progress bar, not through it


def active() -> NodeGuard | None:
    return _active[-1] if _active else None


class guarding:  # noqa: N801 - a context manager used like a function
    """``with guarding(guard):`` trial_faults reports import failures to ``guard`` while the trials run, and Ray's
    copy of such a worker's traceback is not printed (the raylet publishes it to the driver, which prints it even
    with ``log_to_driver`` off): the guard's line says which node and what to do."""

    def __init__(self, guard: NodeGuard | None) -> None:
        self.guard, self._restore = guard, None

    def __enter__(self):
        if self.guard is not None:
            _active.append(self.guard)
            self._restore = _quiet_import_failures()
        return self.guard

    def __exit__(self, *exc) -> None:
        if self.guard is not None:
            _active.remove(self.guard)
            self._restore()


def _quiet_import_failures():
    """Wrap ``ray._private.worker.print_to_stdstream`` (what the driver's error listener prints raylet messages
    with) to drop the ones about a worker that could not import the project. -> a function that unwraps it."""
    import ray._private.worker as ray_worker

    ray_print = ray_worker.print_to_stdstream

    def print_to_stdstream(data, ignore_prefix: bool):
        if missing_project("\n".join(map(str, data.get("lines", ())))):
            return
        return ray_print(data, ignore_prefix)

    ray_worker.print_to_stdstream = print_to_stdstream
    return lambda: setattr(ray_worker, "print_to_stdstream", ray_print)
