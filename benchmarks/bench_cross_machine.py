"""The same real trials on two machines: how far healed accuracies move between CPU types (issue #25: what is
identical on every machine, what is only within tolerance). Needs only ``tasks/`` (torch, timm, pyarrow,
safetensors, scikit-learn): no Ray, MLflow or Optuna, so it runs on a machine that has only a framework image.

``run`` heals a fixed grid with the shipped reference models -- both models x magnitude {0.5, 0.7, 0.8, 0.85,
0.9, 0.95} and 2:4 x calibration {64, 256} x lr {1e-3, 3e-3, 1e-2}, STARFISH, 6 epochs; CORP 0.5 on the ViT
healed by CORP and by STARFISH -- every trial in its own process slot with one thread, masks and dense targets
computed on this machine's CPU first, and writes one JSON (the machine: CPU model, torch, its CPU capability;
per trial: dense, pruned and healed accuracy, the mask's digest). ``compare A B`` prints what moved: masks and
dense/pruned accuracies identical or not, |delta| of the healed accuracy in pp and in evaluation images (median,
p90, max, trials over 1 / 2 / 5 pp).

    python benchmarks/bench_cross_machine.py run --out here.json           # on each machine
    python benchmarks/bench_cross_machine.py compare here.json there.json
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

MODELS = ("vit_digits", "resnet_digits")
SPARSITIES = (0.5, 0.7, 0.8, 0.85, 0.9, 0.95)
CALIBS = (64, 256)
LRS = (1e-3, 3e-3, 1e-2)
EPOCHS, BATCH = 6, 32


def grid() -> list[dict]:
    """Every trial: model, pruner, sparsity, scope ('' = the adapter's default), healer, calib, lr."""
    out = []
    for m in MODELS:
        for pruner, sps in (("magnitude", SPARSITIES), ("nm", (0.5,))):
            out += [dict(model=m, pruner=pruner, sparsity=s, scope="", healer="starfish", calib=c, lr=lr)
                    for s in sps for c in CALIBS for lr in LRS]
    out += [dict(model="vit_digits", pruner="corp", sparsity=0.5, scope="mlp_qk", healer=h, calib=c, lr=3e-3)
            for h in ("corp", "starfish") for c in CALIBS]
    return out


def machine() -> dict:
    import torch

    cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")),
               platform.processor()) if Path("/proc/cpuinfo").exists() else platform.processor()
    return {"cpu": cpu, "torch": torch.__version__, "capability": torch.backends.cpu.get_cpu_capability(),
            "python": platform.python_version(), "cores": os.cpu_count()}


def _mask_key(t: dict) -> str:
    from tasks.store import content_key

    return content_key({"bench": "cross_machine", "model": t["model"], "pruner": t["pruner"],
                        "sparsity": t["sparsity"], "scope": t["scope"]})


def prepare(root: Path, cache: Path, trials: list[dict], models: tuple[str, ...] = MODELS
            ) -> tuple[dict[str, str], dict[str, str]]:
    """Masks (one per model, pruner, sparsity, scope) and each of ``models``' dense targets for the largest
    calibration size, computed here; -> ({mask key: sha256 of the mask tensors}, {model: its default scope})."""
    import torch

    from tasks.healing import dense_targets
    from tasks.models import get_adapter, load_model
    from tasks.pruning import MaskStore, PruneContext, make_masks
    from tasks.store import TargetStore, content_key, ensure_targets

    torch.set_num_threads(1)
    digests, scopes, store = {}, {}, TargetStore(root / "targets")
    for m in models:
        lm = load_model(m, cache, progress=False)
        adapter, images = get_adapter(lm.model), lm.dataset["calibration"].images
        blocks, scopes[m] = adapter.blocks(lm.model), adapter.default_scope

        def shards(plan):
            for i, a, b in plan:
                yield store.write_shard(content_key({"bench": "cross_machine", "model": m}), i, a,
                                        dense_targets(lm.model, blocks, images[a:b]))
        ensure_targets(store, content_key({"bench": "cross_machine", "model": m}), max(CALIBS), 64, shards,
                       meta={"model": m}, dtype="float16")
        for t in trials:
            key = _mask_key(t)
            if t["model"] != m or key in digests:
                continue
            entries = adapter.scope(lm.model, t["scope"] or adapter.default_scope)
            ctx = PruneContext(lm.model, adapter, entries, calib_images=images[:max(CALIBS)], diagnostics={})
            masks = make_masks(lm.model, entries, t["pruner"], t["sparsity"], seed=0,
                               settings={"n": 2, "m": 4} if t["pruner"] == "nm" else {}, ctx=ctx)
            MaskStore(root / "masks").save(key, masks, {"bench": "cross_machine"})
            digests[key] = hashlib.sha256(b"".join(masks[k].numpy().tobytes() for k in sorted(masks))).hexdigest()[:16]
    return digests, scopes


