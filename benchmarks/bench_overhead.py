"""A sweep's fixed overhead per stage, and healsweep against the authors' way of running the same trials.

The issue's 16-trial sweep: vit_digits, magnitude, sparsities 0.8/0.85/0.9/0.95 x 4 learning rates, 128
calibration images, 6 STARFISH epochs, batch 32; and a single configuration (sparsity 0.9, one lr), each run

- healsweep: ``healsweep run`` (the real console script, a fresh run directory, a warm store and model cache),
  stage times read back from the parent run (``stage_<name>_seconds``); overhead = wall - Σ trial compute /
  concurrency (trials side by side: ``--parallel``, or the number of trials when fewer -- the single
  configuration's one trial runs on one CPU, so its compute is not halved);
- the authors' way: one process per trial, two at a time, each loading the model, pruning it and computing
  its own dense targets in RAM before healing -- written here from the project's own tasks/ code (the same
  pruner, targets, STARFISH loop and evaluation), not from the authors' scripts.

- Ray Tune's floor: a fresh local Ray, the same number of no-op trials on reused actors that import what a trial
  actor imports before its first trial, shutdown. Floor + Σ trial compute / concurrency bounds what any Ray Tune
  sweep can reach on the machine, so authors / (floor + compute) is the largest ratio within reach.

Runs are interleaved (healsweep 16, authors 16, floor 16, healsweep 1, authors 1, floor 1, repeated ``--repeats``
times) and the median is printed. ``uptime`` is printed before and after: on a shared machine only side-by-side ratios count.
``--baseline DIR`` also runs healsweep from another checkout (``PYTHONPATH=DIR``, e.g. the main branch) in the
same interleaving, for a before/after ratio measured under the same load.

Stage times overlap where the sweep overlaps them (the spec is checked while Ray starts, the parent run is
created while Tune starts the trial actors, the report is written while Ray shuts down), so ``exit`` (wall - Σ
stages: interpreter start before ``imports`` and process exit) comes out negative.

    python benchmarks/bench_overhead.py --repeats 5 --cache .healsweep/models --store .healsweep/store
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

SPARSITIES = (0.8, 0.85, 0.9, 0.95)
LR_RANGE = (3e-4, 3e-3)
AUTHORS_LRS = (3e-4, 6e-4, 1.2e-3, 2.4e-3)  # 4 fixed rates over healsweep's search range (cost is lr-independent)
STAGES = ("imports", "spec", "models", "ray", "dense", "diagnostics", "masks", "parent", "tune_start", "trials",
          "mlflow_flush", "ray_shutdown", "report")


def spec_yaml(sparsities, trials: int, epochs: int, calib: int) -> str:
    return (f"name: bench_overhead\nmodels: [vit_digits]\nsparsities: {list(sparsities)}\ncalib_sizes: [{calib}]\n"
            f"pruners: [magnitude]\nhealers: [starfish]\nsearch:\n  trials_per_cell: {trials}\n"
            f"  lr: [{LR_RANGE[0]}, {LR_RANGE[1]}]\n  epochs: [{epochs}, {epochs}]\n"
            "  reevaluate: 0\n")  # the same trials as the authors' loop: no re-evaluation of the winners


# ------------------------------------------------------------------------------------ the authors' way
def authors_trial(model: str, cache: str, sparsity: float, lr: float, epochs: int, calib: int, batch: int) -> dict:
    """One trial as its own process: load, prune, dense targets in RAM, heal, evaluate (1 thread)."""
    import torch

    from tasks.evaluate import accuracy
    from tasks.healing import HEALERS, HealConfig, HealContext, dense_targets, in_memory_batches, steps_per_epoch
    from tasks.models import get_adapter, load_model
    from tasks.pruning import apply_masks, make_masks

    t0 = time.perf_counter()
    torch.set_num_threads(1)
    lm = load_model(model, cache, progress=False)
    adapter = get_adapter(lm.model)
    images = lm.dataset["calibration"].images[:calib]
    targets = dense_targets(lm.model, adapter.blocks(lm.model), images)  # this trial's own dense pass
    entries = adapter.scope(lm.model, adapter.default_scope)
    masks = make_masks(lm.model, entries, "magnitude", sparsity, seed=0)
    apply_masks(lm.model, masks)
    ctx = HealContext(lm.model, adapter.blocks(lm.model), entries, masks, images,
                      in_memory_batches(targets, batch, 0), steps_per_epoch(calib, batch), adapter.default_granularity)
    t_heal = time.perf_counter()
    HEALERS.get("starfish").heal(ctx, HealConfig(lr=lr, epochs=epochs, batch_size=batch))
    heal = time.perf_counter() - t_heal
    sel, ev = lm.dataset["selection"], lm.dataset["evaluation"]
    return {"selection_acc": accuracy(lm.model, sel.images, sel.labels),
            "healed_acc": accuracy(lm.model, ev.images, ev.labels), "heal_seconds": heal,
            "seconds_in_process": time.perf_counter() - t0}


def run_authors(a, configs: list[tuple[float, float]]) -> dict:
    """Wall seconds of the configs, one process each, ``a.parallel`` at a time, and each trial's heal seconds."""
    def one(cfg):
        cmd = [sys.executable, __file__, "--authors-trial", json.dumps(
            {"model": "vit_digits", "cache": a.cache, "sparsity": cfg[0], "lr": cfg[1], "epochs": a.epochs,
             "calib": a.calib, "batch": a.batch})]
        out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
        return json.loads(out.strip().splitlines()[-1])["heal_seconds"]

    t0 = time.perf_counter()
    with ThreadPoolExecutor(a.parallel) as pool:
        heals = list(pool.map(one, configs))
    return {"wall": time.perf_counter() - t0, "heals": heals}


