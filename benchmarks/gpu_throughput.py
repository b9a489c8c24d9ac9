"""Healing throughput on an accelerator at 224 px (issue #33): a randomly initialised timm DeiT-B/16 and ResNet-50
(pretrained off), synthetic images, the real target store and the STARFISH loop of the trials.

Per model it prints and returns:
- the dense pass (dense targets written to the store): images/s and the store's write bandwidth;
- STARFISH heal images/s per ``heal.precision`` (fp32 as the authors run it, tf32, bf16 autocast), targets streamed
  from the store, and the model FLOP utilisation: FLOPs of one step (forward + backward, ``torch.utils.
  flop_counter``) x images/s over the chip's dense bf16 peak, measured here with a large bf16 matrix product;
- the same with ``heal.compile: blocks`` (``--compiled``, default bf16; its first epoch, compilation included, as
  ``warmup_s``), and at other batch sizes (``--extra-batches``), eager and compiled, targets in RAM;
- store-streamed vs in-RAM (targets already on the device) epoch (per epoch over heals of ``--mode-epochs``),
  bf16, median of interleaved repeats, eager and compiled; the store's stream alone (no step), by gather threads
  too (``--stream-threads``; on an H100: 2.59 s an epoch of DeiT-B before the pinned ring and kept maps, 0.60 /
  0.26 / 0.19 s after with 1 / 4 / 8 threads);
- recompute (dense forward per batch) epoch, the planner's pick (tasks/healing/planner.py) and the pick's epoch
  over the faster of the two measured;
- peak GPU memory.

    python benchmarks/gpu_throughput.py                        # DeiT-B/16 and ResNet-50, on cuda
    python benchmarks/gpu_throughput.py --device cpu --tiny    # small models at 32 px: checks the script
"""
from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere
from tasks.healing import HEALERS, HealConfig, HealContext, dense_targets, in_memory_batches, recompute_batches  # noqa: E402
from tasks.healing.loop import steps_per_epoch  # noqa: E402
from tasks.healing.planner import pick, time_target_modes  # noqa: E402
from tasks.models import ModelRef, build_untrained, get_adapter  # noqa: E402
from tasks.pruning import apply_masks, make_masks, mask_violations  # noqa: E402
from tasks.store import TargetStore  # noqa: E402

CASES = {  # name -> (timm arch, images, model args of --tiny)
    "deit_b16": ("deit_base_patch16_224", 1024, {"img_size": 32, "patch_size": 8, "depth": 2, "embed_dim": 64,
                                                "num_heads": 2}),
    "resnet50": ("resnet50", 256, {"layers": [1, 1, 1, 1]}),
}


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def bf16_peak(dev: torch.device, n: int = 8192, reps: int = 10) -> float:
    """Dense bf16 matrix-product rate, FLOP/s (median of ``reps`` products of random n x n matrices)."""
    if dev.type != "cuda":
        n, reps = 512, 3
    a, b = (torch.randn(n, n, device=dev, dtype=torch.bfloat16) for _ in range(2))
    for _ in range(3):
        a @ b
    times = []
    for _ in range(reps):
        sync(dev)
        t = time.perf_counter()
        a @ b
        sync(dev)
        times.append(time.perf_counter() - t)
    return 2 * n**3 / statistics.median(times)


def step_flops(model: torch.nn.Module, x: torch.Tensor, precision: str) -> float:
    """FLOPs of one forward + backward of ``model`` on batch ``x`` (matmuls and convolutions), per image."""
    from torch.utils.flop_counter import FlopCounterMode

    from tasks.healing.precision import forward_context

    with FlopCounterMode(display=False) as fc:
        with forward_context(precision, x.device):
            out = model(x)
        out.float().sum().backward()
    model.zero_grad(set_to_none=True)
    return fc.get_total_flops() / len(x)


