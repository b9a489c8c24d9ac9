"""Healers (docs/methods.md#starfish), registered by name, and the one gradient training loop they share.

A gradient healer is an objective plus the shared loop: AdamW over the prunable tensors only, a per-step
cosine schedule from lr to lr_min over every step of the trial (``epochs`` × steps per epoch, or exactly
``HealConfig.steps`` when given: the loop then stops mid-epoch after that many steps, docs/methods.md#search),
gradients of masked and out-of-region entries zeroed, and after every step every entry a healer may not change
is restored (masked entries stay exactly 0; the rest of the model is frozen with requires_grad=False). A tensor
whose frozen entries are all zeros needs no restore and gets none: AdamW leaves an entry that is ±0 with a zero
gradient (hence zero moments) zero (decay 0·(1 - lr·wd), update lr·0/(√0 + eps)); the CPU keeps its sign bit too,
CUDA's fused kernel under weight decay turns a −0.0 into +0.0 (measured on an H200, 2026-11-30: equal values, the
restore's copy differs only there); ``_Run.restore`` lists the others (e.g. a fused qkv tensor's V rows under
``qk_train='qk'``).

Settings every gradient healer shares (docs/methods.md#starfish):
- ``bn: train | frozen`` (default ``train``, the authors' ``pruned_model.train()``): the pruned model runs in
  train mode while healing, so BatchNorm normalises with batch statistics and its running statistics follow
  the pruned network (module momentum, starting from the dense values, no reset); every BN buffer is declared
  in ``may_change``. ``frozen``: eval mode, no buffer changes (the project's earlier behaviour).
- ``qk_train: qkv | qk`` (default ``qkv``, the authors): for row-range (``qk``) entries, every unmasked entry of
  the whole fused tensor trains (V rows included; never the bias). ``qk``: only the Q/K rows.
The per-epoch report key ``train_loss`` is the healer's own training objective (cosine alignment for STARFISH,
MSE, KL, CE, ...; MLflow metric ``train_loss``); the label-free ``heldout_align`` is measured by the trial.
The healers on this loop: tasks/healing/objectives.py; closed-form healers: tasks/healing/crbn.py and corp.py; chains of
healers: tasks/healing/chain.py.
"""
from __future__ import annotations

import math
import time
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Mapping

import torch

from tasks.healing.base import Batches, EpochCallback, HealConfig, HealContext, Healer, HealResult
from tasks.healing.compiled import compiled_blocks, compiled_fn
from tasks.healing.graphed import StepGraphs, capturable_adamw, check_graph, rebind_lr
from tasks.healing.guard import DivergenceGuard, adamw_stays_finite, finite_norms, keep_or_restore
from tasks.healing.precision import as_f32, dict_f32, forward_context, precision_flags
from tasks.healing.targets import LOGITS, block_tap, device_index, take_rows
from tasks.pruning.base import train_masks
from tasks.pruning.repair import bn_state_names

BN_MODES = ("train", "frozen")
QK_TRAIN = ("qkv", "qk")
LOOP_SETTINGS: dict[str, tuple] = {"bn": BN_MODES, "qk_train": QK_TRAIN}


def loop_settings(settings: Mapping[str, Any]) -> dict[str, str]:
    """The shared loop settings with their defaults filled in (the authors' behaviour)."""
    return {"bn": settings.get("bn", "train"), "qk_train": settings.get("qk_train", "qkv")}


def trainable_masks(model: torch.nn.Module, entries, masks, qk_train: str) -> dict[str, torch.Tensor]:
    """Entries the loop trains: surviving weights of the prunable region; with ``qk_train='qkv'`` a row-range
    entry trains every unmasked entry of its whole tensor (V rows of a fused qkv weight included)."""
    out = train_masks(model, entries, masks)
    if qk_train == "qkv":
        for e in entries:
            if e.rows is not None:
                out[e.param] = masks[e.param].clone()
    return out


