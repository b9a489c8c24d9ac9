"""Does a search design keep a big cluster busy? The default sweep on N trial slots of a real (local) Ray Tune.

The Ray counterpart of benchmarks/bench_slots.py (which drives the searcher with a virtual clock). A local Ray is
started with ``--slots`` logical CPUs on this machine (``include_dashboard=False``, fresh for each spec), and the
sweep's own ``DesignSearcher`` and Tuner settings (``make_tuner``: resources per trial from the spec, actor reuse
and its patches, FIFO unless the spec asks for ASHA, the sweep's pending-trial limit; ``max_concurrent_trials`` =
slots) run trials that only sleep: each sleeps its cell's recorded duration (``Replay.duration``: the median
``trial_seconds`` of the model x healer at that length in a finished sweep, ``--from``; times ``--time-scale``)
and reports the objective that sweep measured there (``Replay.value``), plus the wall-clock start and end of its
sleep. Busy share = sum(t_end - t_start) / (slots x (last t_end - first t_start)): the share of slot-seconds spent
in trials from the first trial's start to the last trial's end. The same spec's virtual-clock figure
(``bench_slots.simulate`` on the same records) is printed beside it.

Limits. The slots are logical: 64 sleeping trials share this machine's cores, so what is measured is the design's
waits plus Tune's scheduling overheads (its 1 s re-ask when the searcher has nothing to suggest, actor resets,
result handling in one driver process), not compute contention. Tune's own trial actors (about 64 Python
processes importing Ray Tune) start on the machine's few cores: the time from ``fit`` to the first trial's start
and from the first trial's start to the ``slots``-th one are printed separately (the second is inside the
makespan; a real cluster starts its actors on many cores). Tells run at once in Tune's thread (the sweep defers
them to its MLflow writer thread); no MLflow, no trial records.

    python benchmarks/bench_slots_ray.py --from /work/runs/slots-src --spec today=a.yaml converge=b.yaml --slots 64
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.bench_slots import Replay, cells_of, design_searcher, load_records, simulate  # noqa: E402


def sleeper(config: dict, replay: Replay, scale: float = 1.0) -> None:
    """A trial (Tune function trainable): sleep the recorded duration, report the recorded objective."""
    import time

    from ray import tune

    seconds = replay.duration(config) * scale
    t_start = time.time()
    time.sleep(seconds)
    t_end = time.time()
    tune.report({**replay.result(config), "t_start": t_start, "t_end": t_end})


class MemoryLow:
    """The lowest MemAvailable (GiB) seen while it runs (a sample a second)."""

    def __init__(self) -> None:
        self.low, self._stop = float("inf"), threading.Event()
        self._t = threading.Thread(target=self._watch, daemon=True)

    def _watch(self) -> None:
        while not self._stop.is_set():
            for ln in Path("/proc/meminfo").read_text().splitlines():
                if ln.startswith("MemAvailable:"):
                    self.low = min(self.low, int(ln.split()[1]) / 2**20)
            self._stop.wait(1.0)

    def __enter__(self) -> MemoryLow:
        self._t.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._t.join()


def tune_run(spec, replay: Replay, cells: list[dict], slots: int, scale: float, name: str) -> dict:
    """One Tuner.fit of the spec's searcher over ``cells`` with sleeping trials -> each trial's t_start / t_end,
    the errors, and when ``fit`` started and ended."""
    from ray import tune

    from orchestrator.raytune import cluster
    from orchestrator.raytune.tune_setup import make_tuner

    with tempfile.TemporaryDirectory(prefix="bench-slots-ray-") as tmp:
        searcher = design_searcher(spec, cells, Path(tmp) / "journal")
        tuner = make_tuner(spec, Path(tmp), f"slots-{name}", searcher, slots, [],
                           trainable=tune.with_parameters(sleeper, replay=replay, scale=scale))
        with cluster.pending_limit(spec.resources, searcher.total):
            t0 = time.time()
            grid = tuner.fit()
            t1 = time.time()
    spans = [(r.metrics["t_start"], r.metrics["t_end"]) for r in grid if r.error is None and "t_end" in r.metrics]
    return {"spans": spans, "errors": sum(r.error is not None for r in grid), "fit_start": t0, "fit_end": t1}


def figures(run: dict, slots: int) -> dict:
    """Trial count, work, makespan and busy share of a ``tune_run``, and Tune's start-up times."""
    spans = run["spans"]
    if not spans:
        return {"trials": 0, "errors": run["errors"]}
    starts = sorted(s for s, _ in spans)
    first, last, full = starts[0], max(e for _, e in spans), starts[min(slots, len(starts)) - 1]
    work, span = sum(e - s for s, e in spans), last - first
    after = sum(max(0.0, e - max(s, full)) for s, e in spans)  # work once the slots-th trial has started
    return {"trials": len(spans), "errors": run["errors"], "work_s": round(work, 1), "makespan_s": round(span, 1),
            "busy_share": work / (slots * span) if span > 0 else float("nan"),
            "busy_share_after_ramp": after / (slots * (last - full)) if last > full else float("nan"),
            "fit_to_first_trial_s": round(first - run["fit_start"], 1),
            "first_to_slots_th_start_s": round(full - first, 1),
            "last_trial_to_fit_end_s": round(run["fit_end"] - last, 1),
            "fit_wall_s": round(run["fit_end"] - run["fit_start"], 1),
            "spans": [[round(s - first, 3), round(e - first, 3)] for s, e in sorted(spans)]}  # s from the first start