def build(name: str, tiny: bool, dev: torch.device):
    arch, n, tiny_args = CASES[name]
    size = 32 if tiny else 224
    model = build_untrained(ModelRef(name, "timm", arch=arch, pretrained=False,
                                     model_args=tiny_args if tiny else None)).to(dev)
    images = torch.randn(64 if tiny else n, 3, size, size, generator=torch.Generator().manual_seed(0))
    return model, get_adapter(model), images


def write_targets(store: TargetStore, key: str, dense, blocks, images, shard: int, dev) -> dict:
    """The dense pass as the dense stage runs it (one forward per shard, shard written): rate and bandwidth."""
    sync(dev)
    t = time.perf_counter()
    infos = [store.write_shard(key, i, a, dense_targets(dense, blocks, images[a:b], batch_size=shard))
             for i, a, b in store.shard_plan(len(images), shard)]
    sync(dev)
    secs = time.perf_counter() - t
    store.finalize(key, meta={"bench": "gpu_throughput"}, block_shapes=infos[0]["block_shapes"], dtype="float16",
                   num_rows=len(images), shard_infos=infos)
    written = sum(f.stat().st_size for f in Path(store.root, key).glob("*.arrow"))
    return {"dense_images_per_s": len(images) / secs, "dense_write_gb_per_s": written / secs / 1e9,
            "targets_gb": written / 1e9}


class Healer:
    """Times STARFISH heals of fresh pruned copies of ``dense`` (magnitude 0.5 on the default scope)."""

    def __init__(self, dense, adapter, images_dev, batch: int):
        self.dense, self.adapter, self.images, self.batch = dense, adapter, images_dev, batch
        self.scope = adapter.default_scope
        self.masks = make_masks(dense, adapter.scope(dense, self.scope), "magnitude", 0.5, seed=0)

    def run(self, batches, epochs: int, precision: str, compile_mode: str = "off", on_epoch=None, graph: str = "off"
            ) -> tuple[float, torch.nn.Module]:
        model = copy.deepcopy(self.dense)
        apply_masks(model, self.masks)
        ctx = HealContext(model, self.adapter.blocks(model), self.adapter.scope(model, self.scope), self.masks,
                          self.images, batches, steps_per_epoch(len(self.images), self.batch),
                          self.adapter.default_granularity)
        dev = self.images.device
        sync(dev)
        t = time.perf_counter()
        HEALERS.get("starfish").heal(ctx, HealConfig(lr=1e-4, epochs=epochs, batch_size=self.batch, seed=0,
                                                     precision=precision, compile=compile_mode, graph=graph),
                                       on_epoch)
        sync(dev)
        return time.perf_counter() - t, model


def precisions(h: Healer, feeds: dict, epochs: int, flops: dict, peak: float, which=("fp32", "tf32", "bf16"),
               compiled=("bf16",)) -> dict:
    """Heal rate per precision, eager (``heal.compile: off``), and per precision in ``compiled`` with ``heal.compile:
    blocks`` too (key ``<precision>+blocks``; ``warmup_s``: its first epoch, compilation included)."""
    out = {}
    for prec, mode in [(p, "off") for p in which] + [(p, "blocks") for p in compiled]:
        warm, _ = h.run(feeds["store"], 1, prec, mode)  # warm-up: kernels, allocator, page cache, compilation
        secs, model = h.run(feeds["store"], epochs, prec, mode)
        rate = len(h.images) * epochs / secs
        out[prec if mode == "off" else f"{prec}+{mode}"] = {
            "heal_images_per_s": rate, "mfu": flops[prec] * rate / peak, "warmup_s": warm,
            "mask_violations": mask_violations(model, h.masks)}
    return out


def feeds_for(reader, in_ram, h: Healer, dev) -> dict:
    blocks = h.adapter.blocks(h.dense)
    order = lambda e: reader.epoch_order(shuffle=True, seed=0, epoch=e)  # noqa: E731 - same rows as the store
    return {"store": lambda e: reader.iter_batches(h.batch, shuffle=True, seed=0, epoch=e, device=dev),
            "ram": in_memory_batches(in_ram, h.batch, 0, order=order),
            "recompute": lambda e: recompute_batches(h.dense, blocks, h.images, h.batch, 0, e)}


