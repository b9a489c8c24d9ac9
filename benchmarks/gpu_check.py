"""The one prepared GPU check (issue #33): everything a lent GPU machine should measure, in one command that ends in
under 8 minutes and writes its raw results as JSON.

1. ``env``: GPU, driver, CUDA, torch, CPU cores.
2. ``install``: the offline bundle (``healsweep bundle``, docs/offline-install.md) installed with no index into a
   directory put on ``PYTHONPATH``.
3. ``sweep``: the default spec through ``healsweep run`` on the GPU, trials sharing it (``--resources
   gpu=F``: 1/F trials at once); GPU utilisation, memory and the processes on the GPU sampled every 0.5 s
   (nvidia-smi); the report written, failed trials counted, every quoted cell compared with the CPU run's
   (benchmarks/results/default_cpu_quoted.json; tolerance: docs/default-sweep.md, 1 pp).
4. ``throughput``: benchmarks/gpu_throughput.py (DeiT-B/16 and ResNet-50 at 224 px).
5. ``precision``: benchmarks/bench_cross_machine.py's 88 real digits trials healed on the GPU in fp32 and bf16
   (``--precisions``; compare with each other and with the CPU's: ``bench_cross_machine.py compare``).

    python3 benchmarks/gpu_check.py --bundle .bundle/healsweep-offline.tar.xz --out $OUT     # on the GPU machine
    python benchmarks/gpu_check.py --device cpu --tiny --out /tmp/gc    # the script itself, on a CPU (tiny spec)

Each section has its own time limit and its results are written as soon as it ends (``gpu_check.json``), so a
section that fails or runs out of time loses only itself.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
REFERENCE = REPO / "benchmarks" / "results" / "default_cpu_quoted.json"
TOLERANCE_PP = 1.0  # docs/default-sweep.md: a quoted cell on another machine within 1 pp


def sh(cmd: list[str] | str, timeout: float, env: dict | None = None, log: Path | None = None) -> dict:
    """Run ``cmd``; -> {rc, seconds, tail}; its output also goes to ``log``."""
    t = time.perf_counter()
    try:
        p = subprocess.run(cmd, shell=isinstance(cmd, str), cwd=REPO, env=env, timeout=timeout, text=True,
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        rc, out = p.returncode, p.stdout
    except subprocess.TimeoutExpired as e:
        rc, out = "timeout", (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
    if log is not None:
        log.write_text(out)
    return {"rc": rc, "seconds": round(time.perf_counter() - t, 1), "tail": out[-1500:]}


def env_section() -> dict:
    smi = sh("nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader", 30)
    torch_v = sh([sys.executable, "-c", "import torch, os; print(torch.__version__, torch.version.cuda, "
                                        "torch.cuda.is_available(), os.cpu_count())"], 60)
    return {"date_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()), "gpu": smi["tail"].strip(),
            "torch_cuda_available_cpus": torch_v["tail"].strip(), "python": sys.version.split()[0],
            "load": os.getloadavg()}


class GpuSampler(threading.Thread):
    """nvidia-smi every ``period`` s: GPU utilisation %, memory used MiB, processes using the GPU."""

    def __init__(self, period: float = 0.5):
        super().__init__(daemon=True)
        self.period, self.samples, self.stop = period, [], threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            t = time.time()
            try:
                u = subprocess.run(["nvidia-smi", "--query-gpu=utilization.gpu,memory.used",
                                    "--format=csv,noheader,nounits"], capture_output=True, text=True, timeout=5)
                p = subprocess.run(["nvidia-smi", "--query-compute-apps=pid", "--format=csv,noheader"],
                                   capture_output=True, text=True, timeout=5)
                util, mem = (float(x) for x in u.stdout.strip().splitlines()[0].split(","))
                self.samples.append((t, util, mem, len([ln for ln in p.stdout.splitlines() if ln.strip()])))
            except (OSError, ValueError, IndexError, subprocess.SubprocessError):
                pass
            self.stop.wait(self.period)

    def summary(self) -> dict:
        if not self.samples:
            return {"samples": 0}
        util = sorted(s[1] for s in self.samples)
        procs = [s[3] for s in self.samples]
        return {"samples": len(util), "util_mean": sum(util) / len(util), "util_median": util[len(util) // 2],
                "util_p90": util[int(0.9 * (len(util) - 1))], "mem_max_mib": max(s[2] for s in self.samples),
                "gpu_processes_max": max(procs), "share_with_4plus_processes": sum(p >= 4 for p in procs) / len(procs)}


def sweep_section(a, env: dict, out: Path) -> dict:
    spec = "configs/tiny.yaml" if a.tiny else "configs/default.yaml"
    heal = {k: v for k, v in (("precision", a.heal_precision), ("graph", a.heal_graph)) if v}
    if heal:  # the same spec healing in another heal.precision / heal.graph
        import yaml

        d = yaml.safe_load((REPO / spec).read_text())
        d.setdefault("heal", {}).update(heal)
        spec = str(Path(a.work) / f"spec-{'-'.join(heal.values())}.yaml")
        Path(spec).write_text(yaml.safe_dump(d, sort_keys=False))
    run_dir = Path(a.work) / "sweep"
    cmd = [sys.executable, "-m", "orchestrator.cli", "run", spec, "--out", str(run_dir), "--store",
           str(Path(a.work) / "store"), "--quiet", "--resources",
           "cpu=1" if a.device == "cpu" else f"gpu={a.gpu_share},cpu=1,dense_gpu={a.gpu_share}"]
    sampler = GpuSampler()
    if a.device != "cpu":
        sampler.start()
    res = sh(cmd, a.sweep_timeout, env=env, log=out / "logs" / "sweep.log")
    sampler.stop.set()
    res["gpu"] = sampler.summary()
    res["spec"], res["gpu_share"] = spec, a.gpu_share
    if res["rc"] == 0:
        cmp = sh([sys.executable, str(Path(__file__)), "compare", str(run_dir), "--reference", str(a.reference), "--save",
                  str(out / "sweep_quoted.json")], 300, env=env)
        res["vs_cpu"] = json.loads(cmp["tail"].strip().splitlines()[-1]) if cmp["rc"] == 0 else cmp
        res["report"] = (run_dir / "report.html").is_file()
    return res


def quoted_cells(run_dir: Path) -> dict:
    """{cell id: {grid, model, pruner, pattern, calib_size, healer, healed_acc, lr}} of a finished run (the number
    the report quotes per cell: analysis.reported.cell_results)."""
    sys.path.insert(0, str(REPO))
    from benchmarks._sweeps import quoted

    df = quoted(run_dir)
    keep = ["grid", "model", "pruner", "pattern", "calib_size", "healer", "healed_acc", "lr"]
    return {c: {k: (v.item() if hasattr(v, "item") else v) for k, v in row.items() if k in keep}
            for c, row in df.iterrows()}


def reference(run_dir: Path) -> dict:
    """A finished run's quoted cells with where and when they were made (the file ``compare`` reads)."""
    import platform

    import torch

    cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")),
               platform.processor())
    meta = json.loads((run_dir / "sweep.json").read_text())
    return {"made_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()), "spec": meta.get("name"), "cpu": cpu,
            "torch": torch.__version__, "cores": os.cpu_count(), "cells": quoted_cells(run_dir)}


