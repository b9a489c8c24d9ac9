"""Scale-out: the same sweep (configs/tiny.yaml with 8 trials per cell: 4 cells, 32 trials of a few seconds) on real
``ray start`` nodes on 127.0.0.1, through the real console script with ``--address``, one after the other in one run:

- one node: a head with ``--one-cpus`` CPUs (default 3: the CPUs the two-node cases have in all);
- two nodes from the start: a 1-CPU head and a 2-CPU node;
- late join: a 1-CPU head, the 2-CPU node started once ``--join-after`` trials are COMPLETE.

Printed per case: wall time of the sweep (console script start to exit), trials per node (from MLflow's node id
tag), for the late join the trials that started after the node joined and the late node's share of them, trials
failed and run twice, trial actors started per node and those stopped before they ran a trial (from each node's Ray
worker logs), and wall-time ratios against the one-node case. On one machine every node shares the same cores, so
two nodes cannot be faster than one node with as many CPUs: the ratio shows the cost of spreading over nodes.

    python benchmarks/bench_scaleout.py --cache .healsweep/models
"""
from __future__ import annotations

import argparse
import datetime
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.ray_nodes import REPO, join_after, run_on_nodes, scaleout_spec  # noqa: E402


def uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


def describe(name: str, r, base: float | None) -> list[str]:
    short = {r.head_id: "head"} | ({r.late_id: "node"} if r.late_id else {})
    per = {short.get(k, k[:8]): v for k, v in r.trials.per_node().items()}
    lines = [f"{name}: wall {r.wall:.1f} s" + (f" ({r.wall / base:.2f}x the one-node wall)" if base else ""),
             f"  trials per node {per}; {len(r.trials.runs)} trials, failed {r.trials.failed}, "
             f"run twice {r.trials.run_twice}",
             "  trial actors started " + str({short[k]: v for k, v in r.started_actors.items()})
             + ", stopped before running a trial " + str({short[k]: v for k, v in r.killed_actors.items()})]
    if r.event_ms:
        after = r.trials.per_node(r.event_ms)
        n, late = sum(after.values()), after.get(r.late_id, 0)
        lines.append(f"  after the node joined: {n} trials started, {late} on the late node"
                     + (f" ({late / n:.0%})" if n else ""))
    return lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cache", default=str(REPO / ".healsweep" / "models"), help="reference model cache")
    ap.add_argument("--join-after", type=int, default=3, help="trials COMPLETE before the late node starts")
    ap.add_argument("--one-cpus", type=int, default=3, help="CPUs of the one-node case")
    ap.add_argument("--trials-per-cell", type=int, default=8)
    a = ap.parse_args(argv)
    print(f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC; before: {uptime()}", flush=True)
    with tempfile.TemporaryDirectory(prefix="hs-scaleout-") as tmp:
        root = Path(tmp)
        spec = scaleout_spec(root / "spec.yaml", a.trials_per_cell)
        store = root / "store"
        # a first sweep fills the target store and the model facts: every measured case then starts warm
        (root / "warm").mkdir()
        run_on_nodes(spec, root / "warm", store, Path(a.cache), head_cpus=a.one_cpus)
        cases = [("one node", dict(head_cpus=a.one_cpus)), ("two nodes", dict(head_cpus=1, node_cpus=2)),
                 ("late join", dict(head_cpus=1, event=join_after(a.join_after, 2)))]
        base = None
        for name, kw in cases:
            work = root / name.replace(" ", "_")
            work.mkdir()
            r = run_on_nodes(spec, work, store, Path(a.cache), **kw)
            base = base or r.wall
            print("\n".join(describe(name, r, None if name == "one node" else base)), flush=True)
    print(f"after: {uptime()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
