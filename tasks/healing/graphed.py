"""The healing step as one CUDA graph (``heal.graph``, docs/gpu.md#settings): a named setting, logged with every trial.

- ``off`` (default, as the authors run STARFISH: shrikboi/STARFISH recovery.py launches every kernel from Python):
  the step of tasks/healing/loop.py, eager.
- ``step``: the whole step (forward with its block taps, the objective, backward, the gradient masks, the divergence
  guard, the AdamW update and the mask restores) is captured once per batch shape as a CUDA graph and replayed, so
  the host issues a few calls a step instead of hundreds. At the paper's batch 32 a DeiT-B step is bound by its host
  thread (docs/gpu.md). The optimizer is AdamW's fused kernel with ``capturable=True`` and the learning rate in a
  device tensor: the cosine schedule runs on the host in float64 as under ``off`` and each step writes its value
  into that tensor (float32: the fused kernel's learning-rate argument), so results agree with ``off`` to that
  rounding, not bit for bit. A batch shape's first ``WARMUP`` steps run eagerly on a side stream (lazy
  initialisation, compilation under ``heal.compile: blocks``, the optimizer's state), its next one is captured on
  the same stream, the process's one for healing (tasks/cuda_streams.py).
  Without CUDA there is nothing to capture: the same optimizer and schedule run eagerly (as ``tf32`` is fp32 there).
"""
from __future__ import annotations

import gc
import warnings
from typing import Any, Callable, Mapping

import torch

from tasks.cuda_streams import side_stream

GRAPH_MODES = ("off", "step")
WARMUP = 2  # eager steps of a batch shape before its capture


def check_graph(mode: str) -> str:
    if mode not in GRAPH_MODES:
        raise ValueError(f"graph must be one of {', '.join(GRAPH_MODES)}, got {mode!r}")
    return mode


class HostSchedule:
    """A learning-rate scheduler on the host driving a device learning rate: ``make(host_optimizer)`` builds the
    schedule (e.g. CosineAnnealingLR) over a parameterless stand-in whose float64 lr follows the same recursion as
    under ``heal.graph: off``; every ``step()`` writes the new value into ``lr`` (() float32 on the device, the
    optimizer's learning rate) with one fill kernel and no host synchronisation."""

    def __init__(self, lr: torch.Tensor, base_lr: float, make: Callable[[torch.optim.Optimizer], Any]):
        self.lr = lr
        self.host = torch.optim.SGD([torch.zeros((), requires_grad=True)], lr=base_lr)
        self.sched = make(self.host)
        self.host.step()  # a step of a parameter without a gradient changes nothing; torch then knows it stepped
        self.write()

    def write(self) -> None:
        """The host schedule's current lr into the device tensor (one fill kernel)."""
        self.lr.fill_(self.host.param_groups[0]["lr"])

    def step(self) -> None:
        self.sched.step()
        self.write()

    def state_dict(self) -> dict:
        return self.sched.state_dict()

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.sched.load_state_dict(dict(state))
        lr = state.get("_last_lr", [self.host.param_groups[0]["lr"]])[0]
        self.host.param_groups[0]["lr"] = float(lr)
        self.write()


def capturable_adamw(params: list[torch.nn.Parameter], lr: float, weight_decay: float, dev: torch.device,
                     make_schedule: Callable[[torch.optim.Optimizer], Any]) -> tuple[torch.optim.Optimizer, HostSchedule]:
    """AdamW (fused kernel, ``capturable=True``) reading its learning rate from a device tensor, and the host
    schedule that writes it. After the optimizer's ``load_state_dict`` (a resumed trial), ``rebind_lr``."""
    lr_t = torch.tensor(lr, dtype=torch.float32, device=dev)
    opt = torch.optim.AdamW(params, lr=lr_t, weight_decay=weight_decay, fused=True, capturable=True)
    return opt, HostSchedule(lr_t, lr, make_schedule)


def rebind_lr(opt: torch.optim.Optimizer, sched: HostSchedule) -> None:
    """After ``opt.load_state_dict``: the group's learning rate is the schedule's device tensor again."""
    for group in opt.param_groups:
        group["lr"] = sched.lr
    sched.write()


def _key(x: torch.Tensor, tgt: Mapping[str, torch.Tensor]) -> tuple:
    return tuple(x.shape), tuple((k, tuple(v.shape), v.dtype) for k, v in tgt.items())


