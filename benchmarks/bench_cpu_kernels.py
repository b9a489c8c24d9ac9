"""Another CPU's kernels on this machine: the same spec run twice, once with this CPU's kernels and once with the
kernels another x86 CPU would run, and how much of what the report quotes moves (issue #25: what is identical on
every machine and what is only within tolerance).

A CPU type changes results through the kernels torch picks for it: ATen's vectorised kernels (AVX-512, AVX2 or
none), oneDNN's convolutions and MKL's matrix products, each blocked and reduced in another order. The same
library can be told to pick another CPU's kernels (``ATEN_CPU_CAPABILITY``, ``ONEDNN_MAX_CPU_ISA``,
``MKL_ENABLE_INSTRUCTIONS``), so the second run computes what a machine of that CPU type computes with the same
torch build; the probe below prints a digest of a few kernels' outputs under both to show that they differ here.

Each run has its own store and model cache (dense targets, masks and rankings are computed under its kernels; the
shipped weights are the same file). Prints:
- the kernel probe (torch's CPU capability and a digest of matmul, conv, layer norm, softmax outputs) per run;
- the stores side by side: per kind (targets, masks, ...), keys present in both and how many hold identical
  content (tensors and columns; write times, compute seconds and node ids left out), and the dense target values
  that differ;
- per cell (every grid, every healer) |delta| of the quoted accuracy (``analysis.reported.cell_results``) in pp
  and in evaluation images: median, p90, max, cells over 1 / 2 / 5 pp; band class and best pruner x healer
  agreement; every ordering one run calls resolved that the other contradicts.

    python benchmarks/bench_cpu_kernels.py configs/default.yaml --isa avx2 --out runs/kernels
    python benchmarks/bench_cpu_kernels.py configs/default.yaml --reuse --out runs/kernels   # re-read finished runs
"""
from __future__ import annotations

import argparse
import functools
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks._sweeps import REPO, quoted, run_spec, uptime  # noqa: E402
from benchmarks.bench_retest import compare, print_agreement  # noqa: E402

# The kernels of an x86 CPU without AVX-512 (most AMD Zen 2/3, many Intel desktop parts) and of one without SIMD.
ISAS = {
    "avx2": {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"},
    "default": {"ATEN_CPU_CAPABILITY": "default", "ONEDNN_MAX_CPU_ISA": "SSE41", "MKL_ENABLE_INSTRUCTIONS": "SSE4_2",
                "MKL_CBWR": "COMPATIBLE"},
}

PROBE = """
import hashlib, torch
torch.manual_seed(0)
a, b = torch.randn(257, 193), torch.randn(193, 131)
x, conv = torch.randn(64, 3, 16, 16), torch.nn.Conv2d(3, 16, 3)
y = a @ b
outs = [y, torch.softmax(y, 1), torch.nn.functional.layer_norm(y, (131,)), torch.nn.functional.gelu(y), conv(x)]
h = hashlib.sha256(b"".join(t.detach().numpy().tobytes() for t in outs)).hexdigest()[:16]
print(torch.backends.cpu.get_cpu_capability(), h)
"""


def probe(env: dict) -> str:
    """torch's CPU capability and a digest of a few kernels' outputs under ``env``."""
    r = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, check=True,
                       env={**os.environ, **env})
    return r.stdout.strip()


VOLATILE = {"provenance", "created"}  # a mask's compute seconds and node, a target manifest's write time


def _content(f: Path) -> bytes:
    """What a store file holds, without what records when, where or how fast it was made: safetensors tensors,
    Arrow/Parquet columns (not their metadata: diagnostics record their node ids), JSON without ``VOLATILE``."""
    if f.suffix == ".safetensors":
        from safetensors.numpy import load_file

        t = load_file(str(f))
        return b"".join(k.encode() + str(t[k].dtype).encode() + t[k].tobytes() for k in sorted(t))
    if f.suffix in (".arrow", ".parquet"):
        return b"".join(n.encode() + v.tobytes() for n, v in _columns(f))
    if f.suffix == ".json":
        def strip(o):
            if isinstance(o, dict):
                return {k: strip(v) for k, v in o.items() if k not in VOLATILE}
            return [strip(v) for v in o] if isinstance(o, list) else o
        return json.dumps(strip(json.loads(f.read_text())), sort_keys=True).encode()
    return f.read_bytes()


