"""The healing step as one CUDA graph (``heal.graph: step``) against the eager step, bf16 STARFISH at 224 px (issue #33:
DeiT-B/16 at >= 35 % of the chip's dense bf16 peak; at the paper's batch 32 the eager step is bound by its host
thread: 14.3 % on an H200 on 2026-11-28). Models, data and heals are gpu_throughput.py's; targets are already on the
device, so the step alone is timed.

Per model and batch size, every variant of ``heal.compile`` (off, blocks) x ``heal.graph`` (off, step), and the
captured step with the post-step as it was until 2026-11-29 (key ``...+full``: every tensor restored, every weight
copied for the guard; bench_post_step.py) and, for DeiT-B, the captured compiled step with its images and patch
embedding channels_last (key ``...+cl``: ``heal.channels_last: true``; the 2026-11-26 profile spent 0.33 ms a step in
the NCHW patch-embedding convolution), interleaved over ``--repeats`` rounds after one warm-up heal each
(compilation; Inductor's cache keeps it for the rounds): each round heals ``--epochs`` epochs and times epochs 2..
between the loop's per-epoch reports (each after its one synchronisation), so the first epoch's eager warm-up steps
and captures are not in the rate. Prints and returns
images/s and MFU (median of rounds, every round kept), each variant over eager, and the final weights of the captured
heal against the same heal uncaptured (``graph: off``; they differ by the float32 rounding of the learning rate).

    python benchmarks/gpu_graph.py --json OUT/graph.json             # on the GPU machine (~3 min on an H200, est.)
    python benchmarks/gpu_graph.py --device cpu --tiny --repeats 1    # checks the script (nothing is captured)
"""
from __future__ import annotations

import argparse
import copy
import gc
import json
import statistics
import sys
import time
import warnings
from contextlib import nullcontext
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/: gpu_throughput's models and heals
from bench_post_step import full_post_step  # noqa: E402
from gpu_throughput import CASES, Healer, bf16_peak, build, per_model, step_flops, sync  # noqa: E402
from tasks.healing import dense_targets, in_memory_batches  # noqa: E402

VARIANTS = [("off", "off", "", ""), ("off", "step", "", ""), ("blocks", "off", "", ""), ("blocks", "step", "", "")]
# (heal.compile, heal.graph, post-step: "" the loop's, "full" as before 2026-11-29, layout: "" heal.channels_last auto,
# "cl" channels_last); measure() adds the captured step with "full" and, for a ViT, with "cl"


def steady_rate(h: Healer, feed, epochs: int, compile_mode: str, graph: str, failed: list[str], post: str = ""
                ) -> tuple[float, torch.nn.Module]:
    """Images/s over epochs 2..``epochs`` of one bf16 heal (the first holds warm-up steps and captures); heal.graph's
    warnings (a batch shape whose capture failed heals eagerly) are added to ``failed``."""
    marks: list[float] = []

    def on_epoch(epoch: int, _m: dict) -> None:
        marks.append(time.perf_counter())  # after the epoch's one synchronisation (the guard's check)

    with warnings.catch_warnings(record=True) as caught, full_post_step() if post == "full" else nullcontext():
        warnings.simplefilter("always")
        _, model = h.run(feed, epochs, "bf16", compile_mode, on_epoch, graph)
    failed.extend(f"{compile_mode}+{graph}: {w.message}" for w in caught if "heal.graph" in str(w.message))
    release(h.images.device, f"{_key(compile_mode, graph, post)} {epochs} epochs")
    return len(h.images) * (epochs - 1) / (marks[-1] - marks[0]), model


MEMORY: list = []  # after each heal: [heal, GiB reserved, GiB allocated]


def release(dev: torch.device, what: str) -> None:
    """After a heal: collect cycles and hand the allocator's free blocks back (a destroyed graph's private pool is
    freed only then), and note what stays. The first H200 run (2026-11-30), without this, ran out of memory in
    DeiT-B's first timed round with 125.5 GiB reserved but unallocated, 6.4 GiB of it allocated in private pools."""
    if dev.type != "cuda":
        return
    gc.collect()
    torch.cuda.empty_cache()
    MEMORY.append([what, torch.cuda.memory_reserved(dev) / 2**30, torch.cuda.memory_allocated(dev) / 2**30])


def weight_gap(a: torch.nn.Module, b: torch.nn.Module) -> float:
    """Largest |w_a - w_b| over every floating-point entry of the two models' state."""
    sa, sb = a.state_dict(), b.state_dict()
    return max(float((sa[k].float() - sb[k].float()).abs().max()) for k in sa if sa[k].is_floating_point())