# ------------------------------------------------------------------------------------------ Tune's floor
def tune_floor(trials: int, parallel: int) -> None:
    """Ray Tune itself, nothing computed: a fresh local Ray, ``trials`` trials on ``parallel`` reused actors
    (as a sweep runs them) whose trainable imports what a healsweep trial actor imports before its first trial
    (Ray Tune, orchestrator.raytune.trainable: torch and tasks/) and reports once, then shutdown; the Tune settings
    healsweep uses (orchestrator.sweep.console.quiet_libraries: no auto loggers, ...). No healsweep run with Ray Tune
    can take less; its trials' compute comes on top. What a trial imports later, inside ``run_trial`` (timm when
    it builds a reference model: timm -> torchvision.ops -> torch._dynamo, 1.8-4 s in a fresh actor), is inside
    the trial's ``trial_seconds`` and so in Σ trial compute: the floor does not import it again."""
    from orchestrator.sweep.console import quiet_libraries

    quiet_libraries(False)
    import ray
    from ray import tune

    def trainable(config):
        import orchestrator.raytune.trainable  # noqa: F401

        tune.report({"done": 1})

    ray.init(address="local", num_cpus=parallel, include_dashboard=False, log_to_driver=False)
    tune.Tuner(tune.with_resources(trainable, {"cpu": 1}),
               tune_config=tune.TuneConfig(num_samples=trials, max_concurrent_trials=parallel, reuse_actors=True),
               run_config=tune.RunConfig(storage_path=tempfile.mkdtemp(prefix="tune-floor-"), verbose=0)).fit()
    ray.shutdown()


def run_floor(a, trials: int) -> float:
    """Wall seconds of ``tune_floor`` in its own process (like ``healsweep run``: interpreter start to exit)."""
    t0 = time.perf_counter()
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    subprocess.run([sys.executable, __file__, "--tune-floor", str(trials), "--parallel", str(a.parallel)],
                   check=True, capture_output=True, text=True, env=env)
    return time.perf_counter() - t0