def compare(run_dir: Path, reference: Path) -> dict:
    """Quoted cells of ``run_dir`` vs the reference's: |delta| in pp, how many within the tolerance."""
    ref = json.loads(reference.read_text())
    got, ref = quoted_cells(run_dir), ref.get("cells", ref)  # a reference file, or another run's quoted cells
    common = sorted(set(got) & set(ref))
    d = sorted(abs(got[c]["healed_acc"] - ref[c]["healed_acc"]) * 100 for c in common)
    worst = sorted(common, key=lambda c: -abs(got[c]["healed_acc"] - ref[c]["healed_acc"]))[:5]
    grids = sorted({ref[c]["grid"] for c in common})
    per_grid = {g: sum(abs(got[c]["healed_acc"] - ref[c]["healed_acc"]) * 100 <= TOLERANCE_PP
                       for c in common if ref[c]["grid"] == g) for g in grids}
    return {"cells": len(common), "only_here": len(set(got) - set(ref)), "only_reference": len(set(ref) - set(got)),
            "within_tolerance": sum(x <= TOLERANCE_PP for x in d), "tolerance_pp": TOLERANCE_PP,
            "within_by_grid": per_grid, "median_pp": d[len(d) // 2] if d else None, "max_pp": d[-1] if d else None,
            "worst": [(c, ref[c]["model"], ref[c]["pruner"], ref[c]["pattern"], ref[c]["calib_size"], ref[c]["healer"],
                       round(ref[c]["healed_acc"], 4), round(got[c]["healed_acc"], 4)) for c in worst]}


def install_section(a, out: Path) -> tuple[dict, dict]:
    """The bundle installed into ``--site`` with no index; -> (result, environment for the sections after it)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), a.site]), "RAY_USAGE_STATS_ENABLED": "0",
           "PYTHONUNBUFFERED": "1"}
    if not a.bundle:
        if Path(a.site).is_dir():  # installed by an earlier call on this machine
            return {"skipped": f"no --bundle: the site installed earlier in {a.site}"}, env
        return {"skipped": "no --bundle: the packages this Python has"}, {**env, "PYTHONPATH": str(REPO)}
    installer = Path(a.bundle).with_name("install.py")
    res = sh([sys.executable, str(installer), a.bundle, "--target", a.site], a.install_timeout,
             log=out / "logs" / "install.log")
    res["bundle_mb"] = round(Path(a.bundle).stat().st_size / 1e6, 1)
    return res, env


def throughput_section(a, env: dict, out: Path) -> dict:
    cmd = [sys.executable, "benchmarks/gpu_throughput.py", "--device", a.device, "--json", str(out / "throughput.json"),
           *a.throughput_args.split()]
    res = sh(cmd + (["--tiny"] if a.tiny else []), a.throughput_timeout, env=env, log=out / "logs" / "throughput.log")
    if (out / "throughput.json").is_file():
        res["results"] = json.loads((out / "throughput.json").read_text())
    return res


def precision_section(a, env: dict, out: Path) -> dict:
    res = {}
    for prec in a.precisions:
        path = out / f"digits_{prec}.json"
        cmd = [sys.executable, "benchmarks/bench_cross_machine.py", "run", "--out", str(path), "--device",
               "cpu" if a.device == "cpu" else "cuda", "--precision", prec, "--procs", str(a.procs)]
        res[prec] = sh(cmd, a.precision_timeout, env=env, log=out / "logs" / f"digits_{prec}.log")
    return res


SECTIONS = ("sweep", "throughput", "precision")


def main(argv=None) -> int:
    a = parse_args(argv)
    if a.cmd == "reference":
        Path(a.save).write_text(json.dumps(reference(Path(a.run_dir)), indent=1))
        return 0
    if a.cmd == "compare":
        if a.save:  # first: the run's cells survive a missing or unreadable reference
            Path(a.save).write_text(json.dumps(quoted_cells(Path(a.run_dir)), indent=1))
        print(json.dumps(compare(Path(a.run_dir), Path(a.reference))))
        return 0
    out = Path(a.out)
    (out / "logs").mkdir(parents=True, exist_ok=True)
    Path(a.work).mkdir(parents=True, exist_ok=True)
    results: dict = {"env": env_section(), "args": {k: v for k, v in vars(a).items() if k != "cmd"}}
    save = lambda: (out / "gpu_check.json").write_text(json.dumps(results, indent=1, default=str))  # noqa: E731
    results["install"], env = install_section(a, out)
    save()
    print(f"install: {results['install'].get('rc', 'skipped')} ({results['install'].get('seconds', 0)} s)", flush=True)
    runners = {"sweep": sweep_section, "throughput": throughput_section, "precision": precision_section}
    for name in a.sections:
        results[name] = runners[name](a, env, out)
        results[name + "_ended_utc"] = time.strftime("%H:%M:%S", time.gmtime())
        save()
        print(f"{name}: done at {results[name + '_ended_utc']}", flush=True)
    subprocess.run(["tar", "czf", str(out / "logs.tar.gz"), "-C", str(out), "logs"], check=False)
    subprocess.run(["rm", "-rf", str(out / "logs")], check=False)  # the device returns at most 8 files
    print(json.dumps({k: v for k, v in results.items() if k in ("env", "install")}, default=str)[:2000])
    return 0


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("cmd", nargs="?", default="check", choices=("check", "compare", "reference"),
                    help="check (default): run the sections; compare RUN_DIR [REFERENCE]: quoted cells vs a "
                         "reference; reference RUN_DIR --save FILE: write a run's quoted cells as a reference")
    ap.add_argument("run_dir", nargs="?", help="compare: a finished run directory")
    ap.add_argument("--reference", default=str(REFERENCE), help="the CPU run's quoted cells (check, compare)")
    ap.add_argument("--save", help="compare: also write the run's quoted cells here")
    ap.add_argument("--out", default="gpu_check_out", help="where the JSON results and logs go")
    ap.add_argument("--work", default="/tmp/healsweep-gpu-check", help="run directory, store and caches")
    ap.add_argument("--bundle", help="the offline bundle (.tar.xz; install.py next to it); none: use this Python's")
    ap.add_argument("--site", default="/tmp/healsweep-site",
                    help="where the bundle is installed (without --bundle: used when an earlier call installed it)")
    ap.add_argument("--device", default="cuda", help="cuda (default) or cpu (checks the script)")
    ap.add_argument("--tiny", action="store_true", help="the tiny spec and small models (checks the script)")
    ap.add_argument("--sections", nargs="+", default=list(SECTIONS), choices=SECTIONS)
    ap.add_argument("--gpu-share", type=float, default=0.125, help="GPU per trial (default 1/8: 8 trials share it)")
    ap.add_argument("--heal-precision", choices=("fp32", "tf32", "bf16"), help="sweep: override heal.precision")
    ap.add_argument("--heal-graph", choices=("off", "step"), help="sweep: override heal.graph")
    ap.add_argument("--throughput-args", default="--extra-batches 128 --repeats 2",
                    help="arguments of benchmarks/gpu_throughput.py (default: also batch 128; 2 interleaved 3-epoch "
                         "heals per target feed)")
    ap.add_argument("--precisions", nargs="+", default=["fp32", "bf16"], choices=("fp32", "tf32", "bf16"))
    ap.add_argument("--procs", type=int, default=8, help="precision section: trials at a time on the GPU")
    ap.add_argument("--install-timeout", type=float, default=90)
    ap.add_argument("--sweep-timeout", type=float, default=240)
    ap.add_argument("--throughput-timeout", type=float, default=270, help="both models, DeiT-B with heal.compile "
                    "and batch 128: 194 s on an H100 with 1-epoch timings (2026-11-27); ~220 s expected with 3")
    ap.add_argument("--precision-timeout", type=float, default=45, help="per precision")
    a = ap.parse_args(argv)
    if a.cmd in ("compare", "reference") and not a.run_dir:
        ap.error(f"{a.cmd} needs RUN_DIR")
    if a.cmd == "reference" and not a.save:
        ap.error("reference needs --save FILE")
    return a


if __name__ == "__main__":
    sys.exit(main())
