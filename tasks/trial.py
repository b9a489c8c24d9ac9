"""One healing trial, end to end, as plain compute (no Ray, no MLflow): the orchestrator wraps it.

load model -> apply the cell's mask -> pruned accuracy -> heal streaming targets from the store, reporting
align_loss and selection accuracy per epoch -> evaluation accuracy, invariant checks, final metrics.
"""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping

import torch

from tasks.adapters import get_adapter
from tasks.evaluate import accuracy
from tasks.export import save_healed
from tasks.heal import HEALERS, HealConfig, HealContext, steps_per_epoch
from tasks.masks import MaskStore
from tasks.models import load_model
from tasks.pruners import achieved_sparsity, apply_masks, mask_violations
from tasks.store import TargetStore


@dataclass(frozen=True)
class TrialParams:
    model: str
    scope: str
    healer: str
    calib_size: int
    lr: float
    epochs: int
    seed: int
    targets_key: str
    mask_key: str
    store_root: str  # target store root
    mask_root: str
    cache_dir: str  # model cache
    data_seed: int = 0
    batch_size: int = 32
    weight_decay: float = 0.0
    lr_min: float = 1e-6
    healer_settings: Mapping[str, Any] = field(default_factory=dict)
    threads: int = 1
    device: str = "cpu"
    load_kw: Mapping[str, Any] = field(default_factory=dict)  # model source + dataset (tasks.models.load_model)
    out_dir: str = ""  # run directory: the healed weights go to <out_dir>/trials/<trial_key>/ ("" = not saved)
    trial_key: str = ""


def _outside_scope_digest(model: torch.nn.Module, scoped: set[str]) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items() if k not in scoped}


def run_trial(p: TrialParams, report: Callable[[dict], None]) -> dict:
    """Run one trial; ``report`` receives one dict per epoch, the last one carrying the final metrics."""
    t_start = time.perf_counter()
    torch.set_num_threads(max(1, p.threads))
    torch.manual_seed(p.seed)
    lm = load_model(p.model, p.cache_dir, data_seed=p.data_seed, progress=False, **p.load_kw)
    model = lm.model.to(p.device)
    adapter = get_adapter(model)
    entries = adapter.scope(model, p.scope)
    masks = MaskStore(p.mask_root).load(p.mask_key)
    ev, sel = lm.dataset["evaluation"], lm.dataset["selection"]
    dense_acc = accuracy(model, ev.images, ev.labels)
    apply_masks(model, masks)
    pruned_acc = accuracy(model, ev.images, ev.labels)
    untouched = _outside_scope_digest(model, {e.param for e in entries})

    reader = TargetStore(p.store_root).open(p.targets_key, num_rows=p.calib_size)
    blocks = adapter.blocks(model)
    ctx = HealContext(
        model=model, blocks=blocks, entries=entries, masks=masks,
        images=lm.dataset["calibration"].images[: p.calib_size],
        batches=lambda epoch: reader.iter_batches(p.batch_size, shuffle=True, seed=p.seed, epoch=epoch),
        steps_per_epoch=steps_per_epoch(p.calib_size, p.batch_size),
        default_granularity=adapter.default_granularity,
        dense_model=lambda: load_model(p.model, p.cache_dir, data_seed=p.data_seed, progress=False,
                                       **p.load_kw).model.to(p.device),
        # Supervised baselines get a budget-matched labeled set: the first calib_size items of the train split.
        labeled=(lm.dataset["train"].images[: p.calib_size], lm.dataset["train"].labels[: p.calib_size]),
    )
    cfg = HealConfig(lr=p.lr, epochs=p.epochs, batch_size=p.batch_size, weight_decay=p.weight_decay,
                     lr_min=p.lr_min, seed=p.seed, settings=dict(p.healer_settings))
    last: dict = {}

    def on_epoch(epoch: int, m: dict[str, float]) -> None:
        last.clear()
        last.update(epoch=epoch, align_loss=m["align_loss"], selection_acc=accuracy(model, sel.images, sel.labels))
        if epoch < p.epochs:
            report(dict(last))

    t0 = time.perf_counter()
    try:
        HEALERS.get(p.healer).heal(ctx, cfg, on_epoch)
    finally:
        reader.close()
    heal_seconds = time.perf_counter() - t0
    changed_outside = sum(int(not torch.equal(v, untouched[k])) for k, v in model.state_dict().items()
                          if k in untouched)
    healed_acc = accuracy(model, ev.images, ev.labels)
    final = dict(last, final=True, dense_acc=dense_acc, pruned_acc=pruned_acc, healed_acc=healed_acc,
                 retention=healed_acc / dense_acc if dense_acc > 0 else 0.0, heal_seconds=heal_seconds,
                 mask_violations=mask_violations(model, masks), achieved_sparsity=achieved_sparsity(entries, masks),
                 changed_outside_scope=changed_outside, trial_seconds=time.perf_counter() - t_start,
                 n_eval=len(ev), num_classes=lm.dataset.num_classes)  # binomial noise of chance (bands)
    final.update(model_digest=lm.digest, calib_digest=lm.dataset.split_digest("calibration", p.calib_size),
                 selection_digest=lm.dataset.split_digest("selection"), eval_digest=lm.dataset.split_digest("evaluation"))
    if p.out_dir and p.trial_key:
        save_healed(Path(p.out_dir) / "trials" / p.trial_key, model, entries, asdict(p), final)
    report(final)
    return final