class GradientHealer(Healer):
    """The shared loop. A subclass defines its objective: ``loss(outputs, targets, settings)`` on the tapped block
    outputs (block-target healers), or ``objective(...)`` for anything else (logits, labels, mixtures). Healers that
    do not read block outputs set ``uses_blocks = False``: no forward hooks are installed at all."""

    trains = True
    uses_calibration = True  # heals on the calibration images' dense targets (``ce``: on labeled train images)
    uses_blocks = True
    reads_logits = False  # the objective reads the dense logits (targets[LOGITS])
    settings_schema: dict[str, tuple] = dict(LOOP_SETTINGS)

    def reads_targets(self, block_names, settings):
        return [*(block_names if self.uses_blocks else []), *([LOGITS] if self.reads_logits else [])]

    def resolve(self, ctx: HealContext, settings: Mapping[str, Any]) -> dict[str, Any]:
        return dict(settings)

    def resolved_settings(self, settings: Mapping[str, Any]) -> dict[str, Any]:
        """The settings with every default filled in (run identity and MLflow params log these)."""
        return {**dict(settings), **loop_settings(settings)}

    def may_change(self, model, entries, settings=None):
        """BatchNorm buffers (whole model) under ``bn='train'``; under ``qk_train='qkv'`` the fused tensors of
        row-range entries (their V rows change outside the prunable region)."""
        common = loop_settings(settings or {})
        out = bn_state_names(model) if common["bn"] == "train" else set()
        if common["qk_train"] == "qkv":
            out |= {e.param for e in entries if e.rows is not None}
        return out

    def epochs(self, cfg: HealConfig) -> int:
        return cfg.epochs

    def steps_per_epoch(self, ctx: HealContext, cfg: HealConfig) -> int:
        return ctx.steps_per_epoch

    def stream(self, ctx: HealContext, cfg: HealConfig, epoch: int) -> Iterator[tuple[torch.Tensor, dict[str, torch.Tensor]]]:
        """(images (B, C, H, W), {name: (B, ...)}) for one epoch: calibration images and their dense targets."""
        dev = next(ctx.model.parameters()).device
        for rows, tgt in ctx.batches(epoch):
            yield take_rows(ctx.images, rows, dev), tgt

    def loss(self, outputs: list[torch.Tensor], targets: list[torch.Tensor], settings: Mapping[str, Any]
             ) -> torch.Tensor:
        raise NotImplementedError

    def objective(self, blocks: Mapping[str, torch.Tensor], logits: torch.Tensor, targets: Mapping[str, torch.Tensor],
                  block_names: list[str], settings: Mapping[str, Any]) -> torch.Tensor:
        """Scalar loss of one batch. ``blocks``: tapped outputs (empty when uses_blocks is False); ``logits``:
        (B, K) model output; ``targets``: the batch's stream dict (on CPU, store dtype)."""
        dev = logits.device
        return self.loss([blocks[b] for b in block_names], [targets[b].to(dev, non_blocking=True) for b in block_names],
                         settings)

    def heal(self, ctx: HealContext, cfg: HealConfig, on_epoch: EpochCallback | None = None) -> HealResult:
        model = ctx.model
        settings = self.resolve(ctx, cfg.settings)
        common = loop_settings(cfg.settings)
        r = _prepare(ctx, cfg, common, self.steps_per_epoch(ctx, cfg))
        torch.manual_seed(cfg.seed)
        model.train(common["bn"] == "train")  # the authors heal in train mode: BN batch statistics (docs/methods.md#starfish)
        block_names = [b for b, _ in ctx.blocks] if self.uses_blocks else []
        losses, steps, t0, start = [], 0, time.perf_counter(), 0
        if ctx.resume is not None:
            r.opt.load_state_dict(ctx.resume["optimizer"])
            r.sched.load_state_dict(ctx.resume["scheduler"])
            if cfg.graph == "step":
                rebind_lr(r.opt, r.sched)  # the loaded group's lr is a number again: the device tensor back
            start, steps, losses = int(ctx.resume["epoch"]), int(ctx.resume["steps"]), list(ctx.resume["losses"])
            _load_buffers(model, ctx.resume.get("buffers", {}))
        r.guard = DivergenceGuard(r.dev, first_step=steps)
        lowp = cfg.precision == "bf16"

        def batch_objective(cap: dict, lg: torch.Tensor, tgt: dict) -> torch.Tensor:  # one batch's scalar loss
            return self.objective(dict_f32(cap) if lowp else cap, as_f32(lg), tgt, block_names, settings)

        batch_objective = compiled_fn(batch_objective, cfg.compile)  # heal.compile (tasks/healing/compiled.py)
        graphs = StepGraphs(r.dev) if cfg.graph == "step" else None  # heal.graph (tasks/healing/graphed.py)
        try:
            with (block_tap(ctx.blocks) if self.uses_blocks else nullcontext({})) as cap, precision_flags(cfg.precision), \
                    compiled_blocks(ctx.blocks if self.uses_blocks else [], cfg.compile):

                def body(xb: torch.Tensor, tb: dict) -> torch.Tensor:  # one whole step (what heal.graph captures)
                    return self._step(r, model, lambda lg: batch_objective(cap, lg, tb), xb, cfg.precision)

                for epoch in range(start, cfg.epochs):
                    run, n = torch.zeros((), dtype=torch.float64, device=r.dev), 0  # the epoch's loss sum, on device
                    for x, tgt in self.stream(ctx, cfg, epoch):
                        if cfg.steps and steps >= cfg.steps:  # a steps budget ends mid-epoch
                            break
                        loss = body(x, tgt) if graphs is None else graphs(body, x, tgt)
                        r.sched.step()  # on the host (heal.graph: it writes the device lr the next step reads)
                        run += loss.double() * len(x)
                        n += len(x)
                        steps += 1
                    r.guard.raise_if_bad(self.name, lambda s, e=epoch: f"epoch {e + 1}, step {s + 1} (lr={cfg.lr:g})",
                                         r.grad_names or r.names)  # one host synchronisation per epoch
                    losses.append(float(run) / max(n, 1))
                    if ctx.checkpoint is not None:
                        ctx.checkpoint(epoch + 1, {"epoch": epoch + 1, "steps": steps, "losses": list(losses),
                                                   "optimizer": r.opt.state_dict(), "scheduler": r.sched.state_dict(),
                                                   "buffers": _bn_buffers(model)})
                    if on_epoch is not None:
                        on_epoch(epoch + 1, {"train_loss": losses[-1]})
        finally:
            model.eval()
            for name in r.names:
                r.params[name].requires_grad_(False)
                r.params[name].grad = None  # (a captured step's gradients live in its graph's pool)
            if graphs is not None:
                loss = None  # a replay's loss is the graph's static output
                graphs.close()  # its graphs and their memory, before the next heal in this process
        return HealResult(losses, time.perf_counter() - t0, steps)

    def _step(self, r: _Run, model: torch.nn.Module, objective: Callable[[torch.Tensor], torch.Tensor],
              x: torch.Tensor, precision: str = "fp32") -> torch.Tensor:
        """One masked AdamW step on batch ``x``, without a host synchronisation: a step whose loss, a gradient or an
        updated weight is not finite (or any step after one) leaves weights and BN buffers as before it, and the
        loop's once-per-epoch ``guard.raise_if_bad`` raises HealingDiverged for it. -> the batch loss, () on device."""
        params, names = r.params, r.names
        saved = {k: v.clone() for k, v in r.bn_bufs.items()}  # a NaN batch must not poison them
        with forward_context(precision, r.dev):
            out = model(x.to(r.dev, non_blocking=True))
        loss = objective(out)
        r.opt.zero_grad(set_to_none=True)
        loss.backward()
        with torch.no_grad():
            present = [i for i, name in enumerate(names) if params[name].grad is not None]  # None: e.g. a classifier
            grads = [params[names[i]].grad for i in present]  # after the last target block: untouched
            torch._foreach_mul_(grads, [r.keep_f[i] for i in present])  # = g.mul_(keep): bit for bit, one launch
            grad_ok, bad_grad = finite_norms(grads, r.dev)
            loss_ok = torch.isfinite(loss)
            r.grad_names = [names[i] for i in present]
            current = [params[name].data for name in names]
            if r.skip is not None:  # fused AdamW skips the step itself when it, or one before, was not finite
                r.skip.copy_(~(loss_ok & grad_ok) | r.guard.bad)
            else:
                torch._foreach_copy_(r.before, current)  # the weights before the step, into buffers made once
        r.opt.step()  # the schedule steps after the whole step (the loop): the lr of the next one
        with torch.no_grad():
            for i in r.restore:  # in place (out= the parameter itself): one kernel, no temporary
                torch.where(r.keep[names[i]], current[i], r.frozen[names[i]], out=current[i])
            undo = r.guard.record(loss_ok, grad_ok, bad_grad, finite_norms(current, r.dev)[0], loss)
            if r.skip is None:
                keep_or_restore(undo, current, r.before)  # never leave NaN/Inf weights
            keep_or_restore(undo, list(r.bn_bufs.values()), [saved[k] for k in r.bn_bufs])
        return loss.detach()


