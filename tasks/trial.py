"""One healing trial, end to end, as plain compute (no Ray, no MLflow): the orchestrator wraps it.

load model -> apply the cell's mask -> pruned accuracy -> heal streaming targets from the store, reporting
train_loss and selection accuracy per epoch -> evaluation accuracy, invariant checks, final metrics.
"""
from __future__ import annotations

import os
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping

import torch

from tasks.errors import RunDirUnseen
from tasks.evaluate import accuracy
from tasks.export import save_healed
from tasks.healing.base import HealConfig, HealContext
from tasks.healing.chain import resolve_healer
from tasks.healing.heldout import heldout_reference, heldout_score
from tasks.healing.loop import GradientHealer, steps_per_epoch
from tasks.healing.targets import recompute_batches
from tasks.models.adapter import get_adapter
from tasks.models.load import load_model_copy
from tasks.pruning.base import PRUNERS, achieved_sparsity, apply_masks, mask_violations
from tasks.saved_trial import sees_run_dir
from tasks.store import StoreError, TargetStore
from tasks.store.healed import HealedStore
from tasks.store.masks import MaskStore


@dataclass(frozen=True)
class TrialParams:
    model: str
    scope: str
    healer: str
    calib_size: int
    lr: float
    epochs: int
    seed: int
    store_key: str
    mask_key: str
    store_uri: str  # the target store (store.uri, or <--store DIR>/targets)
    mask_root: str
    cache_dir: str  # model cache
    data_seed: int = 0
    batch_size: int = 32
    weight_decay: float = 0.0
    lr_min: float = 1e-6
    healer_settings: Mapping[str, Any] = field(default_factory=dict)
    threads: int = 1
    device: str = "cpu"
    pruner: str = ""  # registered pruner of the mask (structured pruners add efficiency metrics)
    efficiency_batch: int = 64  # evaluation images per timed forward pass (structured pruners)
    latency_rounds: int = 20  # timed rounds of that pass, dense and shrunk (heal.latency_rounds)
    target_mode: str = "store"  # "store": stream from the target store | "recompute": dense pass per batch
    target_dtype: str = "float16"  # dtype of recomputed targets (the store's dtype)
    load_kw: Mapping[str, Any] = field(default_factory=dict)  # model source + dataset (tasks.models.load_model)
    steps: int = 0  # > 0: exactly this many optimizer steps (``epochs`` = the epochs they need); 0: whole epochs
    epoch_selection: bool = True  # selection accuracy after every epoch (False: after the last one only)
    out_dir: str = ""  # run directory: the healed weights go to <out_dir>/trials/<trial_id>/ ("" = not saved)
    trial_id: str = ""
    sweep_id: str = ""  # the sweep's id (its run directory's sweep.json names it)
    healed_root: str = ""  # a remote store's healed/: where a node that does not see out_dir puts the weights
    heal_seed: int | None = None  # re-evaluations: this healing seed (batch order, init) instead of ``seed``
    precision: str = "fp32"  # heal.precision: fp32 (the authors') | tf32 | bf16 (tasks/healing/precision.py)
    channels_last: Any = "auto"  # heal.channels_last: auto (a CNN on a GPU) | True | False
    compile: str = "off"  # heal.compile: off (the authors': eager) | blocks (tasks/healing/compiled.py)
    graph: str = "off"  # heal.graph: off (the authors': eager) | step (tasks/healing/graphed.py)

    @property
    def healing_seed(self) -> int:
        """The seed of everything random in healing; ``seed`` alone still names the cell (and its mask)."""
        return self.seed if self.heal_seed is None else self.heal_seed


def _outside_scope_digest(model: torch.nn.Module, scoped: set[str]) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items() if k not in scoped}


@dataclass
class _Setup:
    """What ``setup_trial`` prepares for ``heal_trial`` and ``final_metrics``."""
    lm: Any
    model: torch.nn.Module
    adapter: Any
    entries: list
    masks: dict
    healer: Any
    untouched: dict[str, torch.Tensor]
    ctx: HealContext
    dense_acc: float
    pruned_acc: float
    reader: Any = None
    dense_selection_acc: float = float("nan")  # the search objective's ceiling (orchestrator/search/converge.py)
    mask_digest: str = ""  # the mask's content (tasks/store/masks.py content_digest, from its check)