@functools.lru_cache(maxsize=None)  # store_files and target_values_differing read each shard once
def _columns(f: Path) -> tuple[tuple[str, np.ndarray], ...]:
    """(name, values) per column of an Arrow IPC or Parquet file; list columns flattened."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    tab = pq.read_table(str(f)) if f.suffix == ".parquet" else pa.ipc.open_file(str(f)).read_all()
    out = []
    for n in tab.column_names:
        c = tab[n].combine_chunks()
        c = c.flatten() if hasattr(c, "flatten") else c
        numeric = pa.types.is_integer(c.type) or pa.types.is_floating(c.type) or pa.types.is_boolean(c.type)
        out.append((n, np.asarray(c) if numeric else np.array([repr(x) for x in c.to_pylist()])))
    return tuple(out)


def store_files(root: Path) -> dict[tuple[str, str], str]:
    """(kind, key) -> digest of the key's content, where kind is the store's top-level folder (targets, masks,
    ...) and key a folder or file below it; locks, use stamps and check records are left out."""
    keys: dict[tuple[str, str], object] = {}
    for kind_dir in sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith(".")):
        for f in sorted(p for p in kind_dir.rglob("*") if p.is_file() and ".quarantine" not in p.parts):
            if f.name in ("lock", "last_use", "verified.json") or f.name.startswith("."):
                continue
            rel = f.relative_to(kind_dir)
            key = str(rel.parts[0]) if len(rel.parts) > 1 else rel.stem
            h = keys.setdefault((kind_dir.name, key), hashlib.sha256())
            h.update(str(rel).encode() + b"\0" + _content(f))
    return {k: h.hexdigest() for k, h in keys.items()}


def target_values_differing(a: Path, b: Path) -> tuple[int, int]:
    """(values that differ, values) over the dense-target shards both stores hold (float16/bfloat16 bit patterns)."""
    diff = total = 0
    for fa in sorted((a / "targets").rglob("shard-*.arrow")):
        fb = b / "targets" / fa.relative_to(a / "targets")
        if fb.is_file():
            for (_, va), (_, vb) in zip(_columns(fa), _columns(fb)):
                diff, total = diff + int((va != vb).sum()), total + va.size
    return diff, total


def store_table(a: Path, b: Path) -> list[str]:
    fa, fb = store_files(a), store_files(b)
    lines = []
    for kind in sorted({k for k, _ in fa} | {k for k, _ in fb}):
        ka = {key for k, key in fa if k == kind}
        kb = {key for k, key in fb if k == kind}
        both = ka & kb
        same = sum(fa[(kind, key)] == fb[(kind, key)] for key in both)
        lines.append(f"  {kind}: {len(ka)} / {len(kb)} keys, {len(both)} in both, {same} with identical content")
    diff, total = target_values_differing(a, b)
    if total:
        lines.append(f"  dense target values that differ: {diff} of {total} ({100 * diff / total:.3f} %)")
    return lines


def all_cells(a, b) -> dict:
    """|delta| over every cell both runs quote (closed-form healers included), in pp and evaluation images."""
    cells = sorted(set(a.index) & set(b.index))
    d = np.array([abs(float(a.loc[c, "healed_acc"]) - float(b.loc[c, "healed_acc"])) for c in cells]) * 100
    n_eval = float(a["n_eval"].iloc[0]) if "n_eval" in a else float("nan")
    return {"cells": len(cells), "d": d, "images": d * n_eval / 100, "n_eval": n_eval}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("spec", nargs="?", default=str(REPO / "configs" / "default.yaml"))
    ap.add_argument("--isa", choices=sorted(ISAS), default="avx2", help="the other CPU's kernels (default: avx2)")
    ap.add_argument("--out", default=str(REPO / "runs" / "kernels"))
    ap.add_argument("--reuse", action="store_true", help="read run directories that already hold a report")
    a = ap.parse_args(argv)
    out = Path(a.out)
    envs = {"native": {}, a.isa: ISAS[a.isa]}
    print("uptime:", uptime(), flush=True)
    for name, env in envs.items():
        print(f"kernels {name} {json.dumps(env)}: capability, output digest = {probe(env)}", flush=True)
    runs = {}
    for name, env in envs.items():
        spec = yaml.safe_load(Path(a.spec).read_text())
        spec["name"] = f"{spec.get('name', 'kernels')}-{name}"
        runs[name] = run_spec(spec, out / name, str(out / f"store-{name}"), str(out / f"cache-{name}"), a.reuse, env)
        print(f"{name}: {runs[name][0]} wall {runs[name][1]:.0f} s", flush=True)
    print("uptime:", uptime())
    print("stores (native / other):")
    print("\n".join(store_table(out / "store-native", out / f"store-{a.isa}")))
    qa, qb = quoted(runs["native"][0]), quoted(runs[a.isa][0])
    r = all_cells(qa, qb)
    d, img = r["d"], r["images"]
    print(f"every quoted cell ({r['cells']}, {r['n_eval']:.0f} evaluation images: 1 image = {100 / r['n_eval']:.2f} pp):"
          f" |delta| median {np.median(d):.2f} pp, p90 {np.percentile(d, 90):.2f}, max {d.max():.2f} pp"
          f" (max {img.max():.1f} images); identical {int((d == 0).sum())}, over 1 pp {int((d > 1).sum())},"
          f" over 2 pp {int((d > 2).sum())}, over 5 pp {int((d > 5).sum())}")
    grids = sorted(set(qa["grid"]) & set(qb["grid"]))
    c = compare(qa, qb, grids)
    print(f"searched cells ({c['cells']}, grids {', '.join(grids)}): median {c['median']:.2f} pp, p90 {c['p90']:.2f},"
          f" max {c['max']:.2f}; within 2 pp {100 * c['within2']:.1f} %, over 5 pp {c['over5']}")
    print_agreement(c)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