@dataclass
class _Run:
    """What one healing run trains: the scope's parameters, their trainable masks and pruned values, the
    optimizer and schedule, and the BN buffers a diverged step restores."""
    params: dict[str, torch.nn.Parameter]
    names: list[str]
    keep: dict[str, torch.Tensor]  # (same shape as the parameter) bool: entries that may change
    frozen: dict[str, torch.Tensor]  # pruned values: masked entries are 0
    opt: torch.optim.Optimizer
    sched: Any
    bn_bufs: dict[str, torch.Tensor]
    dev: torch.device
    keep_f: list[torch.Tensor] | None = None  # keep per name (in ``names`` order) as the parameter's float dtype
    restore: list[int] | None = None  # indices into ``names`` with a nonzero frozen entry: restored every step
    skip: torch.Tensor | None = None  # () float32, the fused AdamW's ``found_inf``: 1 skips its step (no ``before``)
    before: list[torch.Tensor] | None = None  # per name: the weights before the running step (reused buffers)
    guard: Any = None  # DivergenceGuard of the running heal
    grad_names: list[str] | None = None  # parameters that had a gradient in the last step (the guard's index)

    def keep_copies(self) -> None:
        """The guard restores from copies: every weight copied before each step (into buffers made here), no
        ``found_inf``. For optimizers that take none and learning rates beyond the bound (skip_flag)."""
        if self.skip is not None:
            self.opt.found_inf, self.skip = None, None
        if self.before is None:
            self.before = [self.frozen[n].clone() for n in self.names]