def modes(h: Healer, feeds: dict, repeats: int, prec: str, compile_mode: str = "off", epochs: int = 3) -> dict:
    """Seconds per epoch of each feed over heals of ``epochs`` epochs, interleaved (median of ``repeats``; a trial
    heals for several epochs, and the store's stream starts each epoch while the one before ends), the planner's
    pick and how it compares with the faster."""
    t = {m: [] for m in ("store", "ram", "recompute")}
    for m in t:
        h.run(feeds[m], 1, prec, compile_mode)
    for _ in range(repeats):
        for m in t:
            t[m].append(h.run(feeds[m], epochs, prec, compile_mode)[0] / epochs)
    med = {m: statistics.median(v) for m, v in t.items()}
    probe = time_target_modes(h.dense, h.adapter, h.scope, h.images, h.batch, precision=prec)
    chosen = pick(probe)
    best = min(med["store"], med["recompute"])
    return {"epoch_s": med, "store_vs_ram": med["store"] / med["ram"], "planner_probe_s_per_step": probe,
            "planner_pick": chosen, "faster_measured": "store" if med["store"] <= med["recompute"] else "recompute",
            "pick_vs_best": med[chosen] / best}


def measure(name: str, a, dev: torch.device, peak: float) -> dict:
    dense, adapter, images = build(name, a.tiny, dev)
    images_dev = images.to(dev, memory_format=torch.channels_last if name == "resnet50" and dev.type == "cuda"
                           else torch.preserve_format)
    if name == "resnet50" and dev.type == "cuda":
        dense = dense.to(memory_format=torch.channels_last)  # heal.channels_last: auto
    flops = {p: step_flops(copy.deepcopy(dense), images_dev[: a.batch], p) for p in ("fp32", "tf32", "bf16")}
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    with tempfile.TemporaryDirectory(dir=a.store) as tmp:
        store = TargetStore(Path(tmp))
        res = {"model": CASES[name][0], "images": len(images), "image_size": images.shape[-1], "batch": a.batch,
               "gflops_per_image_step": flops["fp32"] / 1e9,
               **write_targets(store, "7" * 32, dense, adapter.blocks(dense), images_dev, a.shard, dev)}
        reader = store.open("7" * 32)
        in_ram = {k: v.to(dev) for k, v in reader.load_all().items()}
        h = Healer(dense, adapter, images_dev, a.batch)
        feeds = feeds_for(reader, in_ram, h, dev)
        compiled = a.compiled if name in a.compile_models else []
        res["precision"] = precisions(h, feeds, a.epochs, flops, peak, a.precisions, compiled)
        res["modes_bf16"] = modes(h, feeds, a.repeats, "bf16", epochs=a.mode_epochs)
        if compiled:  # the store's stream behind a compiled step (heal.compile: blocks)
            res["modes_bf16_blocks"] = modes(h, feeds, a.repeats, "bf16", "blocks", a.mode_epochs)
        res["batches_bf16"] = {f"{b}{'+blocks' if mode == 'blocks' else ''}": by_batch(h, in_ram, b, flops["bf16"], peak, mode)
                               for b in a.extra_batches for mode in ("off", "blocks") if mode == "off" or compiled}
        res["store_stream_only_epoch_s"] = stream_only(feeds["store"], a.repeats, dev)
        res["store_stream_only_by_threads_s"] = {  # the gather's threads (tasks/store/stream.py), no consumer
            t: stream_only(lambda e, t=t: reader.iter_batches(h.batch, shuffle=True, seed=0, epoch=e, device=dev,
                                                              gather_threads=t), a.repeats, dev)
            for t in a.stream_threads}
        reader.close()
    res["peak_gpu_memory_gib"] = torch.cuda.max_memory_allocated(dev) / 2**30 if dev.type == "cuda" else None
    return res


