"""Real ``ray start`` nodes on 127.0.0.1 (each its own temp dir and ports, stopped by PID) and a sweep run through
the real console script against them, with a node that joins after the first trials: shared by
tests/e2e/test_cluster_scaleout.py and benchmarks/bench_scaleout.py. No pytest import (the benchmark uses it)."""
from __future__ import annotations

import glob
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RAY = os.path.join(os.path.dirname(sys.executable), "ray")
HEALSWEEP = os.path.join(os.path.dirname(sys.executable), "healsweep")
# token auth off explicitly: Ray 2.60 turns it on for `ray start --head` when ~/.ray/auth_token exists (any earlier
# local ray.init writes one), and a joining node or driver without the token is then refused
NODE_ENV = {"RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "disabled"}


def _read(path: Path) -> str:
    try:
        return Path(path).read_text(errors="replace")
    except OSError:
        return ""


def free_port() -> int:
    return free_ports(1)[0]


def free_ports(n: int) -> list[int]:
    """``n`` distinct ports free now (all bound at once, so none is handed out twice)."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


@dataclass
class RayNode:
    """One ``ray start --block`` process group; ``stop()`` ends it by its PID (the group it leads)."""
    proc: subprocess.Popen
    temp_dir: str
    address: str  # the head's GCS address
    log: str
    _id: str = ""

    @property
    def logs_dir(self) -> Path:
        return Path(self.temp_dir) / "session_latest" / "logs"

    def node_id(self, timeout: float = 60) -> str:
        """This node's Ray node id, read from its raylet's log (once)."""
        t0 = time.monotonic()
        while not self._id:
            m = re.search(r"[Nn]ode[ _]?[Ii][Dd][:= ]+([0-9a-f]{56})", _read(self.logs_dir / "raylet.out"))
            if m:
                self._id = m.group(1)
                break
            self._check_alive()
            if time.monotonic() - t0 > timeout:
                raise TimeoutError(f"no node id in {self.logs_dir}/raylet.out")
            time.sleep(0.2)
        return self._id

    def _check_alive(self) -> None:
        if self.proc.poll() is not None:
            raise RuntimeError(f"ray start exited rc={self.proc.returncode}: {Path(self.log).read_text()[-2000:]}")

    def kill(self) -> None:
        """SIGKILL to every process of this node (a machine that dies): ``ray start``, the processes naming its temp
        dir, and all their descendants -- the trial actors too, whose command line Ray rewrites
        (``ray::ImplicitFunc.train``) and which would otherwise finish a running trial before noticing that their
        raylet is gone. Its logs stay until :meth:`stop`."""
        roots = ([self.proc.pid] if self.proc.poll() is None else []) + self.pids()
        for pid in _descendants(roots):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(10)

    def stop(self, grace: float = 5) -> None:
        """SIGTERM to the process group ``ray start`` leads, SIGKILL after ``grace`` seconds (Ray drains up to 30 s),
        then any process of this node that left the group (its command line names the node's temp dir)."""
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(grace)
            except (subprocess.TimeoutExpired, ProcessLookupError):
                pass
        self.kill()
        shutil.rmtree(self.temp_dir, ignore_errors=True)

    def pids(self) -> list[int]:
        """Live processes whose command line names this node's temp dir."""
        out = []
        for d in glob.glob("/proc/[0-9]*/cmdline"):
            try:
                if self.temp_dir.encode() in Path(d).read_bytes():
                    out.append(int(d.split("/")[2]))
            except OSError:
                continue
        return [p for p in out if p != os.getpid()]


def _descendants(roots: list[int]) -> list[int]:
    """``roots`` and every process below them (from /proc/*/stat parent pids), parents first."""
    children: dict[int, list[int]] = {}
    for d in glob.glob("/proc/[0-9]*/stat"):
        try:
            stat = Path(d).read_text()
            ppid = int(stat[stat.rindex(")") + 2:].split()[1])
        except (OSError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(d.split("/")[2]))
    out, todo = [], list(roots)
    while todo:
        pid = todo.pop(0)
        if pid not in out and pid != os.getpid():
            out.append(pid)
            todo += children.get(pid, [])
    return out


PROJECT_PACKAGES = ("orchestrator", "tasks", "analysis")


def python_without_project(root: Path) -> str:
    """A Python environment under ``root`` with every package of this one (Ray, torch, timm, ...) except healsweep
    itself: a venv whose site-packages links each entry of ours but the project's packages, its distribution
    metadata and the .pth files that point at it (an editable install). What a node sees whose image lacks the
    project. -> its python executable."""
    import site
    import venv

    root = Path(root)
    venv.EnvBuilder(with_pip=False, symlinks=True, clear=True).create(root)
    ours = Path(next(p for p in site.getsitepackages() if Path(p, "ray").is_dir()))
    theirs = next((root / "lib").glob("python*/site-packages"))
    for entry in ours.iterdir():
        name = entry.name
        if name.split(".")[0] in PROJECT_PACKAGES or "healsweep" in name.lower() or (
                name.endswith(".pth") and ("healsweep" in _read(entry) or str(REPO) in _read(entry))):
            continue
        (theirs / name).symlink_to(entry)
    return str(root / "bin" / "python")


def unshare_cmd() -> list[str]:
    """A mount namespace of its own (root: ``unshare -m``; otherwise inside a user namespace, ``-Urm``)."""
    return ["unshare", "-m" if os.geteuid() == 0 else "-Urm", "--propagation", "private"]


def start_node(num_cpus: int, head_address: str | None = None, env: dict | None = None,
               python: str | None = None, hide: str | None = None, num_gpus: int = 0) -> RayNode:
    """A head (``head_address`` None) or a node joining ``head_address``, on 127.0.0.1 with free ports. ``env``:
    variables to set (None: unset); ``python``: the node's Python (its workers run it; default this one);
    ``hide``: a directory this node does not see (an empty tmpfs over it, in the node's own mount namespace: a
    machine that does not share that file system; tests/e2e/test_cluster_hidden_rundir.py asks whether this machine
    allows it); ``num_gpus``: Ray's logical GPUs of the node (no device behind them)."""
    temp = tempfile.mkdtemp(prefix="hs-ray-", dir="/tmp")  # short: Ray's socket paths are length-limited
    p = free_ports(8)
    ports = ["--node-manager-port", p[0], "--object-manager-port", p[1], "--dashboard-agent-listen-port", p[2],
             "--dashboard-agent-grpc-port", p[3], "--runtime-env-agent-port", p[4], "--metrics-export-port", p[5]]
    if head_address is None:
        address = f"127.0.0.1:{p[6]}"
        role = ["--head", "--port", p[6], "--include-dashboard", "false", "--dashboard-port", p[7]]
    else:
        address, role = head_address, ["--address", head_address]
    ray_cli = [python, "-m", "ray.scripts.scripts"] if python else [RAY]
    cmd = [*ray_cli, "start", *map(str, role + ports), "--node-ip-address", "127.0.0.1", "--num-cpus", str(num_cpus),
           "--num-gpus", str(num_gpus), "--object-store-memory", str(80 * 1024 * 1024), "--temp-dir", temp, "--block",
           "--disable-usage-stats"]
    if hide is not None:
        cmd = [*unshare_cmd(), "sh", "-c", 'mount -t tmpfs none "$0" && exec "$@"', str(hide), *cmd]
    log = os.path.join(temp, "ray_start.log")
    with open(log, "w") as fh:
        environ = {**os.environ, **NODE_ENV, **(env or {})}
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True, cwd=temp if python else None,
                                env={k: v for k, v in environ.items() if v is not None})
    node = RayNode(proc, temp, address, log)
    try:
        node.node_id()  # its raylet is up
    except BaseException:
        node.stop()
        raise
    return node


# ------------------------------------------------------------------------------------------ a sweep on nodes
@dataclass
class Trials:
    """What MLflow holds for one sweep's trials: node, status, start time (ms) of each child run."""
    runs: list = field(default_factory=list)

    def per_node(self, after_ms: int = 0) -> dict[str, int]:
        out: dict[str, int] = {}
        for r in self.runs:
            if r.info.start_time >= after_ms:
                node = r.data.tags.get("node_id", "?")
                out[node] = out.get(node, 0) + 1
        return out

    @property
    def trial_ids(self) -> list[str]:
        return [r.data.tags["trial_id"] for r in self.runs]

    @property
    def run_twice(self) -> int:
        """Trials with more than one child run, or whose one run ran on more than one node (restarted)."""
        ids = self.trial_ids
        return (len(ids) - len(set(ids))) + sum(len(r.data.tags.get("nodes", "").split(",")) > 1 for r in self.runs)

    @property
    def failed(self) -> int:
        return sum(r.info.status != "FINISHED" for r in self.runs)


def read_trials(run_dir: Path) -> Trials:
    import json

    from mlflow import MlflowClient

    meta = Path(run_dir) / "sweep.json"
    if not meta.exists():
        return Trials()  # the sweep has not started yet
    info = json.loads(meta.read_text())
    client = MlflowClient(info["tracking_uri"])
    exp = client.get_experiment_by_name(info["experiment"])
    if exp is None:
        return Trials()
    return Trials(client.search_runs([exp.experiment_id], f"tags.sweep_id = '{info['sweep_id']}' and "
                                                          "tags.`healsweep.role` = 'trial'", max_results=5000))


def completed(run_dir: Path) -> int:
    """Trials told COMPLETE in the run directory's Optuna journal (0 before it exists)."""
    from optuna.trial import TrialState

    from orchestrator.rundir.files import told_states

    journal = Path(run_dir) / "optuna.journal"
    return sum(s == TrialState.COMPLETE for s in told_states(journal).values()) if journal.exists() else 0


def scaleout_spec(path: Path, trials_per_cell: int = 8) -> Path:
    """configs/tiny.yaml (4 cells, trials of a few seconds) with ``trials_per_cell`` trials per cell."""
    import yaml

    raw = yaml.safe_load((REPO / "configs" / "tiny.yaml").read_text())
    raw["name"] = "scaleout"
    raw["search"]["trials_per_cell"] = trials_per_cell
    Path(path).write_text(yaml.safe_dump(raw))
    return Path(path)


def sweep_cmd(spec: Path, out: Path, store: Path, cache: Path, address: str | None) -> list[str]:
    return [HEALSWEEP, "run", str(spec), "--out", str(out), "--store", str(store), "--cache", str(cache), "--quiet",
            "--no-report", *(["--address", address] if address else [])]


@dataclass
class SweepOnNodes:
    wall: float
    trials: Trials
    event_ms: int  # when the event happened (the late node's raylet up, the node killed), ms since the epoch
    late_id: str | None  # the second node's id
    head_id: str
    started_actors: dict[str, int]  # per node: trial actors started
    killed_actors: dict[str, int]  # per node: trial actors that ended before running a trial


def join_after(trials: int, cpus: int, python: str | None = None, hide_run_dir: bool = False):
    """Event: a ``cpus``-CPU node starts once ``trials`` trials are COMPLETE (``python``: its Python, e.g.
    :func:`python_without_project`; then without the test's PYTHONPATH; ``hide_run_dir``: the node does not see the
    sweep's run directory, :func:`start_node`'s ``hide``)."""
    def event(out: Path, nodes: list, alive) -> int:
        while completed(out) < trials and alive():
            time.sleep(0.2)
        hide = {"hide": str(out)} if hide_run_dir else {}
        nodes.append(start_node(cpus, nodes[0].address, **_python_env(python), **hide))
        return int(time.time() * 1000)
    return event


def _python_env(python: str | None) -> dict:
    """start_node's arguments for a node running ``python`` (None: this one): PYTHONPATH unset (it may name the
    checkout), so what that Python imports is what it has installed."""
    return {"python": python, "env": {"PYTHONPATH": None}} if python else {}


def kill_node_after(trials: int):
    """Event: the second node is killed (SIGKILL, every process of it) once it finished ``trials`` trials: it is
    then running its next ones (trial actors are reused back to back)."""
    def event(out: Path, nodes: list, alive) -> int:
        node_id = nodes[1].node_id()
        while alive() and _finished_on(out, node_id) < trials:
            time.sleep(0.3)
        nodes[1].kill()
        return int(time.time() * 1000)
    return event


def _finished_on(out: Path, node_id: str) -> int:
    """Trials finished on ``node_id`` so far; 0 until the trials stage started: MLflow must not open the SQLite store
    while the driver is still creating it (a client would create tables of its own in the same file)."""
    if completed(out) == 0:
        return 0
    return sum(r.data.tags.get("node_id") == node_id for r in read_trials(out).runs)


def run_on_nodes(spec: Path, work: Path, store: Path, cache: Path, head_cpus: int, node_cpus: int = 0,
                 event=None, timeout: float = 900, node_python: str | None = None,
                 cwd: Path = REPO) -> SweepOnNodes:
    """A head with ``head_cpus`` CPUs (plus a node with ``node_cpus`` from the start, if given, running
    ``node_python``), the sweep through the console script with ``--address`` started in ``cwd`` (Ray puts the
    driver's working directory on every worker's sys.path), and ``event`` (:func:`join_after`,
    :func:`kill_node_after`) while it runs. Every process is stopped by PID at the end."""
    out, nodes, event_ms = Path(work) / "run", [], 0
    try:
        nodes.append(start_node(head_cpus))
        if node_cpus:
            nodes.append(start_node(node_cpus, nodes[0].address, **_python_env(node_python)))
        t0 = time.monotonic()
        with open(Path(work) / "sweep.log", "w") as log:
            proc = subprocess.Popen(sweep_cmd(spec, out, store, cache, nodes[0].address), stdout=log,
                                    stderr=subprocess.STDOUT, start_new_session=True, cwd=cwd,
                                    env={**os.environ, **NODE_ENV})
        try:
            if event is not None:
                event_ms = event(out, nodes, lambda: proc.poll() is None and time.monotonic() - t0 < timeout)
            rc = proc.wait(max(1.0, timeout - (time.monotonic() - t0)))
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)
        wall = time.monotonic() - t0
        if rc != 0:
            raise RuntimeError(f"sweep exited {rc}: {(Path(work) / 'sweep.log').read_text()[-3000:]}")
        ids, trials = [n.node_id() for n in nodes], read_trials(out)
        actors = {i: trial_actors(n.logs_dir, {r.data.tags.get("pid") for r in trials.runs if
                                               r.data.tags.get("node_id") == i}) for i, n in zip(ids, nodes)}
        return SweepOnNodes(wall, trials, event_ms, ids[1] if len(ids) > 1 else None, ids[0],
                            {i: len(a) for i, a in actors.items()},
                            {i: sum(not ran for ran in a.values()) for i, a in actors.items()})
    finally:
        for n in reversed(nodes):
            n.stop()


TRAINABLE = "tune_trainable"  # orchestrator.raytune.trainable's function: Ray's actor name for a trial actor


def trial_actors(logs_dir: Path, trial_pids: set[str]) -> dict[str, bool]:
    """{pid: ran a trial} for every trial actor a node started: Ray writes ``:actor_name:tune_trainable`` at the top
    of the worker's ``worker-<id>-<job>-<pid>.out`` when the actor's constructor starts; a trial's child run is
    tagged with the pid of the process that finished it (``pid``)."""
    out = {}
    for f in glob.glob(str(Path(logs_dir) / "worker-*.out")):
        try:
            head = Path(f).read_text(errors="replace")[:4000]
        except OSError:
            continue
        if f":actor_name:{TRAINABLE}" in head:
            pid = f.rsplit("-", 1)[1].split(".")[0]
            out[pid] = pid in trial_pids
    return out