def seeded_mask(pruner: str) -> float:
    """1.0 when the pruner's mask depends on the seed (SnapViT's seeded search; a plugin's class attribute too),
    else 0.0 (no pruner: a mask given by key). Logged with every trial: the report's noise line reads it."""
    return float(bool(pruner and getattr(PRUNERS.get(pruner), "seeded_mask", False)))


_ACCURACIES: dict[tuple, float] = {}  # this process's dense/pruned accuracies (a Tune actor runs many trials)
_ACCURACIES_MAX = 1024


def _remembered(key: tuple, measure: Callable[[], float]) -> float:
    """``measure()`` once per ``key`` in this process: the dense and the pruned accuracy depend only on the model
    and its source, its weights (digest; the mask key, content-addressed), the evaluation split (digest), device
    and threads, and every trial of a cell measured the same numbers again (~0.12 s of a 1.4 s vit_digits trial)."""
    if key not in _ACCURACIES:
        if len(_ACCURACIES) >= _ACCURACIES_MAX:
            _ACCURACIES.clear()
        _ACCURACIES[key] = measure()
    return _ACCURACIES[key]


_MODELS_MAX = 4  # models a trial process keeps loaded (tasks.models.load_model_copy)
_REFERENCES: dict[tuple, list] = {}  # the dense models' held-out block outputs (heldout_score), per model
_REFERENCES_MAX = 4


def fresh_model(p: TrialParams):
    """The trial's ``LoadedModel`` with a model of its own: loaded and verified once per process and source, then a
    deep copy per trial (a Tune actor runs many trials; ~9 ms instead of ~25 ms rebuilding and reloading a reference
    model). The dataset splits are shared: nothing writes to them. The process's torch RNG is left as it was."""
    return load_model_copy(p.model, p.cache_dir, data_seed=p.data_seed, keep=_MODELS_MAX, **p.load_kw)


def _heldout_reference(p: TrialParams, lm, rows: slice) -> list:
    """The dense model's held-out block outputs (tasks/healing/heldout.py), computed once per process for a model
    (its source and weights), its calibration split, the rows, device and threads."""
    images = lm.dataset["calibration"].images
    key = (p.model, repr(sorted(p.load_kw.items())), lm.digest, lm.dataset.split_digest("calibration"),
           rows.start, rows.stop, str(p.device), p.threads)
    if key not in _REFERENCES:
        if len(_REFERENCES) >= _REFERENCES_MAX:
            _REFERENCES.clear()
        dense = fresh_model(p).model.to(p.device)
        _REFERENCES[key] = heldout_reference(dense, get_adapter(dense).blocks(dense), images[rows].to(p.device))
    return _REFERENCES[key]


def memory_format(setting: Any, device: str, model: torch.nn.Module) -> torch.memory_format:
    """``heal.channels_last``: auto = channels_last for a CNN (more than one 2-d convolution; a ViT has only its
    patch embedding) on a GPU, where cuDNN's NHWC kernels are faster; never on the CPU unless asked."""
    if setting == "auto":
        convs = sum(isinstance(m, torch.nn.Conv2d) for m in model.modules())
        setting = str(device).startswith("cuda") and convs > 1
    return torch.channels_last if setting else torch.preserve_format


IMAGES_ON_DEVICE_MAX = 2 << 30  # calibration images up to this many bytes are kept on the GPU for the whole trial


def on_device(images: torch.Tensor, device: str, fmt: torch.memory_format) -> torch.Tensor:
    """(N, C, H, W) calibration images where the trial reads them without a host synchronisation per step: on the
    GPU when they fit ``IMAGES_ON_DEVICE_MAX``, else in host memory, each batch gathered into pinned memory and sent
    without blocking (tasks/healing/targets.py ``take_rows``; pinning the whole set would lock GBs per trial and did
    not help: the gathered batch was pageable); unchanged on the CPU."""
    if not str(device).startswith("cuda"):
        return images
    if images.numel() * images.element_size() <= IMAGES_ON_DEVICE_MAX:
        return images.to(device, memory_format=fmt)
    return images


