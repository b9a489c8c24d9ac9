"""The healing step's post-step passes over the trainable weights, before and after the lean post-step (issue #33: at
the paper's batch 32 a DeiT-B step has 13.4 ms of GPU kernels, of which fused AdamW 1.1 ms and the mask restores and
the guard's restore, 103 ``where`` kernels, 0.8 ms: gpu_profile_h100_2026-11-26_blocks.txt).

- ``full``: the step as it was until 2026-11-29: every trainable tensor restored after AdamW (``where(keep, w,
  frozen)``) and every weight copied before the step for the divergence guard to put back.
- ``lean`` (the loop now): the restore only on tensors with a nonzero entry the loop may not change (none in the
  default scopes); under a fused AdamW no copy: a bad step is skipped inside the kernel (tasks/healing/loop.py).

Model: timm DeiT-B/16 (random init, the 85 M weights of its 48 block matrices, magnitude 0.5 on the default scope)
at 32 px, 5 tokens an image, so forward and backward are small next to the passes over the weights; STARFISH, batch 8.
Per optimizer (torch's for-each AdamW, the CPU default, and the fused kernel that ``heal.graph: step`` and GPUs use),
``full`` and ``lean`` interleaved over ``--rounds``: median seconds a step (epochs 2.., after the loop's per-epoch
report), and the weights of the two (identical bit for bit, or the script says so).

    python benchmarks/bench_post_step.py                # ~2 min on 2 cores
    python benchmarks/bench_post_step.py --tiny          # checks the script (a small DeiT)
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere
from tasks.healing import HEALERS, HealConfig, HealContext, dense_targets, in_memory_batches  # noqa: E402
from tasks.healing import loop  # noqa: E402
from tasks.healing.loop import steps_per_epoch  # noqa: E402
from tasks.models import ModelRef, build_untrained, get_adapter  # noqa: E402
from tasks.pruning import apply_masks, make_masks  # noqa: E402


@contextlib.contextmanager
def full_post_step():
    """Heals inside run the post-step as before the lean one: every tensor restored, every weight copied."""
    prepare = loop._prepare

    def as_before(*a, **kw):
        r = prepare(*a, **kw)
        r.restore = list(range(len(r.names)))
        r.keep_copies()
        return r

    loop._prepare = as_before
    try:
        yield
    finally:
        loop._prepare = prepare


def build(tiny: bool):
    args = {"img_size": 32, **({"depth": 2, "embed_dim": 64, "num_heads": 2} if tiny else {})}
    dense = build_untrained(ModelRef("deit_b16", "timm", arch="deit_base_patch16_224", pretrained=False,
                                     model_args=args))
    adapter = get_adapter(dense)
    images = torch.randn(32, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    targets = dense_targets(dense, adapter.blocks(dense), images)
    masks = make_masks(dense, adapter.scope(dense, adapter.default_scope), "magnitude", 0.5, seed=0)
    return dense, adapter, images, targets, masks


def heal(parts, graph: str, epochs: int, batch: int) -> tuple[float, dict]:
    """Seconds a step over epochs 2.. of one STARFISH heal, and the healed state."""
    dense, adapter, images, targets, masks = parts
    model = copy.deepcopy(dense)
    apply_masks(model, masks)
    scope = adapter.scope(model, adapter.default_scope)
    spe = steps_per_epoch(len(images), batch)
    ctx = HealContext(model, adapter.blocks(model), scope, masks, images, in_memory_batches(targets, batch, 0), spe,
                      adapter.default_granularity)
    marks = []
    HEALERS.get("starfish").heal(ctx, HealConfig(lr=1e-3, epochs=epochs, batch_size=batch, seed=0, graph=graph,
                                                 weight_decay=0.05),
                                 lambda e, m: marks.append(time.perf_counter()))
    return (marks[-1] - marks[0]) / ((epochs - 1) * spe), model.state_dict()


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true", help="a small DeiT (checks the script)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--epochs", type=int, default=3, help="epochs per heal (epochs 2.. are timed)")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--json", type=Path)
    a = ap.parse_args(argv)
    torch.manual_seed(0)
    parts = build(a.tiny)
    n = sum(m.numel() for m in parts[4].values())
    out = {"date_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()), "torch": torch.__version__,
           "threads": torch.get_num_threads(), "load_1min_before": os.getloadavg()[0], "trainable_weights": n,
           "optimizers": {}}
    for opt_name, graph in [("foreach (CPU default)", "off"), ("fused (heal.graph: step, GPUs)", "step")]:
        secs: dict[str, list[float]] = {"full": [], "lean": []}
        states = {}
        for _ in range(a.rounds):
            for variant in ("full", "lean"):
                with full_post_step() if variant == "full" else contextlib.nullcontext():
                    s, states[variant] = heal(parts, graph, a.epochs, a.batch)
                secs[variant].append(s)
        same = all(torch.equal(states["full"][k], states["lean"][k]) for k in states["full"])
        med = {k: statistics.median(v) for k, v in secs.items()}
        out["optimizers"][opt_name] = {"step_s": med, "rounds_s": secs, "lean_over_full": med["lean"] / med["full"],
                                       "weights_identical": same}
        print(f"{opt_name}: full {1e3 * med['full']:.1f} ms a step, lean {1e3 * med['lean']:.1f} ms "
              f"({med['lean'] / med['full']:.3f}x); weights {'identical' if same else 'DIFFER'}", flush=True)
    out["load_1min_after"] = os.getloadavg()[0]
    if a.json:
        a.json.write_text(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