def by_batch(h: Healer, in_ram: dict, batch: int, flops: float, peak: float, mode: str = "blocks") -> dict:
    """bf16 (heal.compile ``mode``) at another batch size, targets in RAM: what the step does when the batch (not
    the paper's 32) amortises per-step work. -> images/s, MFU."""
    other = Healer(h.dense, h.adapter, h.images, batch)
    feed = in_memory_batches(in_ram, batch, 0)
    other.run(feed, 1, "bf16", mode)
    secs, _ = other.run(feed, 2, "bf16", mode)
    rate = 2 * len(h.images) / secs
    return {"heal_images_per_s": rate, "mfu": flops * rate / peak}


def stream_only(feed, repeats: int, dev: torch.device) -> float:
    """Median seconds of one epoch of the store's stream with no consumer work (the reader's own ceiling)."""
    times = []
    for e in range(repeats + 1):
        sync(dev)
        t = time.perf_counter()
        for _rows, tgt in feed(e):
            pass
        sync(dev)
        times.append(time.perf_counter() - t)
    return statistics.median(times[1:])


def profile(name: str, a, dev: torch.device) -> str:
    """torch.profiler over a few bf16 steps (targets in RAM on the device: the step alone): where a step's time goes,
    host (launches, Python) vs device (kernels). -> two tables, by device time and by host time."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    dense, adapter, images = build(name, a.tiny, dev)
    images = images[: a.batch * 4].to(dev)
    targets = dense_targets(dense, adapter.blocks(dense), images, out=None)
    h = Healer(dense, adapter, images, a.batch)
    feed = in_memory_batches(targets, a.batch, 0)
    h.run(feed, 1, "bf16", a.profile_compile)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    with torch_profile(activities=acts) as prof:
        secs, _ = h.run(feed, 2, "bf16", a.profile_compile)
    key = "self_cuda_time_total" if dev.type == "cuda" else "self_cpu_time_total"
    ev = prof.key_averages()
    busy = sum(getattr(e, "self_device_time_total", 0) for e in ev) / 1e6
    head = (f"{name}: {2 * len(images) // a.batch} bf16 steps (heal.compile {a.profile_compile}), batch {a.batch}: "
            f"wall {secs:.3f} s, device kernels "
            f"{busy:.3f} s ({100 * busy / secs:.0f} % busy), {sum(e.count for e in ev if e.key.startswith('cuda'))} "
            "CUDA runtime calls")
    return "\n".join([head, ev.table(sort_by=key, row_limit=22),
                      ev.table(sort_by="self_cpu_time_total", row_limit=12)])


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda", help="cuda (default), cuda:N or cpu")
    ap.add_argument("--tiny", action="store_true", help="small models at 32 px (checks the script on a CPU)")
    ap.add_argument("--models", nargs="+", default=list(CASES), choices=list(CASES))
    ap.add_argument("--batch", type=int, default=32, help="the paper's batch size (default 32)")
    ap.add_argument("--precisions", nargs="+", default=["fp32", "tf32", "bf16"], choices=("fp32", "tf32", "bf16"))
    ap.add_argument("--compiled", nargs="*", default=["bf16"], choices=("fp32", "tf32", "bf16"),
                    help="precisions also measured with heal.compile: blocks (default bf16; none: eager only)")
    ap.add_argument("--compile-models", nargs="*", default=["deit_b16"], choices=list(CASES),
                    help="models --compiled applies to (default deit_b16: compiling ResNet-50's 8 block shapes took "
                         "over 2 minutes on an H100 host)")
    ap.add_argument("--extra-batches", nargs="*", type=int, default=[], metavar="B",
                    help="bf16 + heal.compile blocks also at these batch sizes (targets in RAM)")
    ap.add_argument("--profile-compile", default="off", choices=("off", "blocks"), help="--profile: heal.compile")
    ap.add_argument("--epochs", type=int, default=2, help="timed store-streamed epochs per precision")
    ap.add_argument("--repeats", type=int, default=3, help="interleaved heals per target feed")
    ap.add_argument("--mode-epochs", type=int, default=3, help="epochs per heal when timing store / RAM / recompute "
                    "(seconds per epoch; 1 before 2026-11-27)")
    ap.add_argument("--stream-threads", nargs="*", type=int, default=[1, 2, 4, 8], metavar="T",
                    help="the store's stream alone with these gather threads (default 1 2 4 8)")
    ap.add_argument("--shard", type=int, default=64, help="store shard size (rows)")
    ap.add_argument("--store", help="directory for the temporary store (default: the system's temp dir)")
    ap.add_argument("--json", type=Path, help="also write the results here")
    ap.add_argument("--profile", type=Path, help="instead: write torch.profiler tables of bf16 steps here")
    return ap.parse_args(argv)


def open_device(script: str, device: str) -> torch.device:
    """``device`` as a torch device; one line (SystemExit), not a traceback, when it is CUDA and there is none."""
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit(f"{script}: no CUDA device; check the script on the CPU with --device cpu --tiny")
    return dev


def per_model(script: str, a: argparse.Namespace, measure_one) -> dict:
    """``measure_one(name, a, dev)`` for each of ``a.models`` under a header (date, torch, device); with ``a.json``
    the results are written after each model (a time limit loses only the model it cuts)."""
    dev = open_device(script, a.device)
    out = {"date_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()), "torch": torch.__version__,
           "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu", "models": {}}
    for name in a.models:
        out["models"][name] = measure_one(name, a, dev)
        if a.json:
            a.json.write_text(json.dumps(out, indent=1))
    return out


def run(a: argparse.Namespace) -> dict:
    dev = open_device("gpu_throughput", a.device)
    if a.profile:
        a.profile.write_text("\n\n".join(profile(name, a, dev) for name in a.models))
        return {}
    peak = bf16_peak(dev)
    out = {"device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu", "torch": torch.__version__,
           "bf16_peak_tflops": peak / 1e12, "models": {}}
    for name in a.models:
        out["models"][name] = measure(name, a, dev, peak)
        print(summary(name, out["models"][name]), flush=True)
        if a.json:  # after each model: a time limit loses only the model it cuts
            a.json.write_text(json.dumps(out, indent=1))
    return out


def summary(name: str, r: dict) -> str:
    p, m = r["precision"], r.get("modes_bf16_blocks", r["modes_bf16"])
    heal = ", ".join(f"{k} {v['heal_images_per_s']:.0f} img/s (MFU {100 * v['mfu']:.1f} %)" for k, v in
                     [*p.items(), *((f"bf16 batch {b}", v) for b, v in r["batches_bf16"].items())])
    return (f"{name} ({r['image_size']} px, {r['images']} images, batch {r['batch']}, "
            f"{r['gflops_per_image_step']:.1f} GFLOP/image-step)\n"
            f"  dense pass {r['dense_images_per_s']:.0f} img/s, writes {r['dense_write_gb_per_s']:.2f} GB/s "
            f"({r['targets_gb']:.2f} GB of targets)\n  heal: {heal}\n"
            f"  bf16{'+blocks' if 'modes_bf16_blocks' in r else ''} epoch: store {m['epoch_s']['store']:.3f} s, "
            f"RAM {m['epoch_s']['ram']:.3f} s "
            f"(store/RAM {m['store_vs_ram']:.3f}), recompute {m['epoch_s']['recompute']:.3f} s; planner picks "
            f"{m['planner_pick']}, faster measured {m['faster_measured']} (pick/best {m['pick_vs_best']:.3f}); "
            f"the store's stream alone {r['store_stream_only_epoch_s']:.3f} s; by gather threads "
            + ", ".join(f"{t}: {v:.3f} s" for t, v in r.get("store_stream_only_by_threads_s", {}).items()))


if __name__ == "__main__":
    run(parse_args())