def check_calibration(meta: Mapping[str, Any], digest: str, key: str) -> None:
    """The stored targets are of this trial's calibration images (row i = image i): the store key's manifest
    records the calibration digest the dense stage used (``meta["calibration"]``; older keys may lack it). A trial
    loaded on another order (data seed, ``calib_seed``) would align each image to another image's targets."""
    stored = meta.get("calibration")
    if stored and stored != digest:
        raise StoreError(f"store key {key}: its targets are of calibration images {stored}, this trial's are "
                         f"{digest} (the dense stage and the trial loaded different calibration orders: data_seed or "
                         f"calib_seed)")


def setup_trial(p: TrialParams) -> _Setup:
    """Model, mask applied, dense/pruned accuracy, the healer and its context (targets streamed from the store
    or recomputed per batch)."""
    torch.set_num_threads(max(1, p.threads))
    if str(p.device).startswith("cuda") and not torch.cuda.is_available():
        raise RuntimeError(f"trial device {p.device!r}: this process sees no CUDA device (torch "
                           f"{torch.__version__}, CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r})")
    torch.manual_seed(p.healing_seed)
    lm = fresh_model(p)
    fmt = memory_format(p.channels_last, p.device, lm.model)
    model = lm.model.to(p.device, memory_format=fmt)
    adapter = get_adapter(model)
    entries = adapter.scope(model, p.scope)
    loaded, digest = MaskStore(p.mask_root).load_digested(p.mask_key)  # checked: the digest is what it prunes
    masks = {k: v.to(p.device) for k, v in loaded.items()}  # where the model is
    ev = lm.dataset["evaluation"]
    weights, where = (p.model, repr(sorted(p.load_kw.items())), lm.digest), (str(p.device), p.threads)
    same = (*weights, lm.dataset.split_digest("evaluation"), *where)  # this model, these weights, images, device
    dense_acc = _remembered(same, lambda: accuracy(model, ev.images, ev.labels))
    sel = lm.dataset["selection"]  # the search objective's ceiling: the dense model on the selection split
    dense_sel = _remembered((*weights, lm.dataset.split_digest("selection"), *where),
                            lambda: accuracy(model, sel.images, sel.labels))
    apply_masks(model, masks)
    pruned_acc = _remembered((*same, p.mask_key), lambda: accuracy(model, ev.images, ev.labels))
    healer = resolve_healer(p.healer, p.healer_settings)  # a chain too; may_change: state it may touch
    untouched = _outside_scope_digest(model, {e.param for e in entries} | healer.may_change(model, entries,
                                                                                          p.healer_settings))
    images = on_device(lm.dataset["calibration"].images[: p.calib_size], p.device, fmt)
    blocks = adapter.blocks(model)  # (name, module) of the target blocks, in store order
    reader = None
    if p.target_mode == "recompute":
        dense = fresh_model(p).model.to(p.device, memory_format=fmt)
        dense_blocks = get_adapter(dense).blocks(dense)

        def batches(epoch):
            return recompute_batches(dense, dense_blocks, images, p.batch_size, p.healing_seed, epoch,
                                     getattr(torch, p.target_dtype))
    else:
        # Only the columns the healer reads (kl: the logits, not every block's outputs); none read: all, as ever.
        wanted = healer.reads_targets([b for b, _ in blocks], p.healer_settings) or None
        reader = TargetStore(p.store_uri).open(p.store_key, num_rows=p.calib_size, blocks=wanted)
        check_calibration(reader.meta, lm.dataset.split_digest("calibration"), p.store_key)

        def batches(epoch):
            return reader.iter_batches(p.batch_size, shuffle=True, seed=p.healing_seed, epoch=epoch, device=p.device)
    ctx = HealContext(
        model=model, blocks=blocks, entries=entries, masks=masks,
        images=images,
        batches=batches,
        steps_per_epoch=steps_per_epoch(p.calib_size, p.batch_size),
        default_granularity=adapter.default_granularity,
        dense_model=lambda: fresh_model(p).model.to(p.device),
        # Supervised baselines get a budget-matched labeled set: the first calib_size items of the train split.
        labeled=(lm.dataset["train"].images[: p.calib_size], lm.dataset["train"].labels[: p.calib_size]),
    )
    return _Setup(lm, model, adapter, entries, masks, healer, untouched, ctx, dense_acc, pruned_acc, reader,
                  dense_sel, digest)


