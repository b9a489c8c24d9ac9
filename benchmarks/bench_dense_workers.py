"""Dense stage with N Ray actor workers (model loaded once per worker) vs 1, on this machine's CPUs.

Computes the full calibration set of one reference model into fresh temporary stores, 1 worker then N
(interleaved, repeated), timing the whole stage (actor start + model load + dense forward + shard writes).
Prints figures only.

    python benchmarks/bench_dense_workers.py --cache .healsweep/models [--workers 2] [--shard-size 32]
"""
from __future__ import annotations

import argparse
import logging
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from a source checkout


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="vit_digits")
    ap.add_argument("--cache", default=".healsweep/models")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--shard-size", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=2)
    a = ap.parse_args()
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    import ray

    from orchestrator.sweep.dense import dense_stage
    from orchestrator.spec import parse_spec
    from orchestrator.sweep.stages import prepare_models

    spec = parse_spec({"name": "bench", "models": [a.model], "sparsities": [0.5], "calib_sizes": [320],
                       "pruners": ["magnitude"], "healers": ["starfish"], "store": {"shard_size": a.shard_size}})
    models = prepare_models(spec, Path(a.cache), progress=False)
    rows = {a.model: 320}
    ray.init(address="local", num_cpus=a.workers, include_dashboard=False, logging_level=logging.WARNING, log_to_driver=False)
    times: dict[int, list[float]] = {1: [], a.workers: []}
    try:
        for _ in range(a.repeats):
            for w in (1, a.workers):
                with tempfile.TemporaryDirectory() as tmp:
                    t = time.perf_counter()
                    done = dense_stage(spec, models, rows, tmp, Path(a.cache), progress=False, max_workers=w)
                    times[w].append(time.perf_counter() - t)
                    assert done[a.model] == 320
    finally:
        ray.shutdown()
    t1, tn = statistics.median(times[1]), statistics.median(times[a.workers])
    print(f"model={a.model} rows=320 shard_size={a.shard_size} ray CPUs={a.workers} median of {a.repeats}")
    print(f"1 worker: {t1:.2f} s   {a.workers} workers: {tn:.2f} s   speed-up {t1 / tn:.2f}x "
          f"(ideal {a.workers}x; includes actor start and one model load per worker)")


if __name__ == "__main__":
    main()
