"""How long a fresh trial actor takes to be ready: process start -> Ray Tune imported -> the trainable imported
(orchestrator.raytune.trainable: torch, tasks/) -> the reference model built (tasks.models.load_model: timm, the
checkpoint, the dataset) -> the adapter found. That is everything a trial does before its first healing step that
does not depend on the sweep's store; the first epoch then adds the trial's own compute (in Σ trial compute).

Each probe is a fresh interpreter (as Ray's worker is; Ray's own worker start, ~0.8 s, comes on top and is the
same for every variant). ``--baseline DIR`` runs the same probe with ``PYTHONPATH=DIR`` (e.g. the main
branch's checkout), interleaved with this checkout's, so the before/after ratio is measured under the same load.
The last lines list the heaviest imports of one probe (``python -X importtime``).

    python benchmarks/bench_actor_start.py --repeats 5 --cache .healsweep/models --baseline /path/to/main
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

PHASES = ("python", "ray_tune", "trainable", "model", "total")


def probe(cache: str) -> dict:
    """Run in the fresh process: the phases' seconds, the first from process start (/proc)."""
    import time

    t0 = time.perf_counter()
    from orchestrator.sweep.console import process_age  # light: no torch

    python = process_age()
    import ray.tune  # noqa: F401  (what every Tune function-trainable actor imports)

    t1 = time.perf_counter()
    import orchestrator.raytune.trainable  # noqa: F401

    t2 = time.perf_counter()
    from tasks.models import get_adapter, load_model

    lm = load_model("vit_digits", cache, progress=False)
    get_adapter(lm.model)
    t3 = time.perf_counter()
    return {"python": python, "ray_tune": t1 - t0, "trainable": t2 - t1, "model": t3 - t2,
            "total": python + t3 - t0, "timm": "timm" in sys.modules, "triton": "triton" in sys.modules,
            "torchvision": "torchvision" in sys.modules}


def run_probe(cache: str, tree: str, importtime: bool = False) -> dict | str:
    env = dict(os.environ, PYTHONPATH=tree, RAY_USAGE_STATS_ENABLED="0")
    cmd = [sys.executable, *(["-X", "importtime"] if importtime else []), __file__, "--probe", cache]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, check=True)
    return proc.stderr if importtime else json.loads(proc.stdout.strip().splitlines()[-1])


def heaviest(importtime: str, n: int = 12) -> list[tuple[int, str]]:
    """The ``n`` largest cumulative import times (µs) of top-level and second-level imports."""
    rows = []
    for line in importtime.splitlines():
        if line.startswith("import time:") and "self [us]" not in line:
            _, cum, name = line.split("|")
            depth = (len(name) - len(name.lstrip())) // 2
            if depth <= 2:
                rows.append((int(cum), name.strip()))
    return sorted(rows, reverse=True)[:n]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--cache", default=".healsweep/models", help="model cache holding vit_digits")
    ap.add_argument("--baseline", metavar="DIR", help="also probe checkout DIR (before/after, interleaved)")
    ap.add_argument("--probe", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.probe:
        print(json.dumps(probe(a.probe)))
        return
    here = str(Path(__file__).resolve().parents[1])
    cache = str(Path(a.cache).resolve())
    trees = {"this checkout": here, **({f"baseline {a.baseline}": a.baseline} if a.baseline else {})}
    print("start:", subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip(), flush=True)
    res: dict[str, list[dict]] = {k: [] for k in trees}
    run_probe(cache, here)  # warm the page cache; not measured
    for i in range(a.repeats):
        for name, tree in trees.items():
            r = run_probe(cache, tree)
            res[name].append(r)
            print(f"repeat {i + 1}/{a.repeats} {name}: " + ", ".join(f"{p} {r[p]:.2f}" for p in PHASES), flush=True)
    print(f"\nmedian seconds of {a.repeats} fresh processes (process start -> model ready):")
    for name, rs in res.items():
        loaded = [m for m in ("timm", "torchvision", "triton") if rs[-1][m]]
        print(f"  {name}: " + ", ".join(f"{p} {statistics.median(r[p] for r in rs):.2f}" for p in PHASES)
              + f"  (loaded: {', '.join(loaded) or 'none of timm/torchvision/triton'})")
    if a.baseline:
        med = {k: statistics.median(r["total"] for r in rs) for k, rs in res.items()}
        base, this = med[f"baseline {a.baseline}"], med["this checkout"]
        print(f"  actor start: {this:.2f} s vs baseline {base:.2f} s ({base - this:+.2f} s, {base / this:.2f}x)")
    print("\nheaviest imports of one probe of this checkout (python -X importtime, cumulative):")
    for us, name in heaviest(run_probe(cache, here, importtime=True)):
        print(f"  {us / 1e6:6.2f} s  {name}")
    print("end:", subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip())


if __name__ == "__main__":
    main()
