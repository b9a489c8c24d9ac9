"""Cost of one elastic SnapViT ranking vs a per-sparsity search for every sparsity of a grid (nothing here is a
test). Both use the same local sensitivity, xNES settings and fitness; the per-sparsity pruner is SnapViT
with ``fitness_sparsities = [s]`` run once per grid point (what a non-elastic method must do), and the elastic
one runs once with the default fitness set and thresholds its ranking for every grid point.

Reports wall seconds (noisy on a shared machine), fitness forward passes (machine independent), the ratio,
the linear extrapolation to a finer grid, and evaluation accuracy (no healing) at every grid point for:
elastic, per-sparsity, local sensitivity only (all block weights 1, no xNES) and random unit orders.

    python benchmarks/bench_snapvit.py --cache /work/main/.healsweep/models [--iterations 50] [--calib 256]
"""
from __future__ import annotations

import argparse
import copy
import json
import time

import torch

from tasks.evaluate import accuracy
from tasks.models import get_adapter, load_model
from tasks.pruning import apply_masks
from tasks.pruning import snapvit_math as snapvit
from tasks.pruning.xnes import default_popsize


def _acc(model, layout, order, s, ev) -> float:
    m = copy.deepcopy(model)
    apply_masks(m, snapvit.unit_masks(model, layout, snapvit.keep_vector(order, layout.unit_params(), s)))
    return accuracy(m, ev.images, ev.labels)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="vit_digits")
    ap.add_argument("--cache", default=".healsweep/models")
    ap.add_argument("--scope", default="qkv_out_mlp")
    ap.add_argument("--calib", type=int, default=256)
    ap.add_argument("--grid", type=float, nargs="+", default=[0.25, 0.4, 0.5, 0.6])
    ap.add_argument("--iterations", type=int, default=50)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="write the figures as JSON here")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    lm = load_model(a.model, a.cache, progress=False)
    adapter = get_adapter(lm.model)
    layout = snapvit.vit_layout(lm.model, adapter, adapter.scope(lm.model, a.scope))
    images = lm.dataset["calibration"].images[: a.calib]
    ev = lm.dataset["evaluation"]
    base = snapvit.resolve_settings({"iterations": a.iterations})
    lam = base["popsize"] or default_popsize(len(layout.groups))

    t0 = time.perf_counter()
    sens = snapvit.local_sensitivity(lm.model, layout, images, base, a.seed)
    sens_s = time.perf_counter() - t0

    t0, c0 = time.perf_counter(), time.process_time()
    elastic = snapvit.compute_ranking(lm.model, layout, images, base, a.seed)
    elastic_s, elastic_cpu = time.perf_counter() - t0, time.process_time() - c0
    t0 = time.perf_counter()
    for s in a.grid:  # thresholding the one ranking: every grid point's masks
        snapvit.unit_masks(lm.model, layout, snapvit.keep_vector(elastic.order, layout.unit_params(), s))
    threshold_s = time.perf_counter() - t0

    per, per_s, per_cpu = {}, [], 0.0
    for s in a.grid:
        t0, c0 = time.perf_counter(), time.process_time()
        per[s] = snapvit.compute_ranking(lm.model, layout, images, {**base, "fitness_sparsities": [s]}, a.seed)
        per_s.append(time.perf_counter() - t0)
        per_cpu += time.process_time() - c0

    gidx = layout.group_index()
    local_order = snapvit.order_from(torch.ones(len(layout.groups), dtype=torch.float64), sens, gidx)[0]
    rand_orders = [torch.randperm(layout.n_units, generator=torch.Generator().manual_seed(i)) for i in range(5)]
    rows = []
    for s in a.grid:
        rows.append({"sparsity": s, "elastic": _acc(lm.model, layout, elastic.order, s, ev),
                     "per_sparsity": _acc(lm.model, layout, per[s].order, s, ev),
                     "local_only": _acc(lm.model, layout, local_order, s, ev),
                     "units_differing_elastic_vs_local_only": int((
                         snapvit.keep_vector(elastic.order, layout.unit_params(), s)
                         != snapvit.keep_vector(local_order, layout.unit_params(), s)).sum()),
                     "random_mean": sum(_acc(lm.model, layout, o, s, ev) for o in rand_orders) / len(rand_orders)})
    per_mean = sum(per_s) / len(per_s)
    fits_elastic = a.iterations * lam * len(base["fitness_sparsities"])
    fits_per = a.iterations * lam * 1
    out = {
        "model": a.model, "units": layout.n_units, "groups": len(layout.groups), "popsize": lam,
        "iterations": a.iterations, "calib_images": len(images), "fitness_images": min(base["fitness_images"], len(images)),
        "grid": a.grid, "fitness_sparsities": base["fitness_sparsities"], "threads": a.threads,
        "sensitivity_seconds": round(sens_s, 2),
        "elastic_seconds": round(elastic_s, 2), "threshold_all_grid_seconds": round(threshold_s, 4),
        "per_sparsity_seconds": [round(x, 2) for x in per_s], "per_sparsity_total_seconds": round(sum(per_s), 2),
        "ratio_per_sparsity_over_elastic": round(sum(per_s) / elastic_s, 3),
        "elastic_cpu_seconds": round(elastic_cpu, 2), "per_sparsity_total_cpu_seconds": round(per_cpu, 2),
        "ratio_cpu": round(per_cpu / elastic_cpu, 3),
        "fitness_forwards_elastic": fits_elastic, "fitness_forwards_per_sparsity_total": fits_per * len(a.grid),
        "ratio_if_grid_9": round(9 * per_mean / elastic_s, 3),
        "elastic_fitness": round(elastic.fitness, 5), "elastic_fitness_history_first_last":
            [round(elastic.history[0], 5), round(elastic.history[-1], 5)],
        "block_weights": [round(float(w), 4) for w in elastic.weights],
        "accuracy": rows, "dense_acc": lm.info["dense_eval_acc"],
    }
    text = json.dumps(out, indent=1)
    print(text)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
