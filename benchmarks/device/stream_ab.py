"""The store's accelerator stream, old producer against new, side by side on one GPU (issue #33, store/RAM goal).

old: the producer of main at ee70313 (each batch gathered through ``gathered_batches`` into torch views of the pinned
ring, and the device copy's typed views made by the producer thread: ~100 GIL-releasing calls a batch); new:
``ring_batches`` (numpy views of the ring made once, the typed views made by the consumer). Both with the same ring,
maps, EpochAhead and side-stream copy. Per model: bf16 STARFISH heals (eager) of ``--epochs`` epochs fed by
old / new (gather threads 4 and 1) / targets already on the device (``ram``), the feeds' order rotated each round,
then each stream alone (no consumer). Prints store/RAM per feed; ``--json`` keeps every round.

    python benchmarks/device/stream_ab.py --json OUT/stream_ab.json        # on the GPU machine
    python benchmarks/device/stream_ab.py --device cpu --tiny               # checks the script (CPU path only)
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: gpu_throughput's helpers
import gpu_throughput as gt  # noqa: E402
from tasks.healing import in_memory_batches  # noqa: E402
from tasks.store import TargetStore  # noqa: E402
from tasks.store.stream import EpochAhead, PinnedRing, gathered_batches  # noqa: E402


class OldCopier:
    """The device copy of ee70313: the producer makes the typed views of each copy (kept here for the A/B only)."""

    def __init__(self, device: torch.device, ring: PinnedRing):
        self.device, self.ring, self.stream = device, ring, torch.cuda.Stream(device=device)

    def send(self, batch):
        rows, tgt = batch
        with torch.cuda.stream(self.stream):
            flat = self.ring.current.to(self.device, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self.stream)
        self.ring.mark(done)
        out = {b: v.view(tgt[b].dtype).reshape(tgt[b].shape) for b, v in self.ring.views(flat, len(rows)).items()}
        return rows, out, flat, done

    @staticmethod
    def ready(item):
        rows, out, flat, done = item
        current = torch.cuda.current_stream(flat.device)
        current.wait_event(done)
        flat.record_stream(current)
        return rows, out


def old_feed(reader, dev: torch.device, batch: int, threads: int, prefetch: int = 2):
    """-> (feed(epoch), EpochAhead): the old producer over ``reader``'s kept maps, with its own ring."""
    ahead, ring = EpochAhead(), PinnedRing(reader._widths, batch, prefetch + 2)

    def make(e: int):
        copier = OldCopier(dev, ring)
        wins = reader.windows(shuffle=True, seed=0, epoch=e, window=1)
        return (copier.send(b) for b in gathered_batches(reader, batch, False, wins, maps=reader._maps, buffers=ring,
                                                         threads=threads))

    def feed(e: int):
        for item in ahead.stream(("old", threads), e, make, prefetch):
            yield OldCopier.ready(item)
    return feed, ahead


def measure(name: str, a, dev: torch.device) -> dict:
    dense, adapter, images = gt.build(name, a.tiny, dev)
    images = images[: a.images.get(name, len(images))]
    cnn = name == "resnet50" and dev.type == "cuda"
    images = images.to(dev, memory_format=torch.channels_last if cnn else torch.preserve_format)
    if cnn:
        dense = dense.to(memory_format=torch.channels_last)
    with tempfile.TemporaryDirectory() as tmp:
        store = TargetStore(Path(tmp))
        res = {"model": gt.CASES[name][0], "images": len(images), "batch": a.batch,
               **gt.write_targets(store, "7" * 32, dense, adapter.blocks(dense), images, 64, dev)}
        reader = store.open("7" * 32)
        in_ram = {k: v.to(dev) for k, v in reader.load_all().items()}
        h = gt.Healer(dense, adapter, images, a.batch)
        order = lambda e: reader.epoch_order(shuffle=True, seed=0, epoch=e)  # noqa: E731
        feeds, aheads = {"ram": in_memory_batches(in_ram, a.batch, 0, order=order)}, []
        for t in a.threads:
            feeds[f"new_t{t}"] = lambda e, t=t: reader.iter_batches(a.batch, shuffle=True, seed=0, epoch=e, device=dev,
                                                                     gather_threads=t)
            if dev.type == "cuda" and t in a.old_threads:
                feeds[f"old_t{t}"], ahead = old_feed(reader, dev, a.batch, t)
                aheads.append(ahead)
        names = list(feeds)
        rounds = {m: [] for m in names}
        for m in names:
            h.run(feeds[m], 1, "bf16")  # warm-up
        for r in range(a.rounds):
            for m in names[r % len(names):] + names[: r % len(names)]:  # rotated: no feed always runs first
                rounds[m].append(h.run(feeds[m], a.epochs, "bf16")[0] / a.epochs)
        med = {m: statistics.median(v) for m, v in rounds.items()}
        res["epoch_s"], res["epoch_s_rounds"] = med, rounds
        res["store_vs_ram"] = {m: med[m] / med["ram"] for m in names if m != "ram"}
        res["stream_only_epoch_s"] = {m: gt.stream_only(feeds[m], a.rounds, dev) for m in names if m != "ram"}
        print(f"{name}: epoch s " + ", ".join(f"{m} {v:.3f}" for m, v in med.items()) + "; store/RAM "
              + ", ".join(f"{m} {v:.3f}" for m, v in res["store_vs_ram"].items()) + "; stream alone "
              + ", ".join(f"{m} {v:.3f}" for m, v in res["stream_only_epoch_s"].items()), flush=True)
        for ahead in aheads:
            ahead.close()
        reader.close()
    return res


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true", help="small models at 32 px (checks the script on a CPU)")
    ap.add_argument("--models", nargs="+", default=["deit_b16", "resnet50"], choices=list(gt.CASES))
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--epochs", type=int, default=3, help="epochs per heal (default 3)")
    ap.add_argument("--rounds", type=int, default=6, help="rounds of every feed (default 6)")
    ap.add_argument("--threads", nargs="+", type=int, default=[4, 1], help="gather threads of the new stream")
    ap.add_argument("--old-threads", nargs="+", type=int, default=[4], help="gather threads of the old stream")
    ap.add_argument("--deit-images", type=int, default=512, help="DeiT-B calibration images (default 512)")
    ap.add_argument("--json", type=Path)
    a = ap.parse_args(argv)
    a.images = {"deit_b16": a.deit_images}
    return gt.per_model("stream_ab", a, measure)

if __name__ == "__main__":
    main()