class StepGraphs:
    """Runs ``body(x, targets) -> loss`` (one whole step, () on device) eagerly or as a replayed CUDA graph.

    Per batch shape: ``WARMUP`` eager steps on a side stream, then a capture into static input buffers (the step
    it captures is run by the first replay), then replays after copying each batch into those buffers. The loss a
    replay returns is the graph's static output: read it before the next step (the loop adds it to the epoch's sum
    at once). Without CUDA every step is eager."""

    def __init__(self, dev: torch.device):
        self.dev = dev
        self.capture = dev.type == "cuda"
        self.warmup = WARMUP
        self.graphs: dict[tuple, tuple] = {}  # key -> (graph, static x, static targets, static loss)
        self.seen: dict[tuple, int] = {}
        self.failed: dict[tuple, str] = {}  # key -> why its capture failed (it then runs eagerly)
        self.captured: list[tuple] = []  # keys captured, in order (kept after close)
        self.closed = False

    def __call__(self, body: Callable[[torch.Tensor, dict], torch.Tensor], x: torch.Tensor,
                 tgt: Mapping[str, torch.Tensor]) -> torch.Tensor:
        if not self.capture:
            return body(x, dict(tgt))
        key = _key(x, tgt)
        if key in self.graphs:
            return self._replay(self.graphs[key], x, tgt)
        self.seen[key] = self.seen.get(key, 0) + 1
        if key in self.failed or self.seen[key] <= self.warmup:
            return self._eager(body, x, tgt)
        return self._capture(key, body, x, tgt)

    def _eager(self, body, x, tgt) -> torch.Tensor:
        s = side_stream(self.dev, "heal")  # the process's one (tasks/cuda_streams.py): the capture's stream too
        s.wait_stream(torch.cuda.current_stream(self.dev))
        with torch.cuda.stream(s), warnings.catch_warnings():
            # torch warns once that a capturable optimizer steps uncaptured: these warm-up steps are meant to
            warnings.filterwarnings("ignore", message=".*capturable=True.*", category=UserWarning)
            loss = body(x, dict(tgt))
        torch.cuda.current_stream(self.dev).wait_stream(s)
        return loss

    def _capture(self, key, body, x, tgt) -> torch.Tensor:
        sx = x.to(self.dev, copy=True)  # static inputs: every replay reads these addresses
        st = {k: v.to(self.dev, copy=True) for k, v in tgt.items()}
        torch.cuda.synchronize(self.dev)  # once per shape: nothing in flight may touch what the capture records
        g = torch.cuda.CUDAGraph()
        try:
            # thread_local: the store's prefetch thread keeps copying (and waiting on its events) during the capture
            # on the warm-up steps' stream: its cuBLAS workspaces exist before the capture, and no other thread's
            # work is queued there (tasks/cuda_streams.py)
            with torch.cuda.graph(g, stream=side_stream(self.dev, "heal"), capture_error_mode="thread_local"):
                loss = body(sx, st)
        except Exception as e:  # noqa: BLE001 - a shape that cannot be captured heals eagerly, said once
            self.failed[key] = f"{type(e).__name__}: {e}"
            warnings.warn(f"heal.graph: step: capturing batch shape {key[0]} failed ({self.failed[key]}); "
                          f"it runs eagerly", RuntimeWarning, stacklevel=3)
            return self._eager(body, x, tgt)
        self.graphs[key] = (g, sx, st, loss)
        self.captured.append(key)
        g.replay()  # the capture recorded the step without running it
        return loss

    def close(self) -> None:
        """After the heal (the loop's ``finally``): drop every graph with its static buffers and, on CUDA, collect
        reference cycles and hand the allocator's free blocks back (a destroyed graph's private pool is freed only
        then), so that the next heal in the same process (a reused trial actor) starts without them. On an H200
        (2026-11-30) gpu_graph.py ran out of memory after 6 DeiT-B heals without a collection between heals (125.5 GiB
        reserved but unallocated); with one and an empty cache after each heal, 40 heals stayed within 8.9 GiB
        reserved. What each captured heal still left allocated then (130 MiB, at batch 32 and 128 alike) was the
        cuBLAS workspaces of two new warm-up streams, which the one side stream of tasks/cuda_streams.py ends."""
        self.graphs.clear()
        self.closed = True
        if self.capture:
            gc.collect()
            torch.cuda.empty_cache()

    @staticmethod
    def _replay(entry: tuple, x: torch.Tensor, tgt: Mapping[str, torch.Tensor]) -> torch.Tensor:
        g, sx, st, loss = entry
        sx.copy_(x, non_blocking=True)
        for k, v in tgt.items():
            st[k].copy_(v, non_blocking=True)
        g.replay()
        return loss