def _prepare(ctx: HealContext, cfg: HealConfig, common: dict, steps_per_epoch: int) -> _Run:
    """Freeze everything but the scope's parameters; AdamW over them with a cosine schedule over the run's steps."""
    check_graph(cfg.graph)
    model = ctx.model
    params = dict(model.named_parameters())
    names = sorted({e.param for e in ctx.entries})
    trainable = trainable_masks(model, ctx.entries, ctx.masks, common["qk_train"])
    for p in model.parameters():
        p.requires_grad_(False)
    dev = params[names[0]].device
    keep = {n: trainable[n].to(dev) for n in names}
    frozen = {n: params[n].detach().clone() for n in names}
    for n in names:
        params[n].requires_grad_(True)
    def cosine(o: torch.optim.Optimizer):
        return torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=schedule_steps(cfg, steps_per_epoch),
                                                          eta_min=cfg.lr_min)

    if cfg.graph == "step":  # fused and capturable, its lr a device tensor the host schedule writes (graphed.py)
        opt, sched = capturable_adamw([params[n] for n in names], cfg.lr, cfg.weight_decay, dev, cosine)
    else:  # on a GPU the fused AdamW kernel (one launch for every tensor); on the CPU torch's default
        # implementation, as every CPU figure of this project was measured with
        opt = torch.optim.AdamW([params[n] for n in names], lr=cfg.lr, weight_decay=cfg.weight_decay,
                                fused=True if dev.type == "cuda" else None)
        sched = cosine(opt)
    sd = model.state_dict()
    bn_bufs = {k: sd[k] for k in bn_state_names(model)} if common["bn"] == "train" else {}
    skip = skip_flag(opt, dev, [frozen[n] for n in names], max(cfg.lr, cfg.lr_min), schedule_steps(cfg, steps_per_epoch))
    r = _Run(params, names, keep, frozen, opt, sched, bn_bufs, dev, keep_f=[keep[n].to(params[n].dtype) for n in names],
             restore=needs_restore(names, keep, frozen), skip=skip)
    if skip is None:
        r.keep_copies()
    return r