def one_spec(name: str, path: str, records: list[dict], cell_records: list[dict], a) -> dict:
    """The spec on a fresh local Ray with ``a.slots`` logical CPUs, and its virtual-clock simulation."""
    import ray

    from orchestrator.raytune import cluster
    from orchestrator.spec import parse_spec

    spec = parse_spec(yaml.safe_load(Path(path).read_text()))
    sim = simulate(spec, records, a.slots, False, cell_records)
    t0 = time.time()
    cluster.connect(None, a.slots)  # ray.init(address="local", num_cpus=slots, include_dashboard=False, quiet)
    ray_init = time.time() - t0
    try:
        with MemoryLow() as mem:
            run = tune_run(spec, Replay(records), cells_of(cell_records), a.slots, a.time_scale, name)
    finally:
        ray.shutdown()
    return {"spec": path, "search": json.loads(json.dumps(yaml.safe_load(Path(path).read_text())["search"])),
            "ray": {**figures(run, a.slots), "ray_init_s": round(ray_init, 1),
                    "mem_available_low_gib": round(mem.low, 1)},
            "simulated": sim}


def line(name: str, r: dict, slots: int, scale: float) -> str:
    """Two lines: the busy figures (Ray, then the simulation) and Tune's start-up times."""
    g, s = r["ray"], r["simulated"]
    if not g["trials"]:
        return f"{name}: Ray ran no trial ({g['errors']} errors)"
    return (f"{name}: Ray {g['trials']} trials ({g['errors']} errors), {g['work_s']:.0f} trial-seconds on {slots} "
            f"slots, makespan {g['makespan_s']:.1f} s, slots busy {100 * g['busy_share']:.1f} % | simulated "
            f"{s['trials']} trials, {s['work_s'] * scale:.0f} trial-seconds, makespan {s['makespan_s'] * scale:.0f} "
            f"s, busy {100 * s['busy_share']:.1f} %\n"
            f"{name}: Ray busy after the {slots}th trial start {100 * g['busy_share_after_ramp']:.1f} %; "
            f"ray.init {g['ray_init_s']:.1f} s, fit -> first trial start {g['fit_to_first_trial_s']:.1f} s, first "
            f"-> {slots}th trial start {g['first_to_slots_th_start_s']:.1f} s, last trial end -> fit end "
            f"{g['last_trial_to_fit_end_s']:.1f} s, fit {g['fit_wall_s']:.1f} s, lowest MemAvailable "
            f"{g['mem_available_low_gib']:.1f} GiB")


def uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--from", dest="runs", nargs="+", required=True,
                    help="finished run directories (trials.jsonl); the first one's cells are run")
    ap.add_argument("--spec", nargs="+", required=True, help="NAME=PATH: the specs compared, e.g. today=a converge=b")
    ap.add_argument("--slots", type=int, default=64, help="logical CPUs of the local Ray (trial slots)")
    ap.add_argument("--time-scale", type=float, default=1.0, help="each trial sleeps its recorded duration x this")
    ap.add_argument("--out", default=None, help="write the figures as JSON here, and the printed lines next to it (.txt)")
    a = ap.parse_args(argv)
    from orchestrator.sweep.console import quiet_libraries

    quiet_libraries(False)  # the sweep's Ray/Tune environment: no per-trial result files, no Tune chatter
    records, cell_records = load_records([Path(d) for d in a.runs]), load_records([Path(a.runs[0])])
    lines, res, t0 = [f"uptime before: {uptime()}"], {}, time.time()
    print(lines[0], flush=True)
    for item in a.spec:
        name, path = item.split("=", 1)
        res[name] = one_spec(name, path, records, cell_records, a)
        lines.append(line(name, res[name], a.slots, a.time_scale))
        print(lines[-1], flush=True)
    lines += [f"uptime after: {uptime()}", f"benchmark wall {time.time() - t0:.0f} s"]
    print("\n".join(lines[-2:]), flush=True)
    if a.out:
        out = Path(a.out)
        head = {"argv": sys.argv[1:] if argv is None else argv, "slots": a.slots, "time_scale": a.time_scale,
                "runs": a.runs, "specs": a.spec, "uptime_before": lines[0], "uptime_after": lines[-2]}
        out.write_text(json.dumps({**head, **res}, indent=1))
        out.with_suffix(".txt").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
