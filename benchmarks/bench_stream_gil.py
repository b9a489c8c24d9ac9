"""How much the store stream's background producer slows a host-bound consumer in the same process (the GIL),
old producer against new, on the CPU (issue #33: the store-streamed epoch on a GPU is bound by the healing step's
host thread, and every call of a background thread that releases and retakes the GIL is a hand-off that thread
waits for).

A consumer of ``--ops`` tiny torch ops a step (a stand-in for a host-bound step) takes batches from a queue fed by:
- old: the producer of main at ee70313 (``gathered_batches`` into torch views of the ring, then the typed views of
  the batch made in the producer, as its device copy did: ~100 GIL-releasing calls a batch);
- new: ``ring_batches`` (numpy views of the ring's slots made once; the consumer makes the typed views).
A 13-block store of ``--rows`` rows (DeiT-shaped blocks, narrower) is written to a temporary directory. Prints the
consumer's ms per step alone and beside each producer (median of ``--rounds`` interleaved rounds).

    python benchmarks/bench_stream_gil.py                 # 1 gather thread
    python benchmarks/bench_stream_gil.py --threads 4
"""
from __future__ import annotations

import argparse
import queue
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere
from tasks.store import TargetStore  # noqa: E402
from tasks.store.stream import PinnedRing, StreamMaps, gathered_batches, ring_batches  # noqa: E402

KEY = "7" * 32


def write_store(root: Path, rows: int, width: int) -> TargetStore:
    st = TargetStore(root)
    shapes = {f"blocks.{i}": (197, width) for i in range(12)} | {"logits": (1000,)}
    g = torch.Generator().manual_seed(0)
    blocks = {k: torch.randn((rows, *v), generator=g).half() for k, v in shapes.items()}
    infos = [st.write_shard(KEY, i, a, {k: v[a:b] for k, v in blocks.items()}) for i, a, b in st.shard_plan(rows, 64)]
    st.finalize(KEY, meta={"bench": "stream_gil"}, block_shapes=infos[0]["block_shapes"], dtype="float16",
                num_rows=rows, shard_infos=infos)
    return st


def producers(r, maps, batch: int, threads: int):
    def old(ring, e):  # typed views made by the producer, as the device copy of ee70313 made them
        for rows, tgt in gathered_batches(r, batch, False, r.windows(shuffle=True, seed=0, epoch=e), maps=maps,
                                          buffers=ring, threads=threads):
            yield rows, {b: v.view(tgt[b].dtype).reshape(tgt[b].shape) for b, v in ring.views(ring.current, len(rows)).items()}

    def new(ring, e):  # the consumer makes the typed views (PinnedRing.typed)
        for rows, n in ring_batches(r, batch, False, r.windows(shuffle=True, seed=0, epoch=e), maps=maps, ring=ring,
                                    threads=threads):
            yield rows, (ring.current, n)
    return {"old": old, "new": new}


def step(x: torch.Tensor, ops: int) -> None:
    for _ in range(ops):
        x.add_(1.0)


def beside(kind: str, produce, r, batch: int, ops: int, steps: int) -> float:
    """ms per consumer step with ``produce`` feeding it through a queue of 2 (as the reader's prefetch)."""
    ring = PinnedRing(r._widths, batch, 6, pin=False)
    q, stop = queue.Queue(2), threading.Event()

    def work():
        e = 0
        while not stop.is_set():
            for item in produce(ring, e):
                while not stop.is_set():
                    try:
                        q.put(item, timeout=0.1)
                        break
                    except queue.Full:
                        pass
                if stop.is_set():
                    return
            e += 1
    th = threading.Thread(target=work, daemon=True)
    th.start()
    x = torch.zeros(8)
    for _ in range(8):
        q.get()
        step(x, ops)
    t = time.perf_counter()
    for _ in range(steps):
        rows, item = q.get()
        if kind == "new":
            ring.typed(item[0], item[1], r.dtype, r.block_shapes)
        step(x, ops)
    dt = time.perf_counter() - t
    stop.set()
    th.join()
    return dt / steps * 1e3


def alone(ops: int, steps: int) -> float:
    x = torch.zeros(8)
    step(x, ops)
    t = time.perf_counter()
    for _ in range(steps):
        step(x, ops)
    return (time.perf_counter() - t) / steps * 1e3


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=1, help="gather threads (default 1)")
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--width", type=int, default=96, help="block width (DeiT-B: 768; narrower keeps the store small)")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--ops", type=int, default=1500, help="torch ops per consumer step (default 1500)")
    ap.add_argument("--steps", type=int, default=96)
    ap.add_argument("--rounds", type=int, default=7)
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        r = write_store(Path(tmp), a.rows, a.width).open(KEY)
        maps = StreamMaps(r)
        prods = producers(r, maps, a.batch, a.threads)
        res = {"alone": [], "old": [], "new": []}
        for _ in range(a.rounds):
            res["alone"].append(alone(a.ops, a.steps))
            for kind, produce in prods.items():
                res[kind].append(beside(kind, produce, r, a.batch, a.ops, a.steps))
        maps.close()
        r.close()
    m = {k: statistics.median(v) for k, v in res.items()}
    print(f"gather threads {a.threads}: consumer ms/step alone {m['alone']:.2f}; beside the old producer "
          f"{m['old']:.2f} ({m['old'] / m['alone']:.3f}x), beside the new {m['new']:.2f} ({m['new'] / m['alone']:.3f}x)")
    return m


if __name__ == "__main__":
    main()