# ------------------------------------------------------------------------------------------ healsweep
def run_healsweep(a, spec_file: Path, out: Path, tree: str | None = None) -> dict:
    """One ``healsweep run`` (the console script) with ``PYTHONPATH=tree`` (default: this checkout)."""
    exe = Path(sys.executable).with_name("healsweep")
    env = dict(os.environ, PYTHONPATH=tree or str(Path(__file__).resolve().parents[1]))
    t0 = time.perf_counter()
    subprocess.run([str(exe), "run", str(spec_file), "--out", str(out), "--store", a.store, "--cache", a.cache,
                    "--num-cpus", str(a.parallel), "--quiet"], check=True, capture_output=True, text=True, env=env)
    wall = time.perf_counter() - t0
    from mlflow import MlflowClient

    info = json.loads((out / "sweep.json").read_text())
    client = MlflowClient(info["tracking_uri"])
    m = client.get_run(info["parent_run_id"]).data.metrics
    exp = client.get_experiment_by_name(info["experiment"])
    heals = [r.data.metrics["heal_seconds"] for r in client.search_runs(
        [exp.experiment_id], f"tags.sweep_id = '{info['sweep_id']}' and tags.`healsweep.role` = 'trial'")]
    stages = {s: m.get(f"stage_{s}_seconds", 0.0) for s in STAGES}
    # trials side by side: the sweep's slots, or its number of trials when fewer (one trial runs on one CPU)
    compute, conc = m["trial_compute_seconds"], min(m["concurrency"], max(len(heals), 1))
    stages["exit"] = wall - sum(stages.values())  # interpreter start before `imports` is counted + shutdown
    return {"wall": wall, "compute": compute, "concurrency": conc, "overhead": wall - compute / conc,
            "stages": stages, "heals": heals}


def uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=5, help="interleaved runs of each variant (median)")
    ap.add_argument("--cache", default=".healsweep/models")
    ap.add_argument("--store", default=".healsweep/store", help="warm target/mask store")
    ap.add_argument("--parallel", type=int, default=2, help="CPUs for Ray / authors' processes at a time")
    ap.add_argument("--epochs", type=int, default=6)
    ap.add_argument("--calib", type=int, default=128)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--baseline", metavar="DIR", help="also run healsweep from checkout DIR (before/after ratio)")
    ap.add_argument("--sizes", default="16,1", help="which runs: 16 (the sweep), 1 (single configuration)")
    ap.add_argument("--authors-trial", help=argparse.SUPPRESS)
    ap.add_argument("--tune-floor", type=int, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.tune_floor:
        tune_floor(a.tune_floor, a.parallel)
        return
    if a.authors_trial:
        print(json.dumps(authors_trial(**json.loads(a.authors_trial))))
        return
    a.cache, a.store = str(Path(a.cache).resolve()), str(Path(a.store).resolve())
    root = Path(tempfile.mkdtemp(prefix="healsweep-overhead-"))
    specs = {16: root / "sweep16.yaml", 1: root / "single.yaml"}
    specs[16].write_text(spec_yaml(SPARSITIES, 4, a.epochs, a.calib))
    specs[1].write_text(spec_yaml((0.9,), 1, a.epochs, a.calib))
    configs = {16: [(s, lr) for s in SPARSITIES for lr in AUTHORS_LRS], 1: [(0.9, AUTHORS_LRS[2])]}
    print(f"start: {uptime()}", flush=True)
    run_healsweep(a, specs[16], root / "warmup")  # warm store (targets, masks) and model cache; not measured
    sizes = [int(x) for x in a.sizes.split(",")]
    res: dict = {k: {"healsweep": [], "authors": [], "baseline": [], "floor": []} for k in sizes}
    for i in range(a.repeats):
        for k in sizes:
            res[k]["healsweep"].append(run_healsweep(a, specs[k], root / f"hs{k}-{i}"))
            res[k]["authors"].append(run_authors(a, configs[k]))
            res[k]["floor"].append(run_floor(a, k))
            if a.baseline:
                res[k]["baseline"].append(run_healsweep(a, specs[k], root / f"base{k}-{i}", a.baseline))
            h = res[k]["healsweep"][-1]
            print(f"repeat {i + 1}/{a.repeats}, {k} trial(s): healsweep {h['wall']:.1f} s (Σ compute "
                  f"{h['compute']:.1f}, overhead {h['overhead']:.1f}; " + ", ".join(
                      f"{n} {v:.1f}" for n, v in h["stages"].items()) +
                  f"), authors {res[k]['authors'][-1]['wall']:.1f} s, Tune floor {res[k]['floor'][-1]:.1f} s"
                  + (f", baseline {res[k]['baseline'][-1]['wall']:.1f} s" if a.baseline else "")
                  + f"  ({uptime()})", flush=True)
    report(a, res)
    print(f"end: {uptime()}")


def report(a, res: dict) -> None:
    med = statistics.median
    print(f"\nmedian of {a.repeats} interleaved runs, {a.parallel} at a time, warm store and model cache")
    for k, r in res.items():
        hs, au = r["healsweep"], r["authors"]
        wall, auth = med(x["wall"] for x in hs), med(x["wall"] for x in au)
        print(f"{k:>2} trial(s): healsweep {wall:.1f} s (Σ trial compute {med(x['compute'] for x in hs):.1f} s, "
              f"overhead {med(x['overhead'] for x in hs):.1f} s) | authors' way {auth:.1f} s | "
              f"authors/healsweep {auth / wall:.2f}x")
        floor, compute = med(r["floor"]), med(x["compute"] / x["concurrency"] for x in hs)
        print(f"{k:>2} trial(s): Ray Tune floor {floor:.1f} s (start, {k} no-op trial(s) importing what a trial "
              f"imports, shutdown); floor + Σ trial compute / concurrency = {floor + compute:.1f} s: "
              f"authors/that = {auth / (floor + compute):.2f}x, the most a Ray Tune sweep could reach here")
        if r["baseline"]:
            base = med(x["wall"] for x in r["baseline"])
            print(f"{k:>2} trial(s): baseline {a.baseline} {base:.1f} s (overhead "
                  f"{med(x['overhead'] for x in r['baseline']):.1f} s) | baseline/healsweep {base / wall:.2f}x")
    names = [*STAGES, "exit"]
    for k, r in res.items():
        for variant in ("healsweep", "baseline"):
            if r[variant]:
                print(f"{k:>2} trial(s) {variant}, median seconds per stage: " + ", ".join(
                    f"{s} {med(x['stages'][s] for x in r[variant]):.2f}" for s in names))
    goals(res)
    print(json.dumps({str(k): {"healsweep_wall": [x["wall"] for x in r["healsweep"]],
                               "authors_wall": [x["wall"] for x in r["authors"]],
                               "baseline_wall": [x["wall"] for x in r["baseline"]], "tune_floor": r["floor"],
                               "overhead": [x["overhead"] for x in r["healsweep"]]} for k, r in res.items()}))


def goals(res: dict) -> None:
    """The issue's three figures (medians): wall beyond Ray Tune's floor (goal <= 2 s for each sweep size), one
    heal against the authors' loop (goal <= 1.05x; median heal seconds over every trial of every run), and the
    16-trial sweep against the authors' one process per trial (goal >= 2x)."""
    med = statistics.median
    print("\ngoals (medians of this interleaved run):")
    for k, r in res.items():
        beyond = med(x["wall"] - (f + x["compute"] / x["concurrency"]) for x, f in zip(r["healsweep"], r["floor"]))
        print(f"  {k:>2} trial(s): healsweep wall - (Tune floor + Σ trial compute / concurrency) = {beyond:.2f} s "
              f"(goal <= 2 s: {'met' if beyond <= 2 else 'NOT met'})")
    heals = {v: [h for r in res.values() for x in r[v] for h in x["heals"]] for v in ("healsweep", "authors")}
    ratio = med(heals["healsweep"]) / med(heals["authors"])
    print(f"  per heal: healsweep {med(heals['healsweep']):.2f} s / authors' loop {med(heals['authors']):.2f} s = "
          f"{ratio:.3f}x (goal <= 1.05x: {'met' if ratio <= 1.05 else 'NOT met'})")
    if 16 in res:
        speed = med(x["wall"] for x in res[16]["authors"]) / med(x["wall"] for x in res[16]["healsweep"])
        print(f"  16-trial sweep: authors' one-process-per-trial / healsweep = {speed:.2f}x "
              f"(goal >= 2x: {'met' if speed >= 2 else 'NOT met'})")


if __name__ == "__main__":
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    main()