def heal_trial(p: TrialParams, st: _Setup, report: Callable[[dict], None], start: Mapping[str, Any] | None,
               checkpoint: Callable[[dict, dict], None] | None) -> tuple[dict, float]:
    """Heal; per non-final epoch ``report`` (or ``checkpoint``) gets epoch, train_loss and, with
    ``p.epoch_selection``, selection_acc. -> (last epoch's metrics with the final selection_acc, heal seconds)."""
    model, entries, healer, ctx = st.model, st.entries, st.healer, st.ctx
    sel = st.lm.dataset["selection"]
    if not isinstance(healer, GradientHealer):  # chains and closed-form healers restart from scratch on retry
        checkpoint = start = None
    if start is not None:  # healed weights of the checkpointed epoch; masked entries are 0 in them too
        params = dict(model.named_parameters())
        with torch.no_grad():
            for name, w in start["weights"].items():
                params[name].copy_(w.to(params[name].device))
        ctx.resume = start["loop"]
    loop_state: dict = {}
    if checkpoint is not None:
        ctx.checkpoint = lambda epoch, s: loop_state.update(s)
    cfg = HealConfig(lr=p.lr, epochs=p.epochs, batch_size=p.batch_size, weight_decay=p.weight_decay,
                     lr_min=p.lr_min, seed=p.healing_seed, settings=dict(p.healer_settings), steps=p.steps,
                     precision=p.precision, compile=p.compile, graph=p.graph)
    n_epochs = healer.epochs(cfg)  # 0 for closed-form / no-op healers: only the final report below
    last: dict = dict(start["last"]) if start is not None else {}

    def on_epoch(epoch: int, m: dict[str, float]) -> None:
        last.clear()
        last.update(epoch=epoch, train_loss=m["train_loss"])
        if st.reader is not None and epoch - 1 in st.reader.rows_streamed:  # rows the epoch streamed from the store
            last["rows_streamed"] = st.reader.rows_streamed[epoch - 1]  # (the reader refuses a short epoch; a
            # steps budget that ends mid-epoch stops reading early: that epoch has no count)
        if epoch >= n_epochs:  # the final selection accuracy is measured after healing, outside heal_seconds
            return
        if p.epoch_selection:
            last["selection_acc"] = accuracy(model, sel.images, sel.labels)
        if checkpoint is not None and loop_state.get("epoch") == epoch:
            named = dict(model.named_parameters())
            weights = {n: named[n].detach().cpu().clone() for n in sorted({e.param for e in entries})}
            checkpoint(dict(last), {"weights": weights, "loop": dict(loop_state), "last": dict(last)})
        else:
            report(dict(last))

    t0 = time.perf_counter()
    try:
        res = healer.heal(ctx, cfg, on_epoch)
    finally:
        if st.reader is not None:
            st.reader.close()
    heal_seconds = time.perf_counter() - t0  # the healing alone: evaluation passes are the trial's, not the heal's
    last["optimizer_steps"] = res.steps
    if "selection_acc" not in last or last.get("epoch", 0) >= n_epochs:  # the search objective, after healing
        last.update(epoch=last.get("epoch", 0), selection_acc=accuracy(model, sel.images, sel.labels))
    return last, heal_seconds


