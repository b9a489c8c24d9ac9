"""The store's stream against targets already on the device, behind the bf16 STARFISH step at 224 px (issue #33:
store-streamed epoch <= 1.05x the in-RAM epoch). Models, data and the timed heals are gpu_throughput.py's.

Per model (DeiT-B/16 eager and, with --compile-models, with ``heal.compile: blocks``; ResNet-50 eager):
- heals of ``--mode-epochs`` epochs fed by the store's stream at each of ``--mode-threads`` gather thread counts and
  by the in-RAM targets, interleaved over ``--repeats`` rounds: medians, store/RAM per thread count, every round;
- with ``--pairs P``: store against RAM epoch by epoch inside one heal (P pairs; per-pair ratios, their median and a
  bootstrap 95 % interval): a pair's two epochs run within a second of each other, so a noisy host's drifts cancel;
  ``--pairs-graph off step`` also with the step captured (``heal.graph: step``; key ``alternating_<compile>+step``).

    python benchmarks/gpu_stream.py --pairs 16 --json OUT/stream.json     # on the GPU machine
    python benchmarks/gpu_stream.py --device cpu --tiny --pairs 4          # checks the script (the CPU stream)
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/: gpu_throughput's models and heals
from gpu_throughput import CASES, Healer, build, per_model, write_targets  # noqa: E402
from tasks.healing import in_memory_batches  # noqa: E402
from tasks.store import TargetStore  # noqa: E402


def stream_modes(h: Healer, reader, in_ram: dict, dev: torch.device, threads: list[int], repeats: int,
                 compile_mode: str = "off", epochs: int = 3) -> dict:
    """bf16 seconds per epoch with the store's stream at each gather thread count in ``threads`` (feeds
    ``store_t<T>``) and with the targets already on the device (``ram``), interleaved over ``repeats`` rounds (each a
    heal of ``epochs`` epochs); -> medians, store/RAM per T (median and per round: a round's feeds run back to back)."""
    order = lambda e: reader.epoch_order(shuffle=True, seed=0, epoch=e)  # noqa: E731 - same rows as the store
    feeds = {f"store_t{t}": (lambda e, t=t: reader.iter_batches(h.batch, shuffle=True, seed=0, epoch=e, device=dev,
                                                                gather_threads=t)) for t in threads}
    feeds["ram"] = in_memory_batches(in_ram, h.batch, 0, order=order)
    t = {m: [] for m in feeds}
    for m in feeds:
        h.run(feeds[m], 1, "bf16", compile_mode)  # warm-up: kernels, allocator, page cache, compilation
    for _ in range(repeats):
        for m in feeds:
            t[m].append(h.run(feeds[m], epochs, "bf16", compile_mode)[0] / epochs)
    med = {m: statistics.median(v) for m, v in t.items()}
    return {"compile": compile_mode, "epochs_per_heal": epochs, "epoch_s": med, "epoch_s_rounds": t,
            "store_vs_ram": {m: med[m] / med["ram"] for m in feeds if m != "ram"},
            "store_vs_ram_rounds": {m: [a / b for a, b in zip(t[m], t["ram"])] for m in feeds if m != "ram"}}


def alternating(h: Healer, reader, in_ram: dict, dev: torch.device, pairs: int, compile_mode: str = "off",
                seed: int = 0, graph: str = "off") -> dict:
    """Store against RAM epoch by epoch inside one bf16 heal of 2 x (``pairs`` + 1) epochs: even epochs stream the
    store (its own epoch counter, so each store epoch is started ahead as in a trial), odd epochs take the targets
    already on the device; each epoch timed between the loop's per-epoch reports (each after its once-per-epoch
    synchronisation), the first pair (set-up, compilation) dropped. A pair's two epochs run within a second of each
    other, so a noisy host's drifts cancel in its ratio. -> per-pair store/RAM, median, bootstrap 95 % interval."""
    import numpy as np

    order = lambda e: reader.epoch_order(shuffle=True, seed=0, epoch=e)  # noqa: E731 - same rows as the store
    ram = in_memory_batches(in_ram, h.batch, 0, order=order)

    def feed(e: int):
        if e % 2:
            return ram(e // 2)
        return reader.iter_batches(h.batch, shuffle=True, seed=0, epoch=e // 2, device=dev)

    stamps: list[float] = []
    h.run(feed, 2 * (pairs + 1), "bf16", compile_mode, on_epoch=lambda e, m: stamps.append(time.perf_counter()),
          graph=graph)
    ep = np.diff(np.array(stamps))  # (2 * pairs + 1,): epoch e + 1's seconds
    store, ram_s = ep[1::2], ep[2::2]  # epochs 2, 4, ... and 3, 5, ...
    ratio = store[: len(ram_s)] / ram_s  # (pairs,)
    boot = np.median(np.random.default_rng(seed).choice(ratio, (2000, len(ratio))), axis=1)
    return {"compile": compile_mode, "graph": graph, "pairs": int(len(ratio)), "store_epoch_s": store.tolist(),
            "ram_epoch_s": ram_s.tolist(), "store_vs_ram_pairs": ratio.tolist(), "store_vs_ram": float(np.median(ratio)),
            "store_vs_ram_ci95": [float(np.percentile(boot, 2.5)), float(np.percentile(boot, 97.5))]}


def measure_stream(name: str, a, dev: torch.device) -> dict:
    """``--sections stream``: only the store's stream behind the bf16 step (eager, and compiled for
    ``--compile-models``), by gather threads, against the in-RAM epoch."""
    dense, adapter, images = build(name, a.tiny, dev)
    cnn = name == "resnet50" and dev.type == "cuda"
    images_dev = images.to(dev, memory_format=torch.channels_last if cnn else torch.preserve_format)
    if cnn:
        dense = dense.to(memory_format=torch.channels_last)  # heal.channels_last: auto
    with tempfile.TemporaryDirectory(dir=a.store) as tmp:
        store = TargetStore(Path(tmp))
        res = {"model": CASES[name][0], "images": len(images), "image_size": images.shape[-1], "batch": a.batch,
               **write_targets(store, "7" * 32, dense, adapter.blocks(dense), images_dev, a.shard, dev)}
        reader = store.open("7" * 32)
        in_ram = {k: v.to(dev) for k, v in reader.load_all().items()}
        h = Healer(dense, adapter, images_dev, a.batch)
        for mode in ["off"] + (["blocks"] if name in a.compile_models and a.compiled else []):
            if a.repeats:  # 0: the paired measurement alone
                res[f"stream_modes_{mode}"] = stream_modes(h, reader, in_ram, dev, a.mode_threads, a.repeats, mode,
                                                           a.mode_epochs)
                print(f"{name} heal.compile {mode}: store/RAM " + ", ".join(
                    f"{m}: {v:.3f}" for m, v in res[f"stream_modes_{mode}"]["store_vs_ram"].items()), flush=True)
            for graph in a.pairs_graph if a.pairs else []:  # key alternating_<compile>[+step]
                key = f"alternating_{mode}" + ("" if graph == "off" else f"+{graph}")
                alt = res[key] = alternating(h, reader, in_ram, dev, a.pairs, mode, graph=graph)
                print(f"{name} heal.compile {mode} heal.graph {graph}: store/RAM epoch by epoch in one heal, "
                      f"{alt['pairs']} pairs: median {alt['store_vs_ram']:.3f}, 95 % interval "
                      f"{alt['store_vs_ram_ci95'][0]:.3f}–{alt['store_vs_ram_ci95'][1]:.3f}", flush=True)
        reader.close()
    return res


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda", help="cuda (default), cuda:N or cpu")
    ap.add_argument("--tiny", action="store_true", help="small models at 32 px (checks the script on a CPU)")
    ap.add_argument("--models", nargs="+", default=list(CASES), choices=list(CASES))
    ap.add_argument("--batch", type=int, default=32, help="the paper's batch size (default 32)")
    ap.add_argument("--compiled", action=argparse.BooleanOptionalAction, default=True,
                    help="also with heal.compile: blocks for --compile-models (default on)")
    ap.add_argument("--compile-models", nargs="*", default=["deit_b16"], choices=list(CASES))
    ap.add_argument("--repeats", type=int, default=3,
                    help="interleaved rounds of heals per feed (default 3; 0: only the --pairs measurement)")
    ap.add_argument("--mode-epochs", type=int, default=3, help="epochs per heal of those rounds (default 3)")
    ap.add_argument("--mode-threads", nargs="+", type=int, default=[1, 2, 4], metavar="T",
                    help="gather threads of the store's stream (default 1 2 4)")
    ap.add_argument("--pairs", type=int, default=0, metavar="P",
                    help="also store against RAM epoch by epoch inside one heal, P pairs (default 0: no)")
    ap.add_argument("--pairs-graph", nargs="+", default=["off"], choices=["off", "step"],
                    help="heal.graph of the --pairs heals (default off; step: the captured step, whose idle host "
                         "leaves the stream's threads the CPU)")
    ap.add_argument("--shard", type=int, default=64, help="store shard size (rows)")
    ap.add_argument("--store", help="directory for the temporary store (default: the system's temp dir)")
    ap.add_argument("--json", type=Path, help="also write the results here")
    a = ap.parse_args(argv)
    if a.repeats < 0 or a.pairs < 0 or not (a.repeats or a.pairs):
        ap.error("--repeats and --pairs must be >= 0, and one of them > 0 (nothing to measure)")
    return per_model("gpu_stream", a, measure_stream)

if __name__ == "__main__":
    main()
