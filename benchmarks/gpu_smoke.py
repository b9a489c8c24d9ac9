"""GPU smoke benchmark: a randomly initialized timm DeiT-B (pretrained off), synthetic images, the real target
store (dense targets written as shards, read back per epoch) and the STARFISH healer on a CUDA device.

Prints: dense-target throughput, heal throughput (images/s, store-streamed epochs), peak GPU memory, and the
store-vs-RAM epoch ratio (same rows, same order; median of interleaved repeats). Figures only, no assertions.

    python benchmarks/gpu_smoke.py                       # DeiT-B, 512 images, batch 32, on cuda
    python benchmarks/gpu_smoke.py --device cpu --tiny   # a 2-block 32-px DeiT on the CPU: checks the script
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
from tasks.healing import HEALERS, HealConfig, HealContext, dense_targets, in_memory_batches, steps_per_epoch
from tasks.models import ModelRef, build_untrained, get_adapter
from tasks.pruning import apply_masks, make_masks, mask_violations
from tasks.store import TargetStore


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda", help="cuda (default), cuda:N or cpu")
    ap.add_argument("--tiny", action="store_true", help="a 2-block DeiT at 32 px instead of DeiT-B at 224 px")
    ap.add_argument("--arch", default="deit_base_patch16_224")
    ap.add_argument("--calib", type=int, default=512, help="synthetic calibration images")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--epochs", type=int, default=2, help="store-streamed heal epochs timed for throughput")
    ap.add_argument("--repeats", type=int, default=3, help="interleaved store/RAM epoch pairs for the ratio")
    ap.add_argument("--sparsity", type=float, default=0.5)
    ap.add_argument("--scope", default="qkv_out_mlp")
    ap.add_argument("--shard-size", type=int, default=64)
    ap.add_argument("--store", help="store root (default: a temporary directory)")
    return ap.parse_args(argv)


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def run(a: argparse.Namespace) -> dict:
    dev = torch.device(a.device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        print("gpu_smoke: no CUDA device (torch.cuda.is_available() is False); run it on a GPU machine, or "
              "check the script on the CPU with --device cpu --tiny", file=sys.stderr)
        raise SystemExit(2)
    size = 32 if a.tiny else 224
    args = {"img_size": 32, "patch_size": 8, "depth": 2} if a.tiny else None
    arch = "deit_tiny_patch16_224" if a.tiny else a.arch
    dense = build_untrained(ModelRef(arch, "timm", pretrained=False, model_args=args)).to(dev)
    adapter = get_adapter(dense)
    gen = torch.Generator().manual_seed(0)
    images = torch.randn(a.calib, 3, size, size, generator=gen)  # (N, 3, H, W) synthetic, CPU like real splits

    with tempfile.TemporaryDirectory() as tmp:
        store = TargetStore(Path(a.store or tmp))
        key = "5" * 32
        _sync(dev)
        t = time.perf_counter()
        infos = []
        for i, s, e in store.shard_plan(a.calib, a.shard_size):  # one dense pass per shard, as the dense stage
            infos.append(store.write_shard(key, i, s, dense_targets(dense, adapter.blocks(dense), images[s:e])))
        _sync(dev)
        dense_s = time.perf_counter() - t
        store.finalize(key, meta={"bench": "gpu_smoke"}, block_shapes=infos[0]["block_shapes"], dtype="float16",
                       num_rows=a.calib, shard_infos=infos)
        reader = store.open(key)
        in_ram = {k: v.to(dev) for k, v in reader.load_all().items()}  # the RAM variant: targets already on device
        masks = make_masks(dense, adapter.scope(dense, a.scope), "magnitude", a.sparsity, seed=0)

        def store_batches(epoch):
            return reader.iter_batches(a.batch, shuffle=True, seed=0, epoch=epoch)

        # the same targets in RAM, visited in the store's row order
        ram_batches = in_memory_batches(in_ram, a.batch, 0,
                                        order=lambda epoch: reader.epoch_order(shuffle=True, seed=0, epoch=epoch))

        def heal(batches, epochs: int) -> tuple[float, torch.nn.Module]:
            model = copy.deepcopy(dense)
            apply_masks(model, masks)
            entries = adapter.scope(model, a.scope)
            ctx = HealContext(model, adapter.blocks(model), entries, masks, images, batches,
                              steps_per_epoch(a.calib, a.batch), adapter.default_granularity)
            _sync(dev)
            t0 = time.perf_counter()
            HEALERS.get("starfish").heal(ctx, HealConfig(lr=6e-4, epochs=epochs, batch_size=a.batch, seed=0))
            _sync(dev)
            return time.perf_counter() - t0, model

        heal(ram_batches, 1)  # warm-up (kernels, allocator)
        if dev.type == "cuda":
            torch.cuda.reset_peak_memory_stats(dev)
        heal_s, healed = heal(store_batches, a.epochs)
        peak = torch.cuda.max_memory_allocated(dev) if dev.type == "cuda" else None
        t_store, t_ram = [], []
        for _ in range(a.repeats):
            t_store.append(heal(store_batches, 1)[0])
            t_ram.append(heal(ram_batches, 1)[0])
        reader.close()
    res = {
        "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu", "arch": arch, "image_size": size,
        "calib": a.calib, "batch": a.batch, "scope": a.scope, "sparsity": a.sparsity,
        "dense_images_per_s": round(a.calib / dense_s, 1),
        "heal_images_per_s": round(a.calib * a.epochs / heal_s, 1),
        "peak_gpu_memory_gib": None if peak is None else round(peak / 2**30, 2),
        "store_s_per_epoch": round(statistics.median(t_store), 4), "ram_s_per_epoch": round(statistics.median(t_ram), 4),
        "store_vs_ram_ratio": round(statistics.median(t_store) / statistics.median(t_ram), 3),
        "mask_violations": mask_violations(healed, masks),
    }
    return res


def main(argv=None) -> None:
    a = parse_args(argv)
    r = run(a)
    print(f"{r['arch']} ({r['image_size']} px) on {r['device']}: {r['calib']} synthetic images, batch {r['batch']}, "
          f"scope {r['scope']}, magnitude {r['sparsity']}")
    print(f"dense targets      {r['dense_images_per_s']:>10} images/s (forward + store write)")
    print(f"heal (store)       {r['heal_images_per_s']:>10} images/s (STARFISH, targets streamed from the store)")
    print(f"peak GPU memory    {r['peak_gpu_memory_gib'] if r['peak_gpu_memory_gib'] is not None else 'n/a':>10} GiB")
    print(f"store vs RAM epoch {r['store_vs_ram_ratio']:>10} (store {r['store_s_per_epoch']} s, RAM {r['ram_s_per_epoch']} s; "
          f"median of {a.repeats})")
    print(f"mask violations    {r['mask_violations']:>10}")
    print(json.dumps(r))


if __name__ == "__main__":
    main()
