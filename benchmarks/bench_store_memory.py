"""Bounded memory of the streaming reader.

``rss``: peak RSS of a heal-shaped read loop (one shuffled epoch of float32 targets + a reduction per block,
in a fresh process) at calibration sizes n and 8n of a synthetic DeiT-shaped target set (goal: <= +10%).
``big``: a synthetic DeiT-B-shaped set (12 x 197 x 768 float16 per row) of --gb gigabytes streamed through
the same loop without running out of memory; read throughput in GB/s. Data is deleted afterwards.
Prints figures only.

    python benchmarks/bench_store_memory.py rss [--n 128 --dim 192]
    python benchmarks/bench_store_memory.py big --gb 14 --dir /tmp     # check `df -h` first
"""
from __future__ import annotations

import argparse
import json
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tasks.store import TargetStore, content_key  # noqa: E402

KEY = content_key("bench-memory")


def write_set(root: Path, rows: int, blocks: int, tokens: int, dim: int, shard: int) -> float:
    """Synthetic targets written shard by shard (a random base shard plus the shard index): bounded memory."""
    st = TargetStore(root)
    base = torch.randn(shard, tokens, dim, generator=torch.Generator().manual_seed(0)).half()  # (S, T, D)
    infos = []
    t = time.perf_counter()
    for i, a, b in st.shard_plan(rows, shard):
        part = {f"blocks.{k}": (base[: b - a] + (i + k) * 0.01) for k in range(blocks)}
        infos.append(st.write_shard(KEY, i, a, part))
    st.finalize(KEY, meta={"bench": True}, block_shapes={f"blocks.{k}": [tokens, dim] for k in range(blocks)},
                dtype="float16", num_rows=rows, shard_infos=infos)
    return time.perf_counter() - t


def read_loop(root: str, rows: int, batch: int, light: bool = False) -> dict:
    """Heal-shaped: one shuffled epoch; per batch every block to float32 (B, T, D) and a reduction
    (``light``: only the first token of each block, so the figure is the read path, not the CPU compute)."""
    torch.set_num_threads(1)
    st = TargetStore(root)
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t = time.perf_counter()
    nbytes, acc = 0, 0.0
    with st.open(KEY, num_rows=rows, verify=False) as rd:
        for _, tgt in rd.iter_batches(batch, shuffle=True, seed=0, epoch=0):
            for v in tgt.values():
                nbytes += v.numel() * v.element_size()
                acc += float((v[:, 0] if light else v).float().pow(2).mean())
    secs = time.perf_counter() - t
    return {"rows": rows, "seconds": secs, "gb": nbytes / 1e9, "gbps": nbytes / 1e9 / secs,
            "rss_before_mb": rss0 / 1024, "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def child(root: Path, rows: int, batch: int, light: bool = False) -> dict:
    code = (f"import json,sys; sys.path.insert(0, {str(Path(__file__).resolve().parents[1])!r}); "
            f"sys.path.insert(0, {str(Path(__file__).resolve().parent)!r}); import bench_store_memory as b; "
            f"print(json.dumps(b.read_loop({str(root)!r}, {rows}, {batch}, {light})))")
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("mode", choices=["rss", "big"])
    ap.add_argument("--n", type=int, default=128, help="rss: calibration size n (8n is measured too)")
    ap.add_argument("--gb", type=float, default=14.0, help="big: size of the set in GB")
    ap.add_argument("--blocks", type=int, default=12)
    ap.add_argument("--tokens", type=int, default=197)
    ap.add_argument("--dim", type=int, default=None, help="default: 192 (rss), 768 (big)")
    ap.add_argument("--shard-size", type=int, default=32)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--dir", default=None, help="where to write the set (default: a temp dir)")
    a = ap.parse_args()
    dim = a.dim or (192 if a.mode == "rss" else 768)
    row_bytes = a.blocks * a.tokens * dim * 2
    tmp = Path(tempfile.mkdtemp(prefix="healsweep-bench-", dir=a.dir))
    try:
        if a.mode == "rss":
            rows = 8 * a.n
            w = write_set(tmp, rows, a.blocks, a.tokens, dim, a.shard_size)
            print(f"set: {rows} rows x ({a.blocks} x {a.tokens} x {dim}) float16 = {rows * row_bytes / 1e9:.2f} GB, "
                  f"shards of {a.shard_size} rows ({a.shard_size * row_bytes / 1e6:.0f} MB), written in {w:.1f} s")
            res = [child(tmp, n, a.batch) for n in (a.n, 8 * a.n, a.n, 8 * a.n)]
            for r in res:
                print(f"calib {r['rows']:>6}: {r['gb']:.2f} GB read in {r['seconds']:.1f} s ({r['gbps']:.2f} GB/s); "
                      f"RSS after imports {r['rss_before_mb']:.0f} MB, peak {r['peak_rss_mb']:.0f} MB")
            small = min(r["peak_rss_mb"] for r in res if r["rows"] == a.n)
            big = min(r["peak_rss_mb"] for r in res if r["rows"] == 8 * a.n)
            print(f"peak RSS 8n vs n: {big / small - 1:+.1%}  (goal <= +10%)")
        else:
            rows = int(a.gb * 1e9 // row_bytes)
            free = shutil.disk_usage(tmp).free
            if rows * row_bytes > 0.9 * free:
                raise SystemExit(f"not enough disk: {rows * row_bytes / 1e9:.1f} GB wanted, {free / 1e9:.1f} GB free")
            w = write_set(tmp, rows, a.blocks, a.tokens, dim, a.shard_size)
            print(f"set: {rows} rows x ({a.blocks} x {a.tokens} x {dim}) float16 = {rows * row_bytes / 1e9:.2f} GB "
                  f"in {len(list(tmp.glob('*/shard-*.arrow')))} shards, written in {w:.0f} s "
                  f"({rows * row_bytes / 1e9 / w:.2f} GB/s incl. sha256 + fsync)")
            r = child(tmp, rows, a.batch, light=True)
            print(f"streamed {r['gb']:.2f} GB in {r['seconds']:.1f} s: {r['gbps']:.2f} GB/s; peak RSS "
                  f"{r['peak_rss_mb']:.0f} MB (after imports {r['rss_before_mb']:.0f} MB)")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
