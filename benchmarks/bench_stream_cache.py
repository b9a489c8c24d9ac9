"""Loading a streamed dataset in several processes (a sweep's driver, trial actors, dense runs) with and without
the machine's stream cache (tasks/data/stream_cache.py).

A generated ``save_to_disk`` dataset (224-px PNGs, ~150 KB each) is read as a stream, as the ``imagenet1k``
preset reads the hub. Each process loads the dataset's splits (the items every split needs), then touches every
calibration image once; it reports its wall time and its private memory growth (``RssAnon``: the heap that
holds the items; a memory-mapped cache file is in ``RssFile``, shared through the page cache). The processes
run one after another, cache off then on (first process streams and writes, the rest read). A local stream is
much faster than the hub's, so the time saved here is a lower bound. Prints figures only.

    python benchmarks/bench_stream_cache.py [--images 1000] [--processes 3]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tasks.data.stream_cache import CACHE_ENV
from tasks.data.synthetic import write_hf_dataset

_CHILD = """
import json, sys, time
def rss():
    f = dict(l.split(':', 1) for l in open('/proc/self/status'))
    return {k: int(f[k].split()[0]) / 1024 for k in ('RssAnon', 'RssFile')}
from torchvision import transforms as T
from tasks.data import load_dataset
before, t = rss(), time.perf_counter()
n = int(sys.argv[2])
sizes = {"train": 0, "calibration": n // 2, "selection": n // 4, "evaluation": n - n // 2 - n // 4}
d = load_dataset("hf", seed=0, transform=T.Compose([T.Resize(224), T.ToTensor()]), transform_id="bench:224",
                 path=sys.argv[1], streaming=True, buffer_size=256, sizes=sizes)
for i in range(0, len(d["calibration"]), 64):
    d["calibration"].images[i:i + 64]
after = rss()
print(json.dumps({"s": time.perf_counter() - t, "source": d["calibration"].images.table.source,
                  "anon_mb": after["RssAnon"] - before["RssAnon"], "file_mb": after["RssFile"] - before["RssFile"]}))
"""


def _run(data: Path, n: int, cache: str) -> dict:
    env = {**os.environ, CACHE_ENV: cache, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    out = subprocess.run([sys.executable, "-c", _CHILD, str(data), str(n)], env=env, capture_output=True, text=True,
                         check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--images", type=int, default=1000, help="items streamed (all four splits together)")
    ap.add_argument("--processes", type=int, default=3)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        per_class = -(-a.images // 10)
        data = write_hf_dataset(Path(tmp) / "hf", num_classes=10, per_class=per_class, size=224, seed=0)
        mb = sum(f.stat().st_size for f in data.rglob("*.arrow")) / 1e6
        rows = {"off": [_run(data, a.images, "off") for _ in range(a.processes)],
                "on": [_run(data, a.images, str(Path(tmp) / "cache")) for _ in range(a.processes)]}
        cached = sum(f.stat().st_size for f in (Path(tmp) / "cache").glob("*.arrow")) / 1e6
    print(f"{a.images} streamed items of a {10 * per_class}-image local dataset ({mb:.0f} MB of PNG), "
          f"{a.processes} processes one after another; cache file {cached:.0f} MB")
    print(f"{'cache':<6}{'process':>8}{'source':>8}{'s':>8}{'RssAnon MB':>12}{'RssFile MB':>12}")
    for mode, rs in rows.items():
        for i, r in enumerate(rs):
            print(f"{mode:<6}{i:>8}{r['source']:>8}{r['s']:>8.2f}{r['anon_mb']:>12.0f}{r['file_mb']:>12.0f}")
    off, on = rows["off"], rows["on"][1:]
    if on:
        print(f"a later process: {sum(r['s'] for r in on) / len(on):.2f} s with the cache vs "
              f"{sum(r['s'] for r in off) / len(off):.2f} s without; private memory "
              f"{sum(r['anon_mb'] for r in on) / len(on):.0f} vs {sum(r['anon_mb'] for r in off) / len(off):.0f} MB")


if __name__ == "__main__":
    t0 = time.time()
    main()
    print(f"({time.time() - t0:.0f} s; load {os.getloadavg()[0]:.2f})")