def measure(name: str, a: argparse.Namespace, dev: torch.device) -> dict:
    peak = bf16_peak(dev)
    dense, adapter, images = build(name, a.tiny, dev)
    cnn = name == "resnet50" and dev.type == "cuda"  # heal.channels_last: auto (a CNN on a GPU runs NHWC)
    images = images.to(dev, memory_format=torch.channels_last if cnn else torch.preserve_format)
    if cnn:
        dense = dense.to(memory_format=torch.channels_last)
    targets = dense_targets(dense, adapter.blocks(dense), images, batch_size=64, out=None)  # {block: (N, ...)} on
    # the device (until 2026-11-30 they stayed on the CPU, dense_targets' default: every step gathered its batch there)
    out = {"model": CASES[name][0], "images": len(images), "image_size": images.shape[-1],
           "bf16_peak_tflops": peak / 1e12, "batches": {}}
    variants = [v for v in VARIANTS if v[0] == "off" or name in a.compile_models]
    best = "blocks" if name in a.compile_models else "off"
    variants.append((best, "step", "full", ""))
    if hasattr(dense, "patch_embed"):  # a timm ViT: its patch embedding is a convolution over the images
        variants.append((best, "step", "", "cl"))
        dense_cl = copy.deepcopy(dense).to(memory_format=torch.channels_last)
        images_cl = images.contiguous(memory_format=torch.channels_last)
    for batch in a.batches:
        flops = step_flops(dense, images[:batch], "bf16")
        hs = {"": Healer(dense, adapter, images, batch)}
        if any(v[3] == "cl" for v in variants):
            hs["cl"] = Healer(dense_cl, adapter, images_cl, batch)
        feed = in_memory_batches(targets, batch, 0)
        failed: list[str] = []
        for v in list(variants):  # warm-up: kernels, allocator, compilation
            try:
                steady_rate(hs[v[3]], feed, 2, v[0], v[1], failed, v[2])
            except Exception as e:  # an added variant (+full, +cl) that fails costs the others nothing
                if v[2:] == ("", ""):
                    raise
                failed.append(f"{_key(*v)}: {type(e).__name__}: {e}"[:400])
                variants.remove(v)
        rounds: dict[str, list[float]] = {_key(*v): [] for v in variants}
        for _ in range(a.repeats):
            for c, g, post, lay in variants:
                oom = None
                try:
                    rounds[_key(c, g, post, lay)].append(steady_rate(hs[lay], feed, a.epochs, c, g, failed, post)[0])
                except torch.OutOfMemoryError as e:  # the round loses this heal, the others go on
                    oom = f"{_key(c, g, post, lay)}: out of memory: {str(e)[:300]}"
                if oom:  # outside the handler: its traceback no longer holds the heal's tensors
                    failed.append(oom)
                    release(dev, oom[:60])
        med = {k: statistics.median(v) for k, v in rounds.items() if v}
        h = hs[""]
        _, eager = steady_rate(h, feed, 2, "off", "off", failed)
        _, captured = steady_rate(h, feed, 2, "off", "step", failed)
        out["batches"][batch] = {
            "gflops_per_image_step": flops / 1e9,
            "images_per_s": med, "images_per_s_rounds": rounds,
            "mfu": {k: flops * v / peak for k, v in med.items()},
            "over_eager": {k: v / med.get("off+off", float("nan")) for k, v in med.items()},
            "captured_vs_eager_max_abs_weight_diff": weight_gap(eager, captured),
            "failed_captures": sorted(set(failed)), "memory_gib_after_heals": MEMORY[:]}
        MEMORY.clear()
        print(summary(name, batch, out["batches"][batch]), flush=True)
        if a.json:  # after each batch size too (per_model writes the whole file after each model)
            a.json.write_text(json.dumps({"partial": True, "models": {name: out}}, indent=1))
    sync(dev)
    if dev.type == "cuda":
        out["peak_gpu_memory_gib"] = torch.cuda.max_memory_allocated(dev) / 2**30
    return out


def _key(compile_mode: str, graph: str, post: str, layout: str = "") -> str:
    return f"{compile_mode}+{graph}" + "".join(f"+{x}" for x in (post, layout) if x)


def summary(name: str, batch: int, r: dict) -> str:
    return (f"{name} batch {batch} bf16 ({r['gflops_per_image_step']:.1f} GFLOP/image-step): "
            + ", ".join(f"compile {k.split('+')[0]} graph {k.split('+', 1)[1]} {v:.0f} img/s "
                        f"(MFU {100 * r['mfu'][k]:.1f} %, {r['over_eager'][k]:.2f}x)"
                        for k, v in r["images_per_s"].items())
            + f"; captured vs eager weights: max |diff| {r['captured_vs_eager_max_abs_weight_diff']:.2e}"
            + (f"; FAILED (captures, variants): {r['failed_captures']}" if r["failed_captures"] else ""))


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda", help="cuda (default), cuda:N or cpu")
    ap.add_argument("--tiny", action="store_true", help="small models at 32 px (checks the script on a CPU)")
    ap.add_argument("--models", nargs="+", default=list(CASES), choices=list(CASES))
    ap.add_argument("--batches", nargs="+", type=int, default=[32, 128], help="batch sizes (default 32, the "
                    "paper's, and 128)")
    ap.add_argument("--compile-models", nargs="*", default=["deit_b16"], choices=list(CASES),
                    help="models also measured with heal.compile: blocks (default deit_b16: compiling ResNet-50's "
                         "block shapes took over 110 s on an H100)")
    ap.add_argument("--epochs", type=int, default=3, help="epochs per timed heal (epochs 2.. are timed)")
    ap.add_argument("--repeats", type=int, default=2, help="interleaved rounds")
    ap.add_argument("--json", type=Path, help="also write the results here")
    a = ap.parse_args(argv)
    if a.epochs < 2:
        ap.error("--epochs must be at least 2 (the first epoch is not timed)")
    return a


if __name__ == "__main__":  # header (date, torch, device), each model's results written as it ends
    per_model("gpu_graph", parse_args(), measure)