def trial_params(t: dict, scope: str, root, cache, device: str, precision: str, epochs: int = EPOCHS, steps: int = 0,
                 heal_seed: int | None = None):
    """The TrialParams of trial ``t`` (``scope``: resolved) on the masks and targets ``prepare`` wrote under ``root``."""
    from tasks.store import content_key
    from tasks.trial import TrialParams

    return TrialParams(model=t["model"], scope=scope, healer=t["healer"], calib_size=t["calib"], lr=t["lr"],
                       epochs=epochs, steps=steps, seed=0, heal_seed=heal_seed, batch_size=BATCH,
                       store_key=content_key({"bench": "cross_machine", "model": t["model"]}), mask_key=_mask_key(t),
                       store_uri=str(Path(root) / "targets"), mask_root=str(Path(root) / "masks"),
                       cache_dir=str(cache), pruner=t["pruner"] if t["pruner"] == "corp" else "", device=device,
                       precision=precision)


def one(args: tuple) -> dict:
    """One trial in a worker process (one thread); ``scope``: the trial's scope, resolved."""
    t, scope, root, cache, device, precision = args
    from tasks.trial import run_trial

    r = run_trial(trial_params(t, scope, root, cache, device, precision), lambda m: None)
    return {**t, **{k: r[k] for k in ("dense_acc", "pruned_acc", "healed_acc", "n_eval", "mask_violations")}}


def run(out: Path, cache: Path, procs: int, device: str = "cpu", precision: str = "fp32") -> None:
    """``device``/``precision``: where and how the trials heal (masks and dense targets: this machine's CPU)."""
    import multiprocessing

    trials = grid()
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="cross-machine-") as root:
        digests, scopes = prepare(Path(root), cache, trials)
        ctx = multiprocessing.get_context("spawn" if device != "cpu" else None)  # CUDA: no forked workers
        with ProcessPoolExecutor(procs, mp_context=ctx) as pool:
            res = list(pool.map(one, [(t, t["scope"] or scopes[t["model"]], root, cache, device, precision)
                                      for t in trials]))
    for r in res:
        r["mask_sha256"] = digests[_mask_key(r)]
    out.write_text(json.dumps({"machine": {**machine(), "device": _device_name(device), "precision": precision},
                               "seconds": round(time.perf_counter() - t0, 1),
                               "trials": res}, indent=1))
    print(f"{len(res)} trials in {time.perf_counter() - t0:.0f} s on {machine()} -> {out}")


def _device_name(device: str) -> str:
    import torch

    return torch.cuda.get_device_name(device) if device.startswith("cuda") else "cpu"


def _ident(r: dict) -> tuple:
    return (r["model"], r["pruner"], r["sparsity"], r["scope"], r["healer"], r["calib"], r["lr"])


def compare(a_path: Path, b_path: Path) -> None:
    a, b = (json.loads(Path(p).read_text()) for p in (a_path, b_path))
    print(f"A: {a['machine']}\nB: {b['machine']}")
    ra, rb = ({_ident(r): r for r in x["trials"]} for x in (a, b))
    common = sorted(set(ra) & set(rb))
    masks = {(k[0], k[1], k[2], k[3]): ra[k]["mask_sha256"] == rb[k]["mask_sha256"] for k in common}
    print(f"{len(common)} trials in both; masks identical {sum(masks.values())} of {len(masks)}; dense accuracy "
          f"identical {sum(ra[k]['dense_acc'] == rb[k]['dense_acc'] for k in common)} of {len(common)}, pruned "
          f"{sum(ra[k]['pruned_acc'] == rb[k]['pruned_acc'] for k in common)}; mask violations "
          f"{sum(ra[k]['mask_violations'] + rb[k]['mask_violations'] for k in common)}")
    d = sorted(abs(ra[k]["healed_acc"] - rb[k]["healed_acc"]) * 100 for k in common)
    n_eval = ra[common[0]]["n_eval"]
    p90 = d[min(len(d) - 1, int(0.9 * len(d)))]
    print(f"healed accuracy |delta| (pp): identical {sum(x == 0 for x in d)} of {len(d)}; median "
          f"{statistics.median(d):.2f}, p90 {p90:.2f}, max {d[-1]:.2f} ({d[-1] / 100 * n_eval:.0f} of {n_eval} "
          f"images); over 1 pp {sum(x > 1 for x in d)}, over 2 pp {sum(x > 2 for x in d)}, over 5 pp "
          f"{sum(x > 5 for x in d)}")
    for k in sorted(common, key=lambda k: -abs(ra[k]["healed_acc"] - rb[k]["healed_acc"]))[:5]:
        print(f"  {k}: {ra[k]['healed_acc']:.4f} vs {rb[k]['healed_acc']:.4f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="heal the grid here and write the results")
    r.add_argument("--out", type=Path, required=True)
    r.add_argument("--cache", type=Path, default=Path(".healsweep/models"), help="model cache")
    r.add_argument("--procs", type=int, default=os.cpu_count(), help="trials at a time (one thread each)")
    r.add_argument("--device", default="cpu", help="where the trials heal: cpu (default) or cuda (processes share it)")
    r.add_argument("--precision", default="fp32", choices=("fp32", "tf32", "bf16"), help="heal.precision")
    c = sub.add_parser("compare", help="what moved between two runs")
    c.add_argument("a", type=Path)
    c.add_argument("b", type=Path)
    a = ap.parse_args()
    if a.cmd == "run":
        run(a.out, a.cache.resolve(), a.procs, a.device, a.precision)
    else:
        compare(a.a, a.b)


if __name__ == "__main__":
    main()