def needs_restore(names: list[str], keep: Mapping[str, torch.Tensor], frozen: Mapping[str, torch.Tensor]) -> list[int]:
    """Indices of ``names`` whose tensor has an entry the loop may not change that is not zero (keep (shape of the
    tensor) bool, frozen its pruned values): only there can AdamW's weight decay move one. One host sync, at setup."""
    nonzero = torch.stack([torch.any(~keep[n] & (frozen[n] != 0)) for n in names]).tolist()  # (len(names),) bool
    return [i for i, flag in enumerate(nonzero) if flag]


def skip_flag(opt: torch.optim.Optimizer, dev: torch.device, weights: list[torch.Tensor], lr_max: float,
              steps: int) -> torch.Tensor | None:
    """For a fused AdamW whose steps provably keep the weights finite (guard.adamw_stays_finite: any learning rate a
    search would try): a () float32 device flag set as the optimizer's ``found_inf`` (as torch's GradScaler does).
    A step whose loss or gradients are not finite (or any after one) then leaves the weights and the optimizer's
    state untouched inside the kernel, and the loop needs no copy of every weight before each step: the only other
    reason to restore them (the guard's reason 3) cannot occur. Same weights, bit for bit. None (the copy) for torch's
    other AdamW implementations (the CPU default), which take no flag, and for learning rates beyond the bound."""
    if not all(g.get("fused") for g in opt.param_groups):
        return None
    max_abs = float(torch.stack([w.detach().abs().max() for w in weights]).max())  # one host sync, at setup
    numel = max(w.numel() for w in weights)
    if not all(adamw_stays_finite(max_abs, numel, lr_max, g["weight_decay"], steps, g["betas"])
               for g in opt.param_groups):
        return None
    opt.found_inf = torch.zeros((), dtype=torch.float32, device=dev)
    return opt.found_inf


def _bn_buffers(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """BatchNorm buffers (they evolve under bn='train'; a resumed trial restores them)."""
    sd = model.state_dict()
    return {k: sd[k].detach().cpu().clone() for k in sorted(bn_state_names(model))}


def _load_buffers(model: torch.nn.Module, buffers: Mapping[str, torch.Tensor]) -> None:
    sd = model.state_dict()
    with torch.no_grad():
        for k, v in buffers.items():
            sd[k].copy_(v.to(sd[k].device))


def schedule_steps(cfg: HealConfig, per_epoch: int) -> int:
    """Optimizer steps of the whole trial (the cosine schedule's T_max): ``cfg.steps`` when given (``cfg.epochs``
    must cover them), else epochs × steps per epoch."""
    if cfg.steps:
        if cfg.steps > cfg.epochs * per_epoch:
            raise ValueError(f"steps={cfg.steps} need {math.ceil(cfg.steps / per_epoch)} epochs of {per_epoch} steps, "
                             f"got epochs={cfg.epochs}")
        return cfg.steps
    return max(cfg.epochs * per_epoch, 1)


def steps_per_epoch(n_rows: int, batch_size: int) -> int:
    return math.ceil(n_rows / batch_size)


def in_memory_batches(targets: Mapping[str, torch.Tensor], batch_size: int, seed: int,
                      order: Callable[[int], Any] | None = None) -> Batches:
    """Targets held in RAM, shuffled per epoch with a seeded generator (tests, benchmarks, recompute mode).
    ``order(epoch)`` overrides the row order (e.g. a store reader's ``epoch_order``, to compare like with like)."""
    n = next(iter(targets.values())).shape[0]

    def batches(epoch: int) -> Iterator[tuple[torch.Tensor, dict[str, torch.Tensor]]]:
        if order is None:
            rows_all = torch.randperm(n, generator=torch.Generator().manual_seed(seed * 100_003 + epoch))
        else:
            rows_all = torch.as_tensor(order(epoch))
        for i in range(0, n, batch_size):
            rows = rows_all[i : i + batch_size]
            yield rows, {k: v[device_index(rows, v.device)] for k, v in targets.items()}  # no host sync on a GPU

    return batches