def final_metrics(p: TrialParams, st: _Setup, last: dict, heal_seconds: float) -> dict:
    """Evaluation accuracy, invariants (mask violations, sparsity, nothing changed outside scope), data and
    weights identity, structured-pruner efficiency; saves the healed weights when the trial has a run dir."""
    model, entries, masks, lm = st.model, st.entries, st.masks, st.lm
    ev = lm.dataset["evaluation"]
    allowed = st.healer.may_change(model, entries, p.healer_settings)  # e.g. a bias CORP folds into: not a violation
    changed_outside = sum(int(not torch.equal(v, st.untouched[k])) for k, v in model.state_dict().items()
                          if k in st.untouched and k not in allowed)
    healed_acc = accuracy(model, ev.images, ev.labels)
    # the label-free score (docs/methods.md#search), for every healer: it may be the search objective
    heldout = heldout_score(model, st.ctx.blocks, lambda rows: _heldout_reference(p, lm, rows),
                            lm.dataset["calibration"].images, p.calib_size, st.adapter.default_granularity)
    dense_acc = st.dense_acc
    final = dict(last, final=True, dense_acc=dense_acc, dense_selection_acc=st.dense_selection_acc,
                 n_selection=len(lm.dataset["selection"]),  # the objective's binomial noise (search.converge)
                 pruned_acc=st.pruned_acc, healed_acc=healed_acc,
                 retention=healed_acc / dense_acc if dense_acc > 0 else 0.0, heal_seconds=heal_seconds,
                 mask_violations=mask_violations(model, masks), achieved_sparsity=achieved_sparsity(entries, masks),
                 changed_outside_scope=changed_outside, n_eval=len(ev),
                 num_classes=lm.dataset.num_classes, **heldout)  # n_eval, num_classes: binomial noise of chance
    final.update(model_digest=lm.digest, calib_digest=lm.dataset.split_digest("calibration", p.calib_size),
                 selection_digest=lm.dataset.split_digest("selection"), eval_digest=lm.dataset.split_digest("evaluation"),
                 mask_digest=st.mask_digest)
    final["seeded_mask"] = seeded_mask(p.pruner)
    if p.pruner:  # structured pruners: params/flops/latency/throughput of the dense vs physically shrunk model
        example = ev.images[: p.efficiency_batch].to(p.device)
        final.update(PRUNERS.get(p.pruner).structured_metrics(model, masks, example, rounds=p.latency_rounds))
    if p.out_dir and p.trial_id:
        keep_healed(p, lambda d: save_healed(d, model, entries, asdict(p), final, extra=allowed))
    return final


def weights_home(p: TrialParams) -> str:
    """Where this trial's healed weights go: "run_dir" (``out_dir/trials/<id>``, the usual case; also a trial run
    outside a sweep, without ``sweep_id``) or "store" (a node that does not see the driver's run directory, with a
    remote store: ``<healed_root>/<sweep>/<id>``). RunDirUnseen on such a node without a remote store."""
    if not p.sweep_id or sees_run_dir(p.out_dir, p.sweep_id):
        return "run_dir"
    if p.healed_root:
        return "store"
    raise RunDirUnseen(f"this node does not see the run directory {p.out_dir} (no sweep.json of sweep {p.sweep_id} "
                       "there) and the store is not remote: the healed weights would stay on this node's disk")


def keep_healed(p: TrialParams, save: Callable[[Path], Any]) -> str:
    """``save(dir)`` writes the two files; -> where they went (``weights_home``)."""
    home = weights_home(p)
    if home == "run_dir":
        save(Path(p.out_dir) / "trials" / p.trial_id)
        return home
    with tempfile.TemporaryDirectory(prefix="healsweep-healed-") as d:
        save(Path(d))
        HealedStore(p.healed_root).put(p.sweep_id, p.trial_id, Path(d))
    return home


def run_trial(p: TrialParams, report: Callable[[dict], None], *, start: Mapping[str, Any] | None = None,
              checkpoint: Callable[[dict, dict], None] | None = None) -> dict:
    """Run one trial; ``report`` receives one dict per epoch, the last one carrying the final metrics.

    Fault tolerance: with ``checkpoint``, every non-final epoch of a resumable (gradient) healer calls
    ``checkpoint(metrics, state)`` instead of ``report(metrics)``; ``state`` holds the healed prunable weights,
    the healer's loop state (optimizer, schedule, epoch) and the epoch's metrics. Passing such a state back as
    ``start`` continues the trial after that epoch with the same result as an uninterrupted run.
    """
    t_start = time.perf_counter()
    weights_home(p)  # before any work: a node that could not keep the healed weights refuses the trial
    st = setup_trial(p)
    last, heal_seconds = heal_trial(p, st, report, start, checkpoint)
    final = final_metrics(p, st, last, heal_seconds)
    final["trial_seconds"] = time.perf_counter() - t_start
    report(final)
    return final
