"""The process's CUDA side streams: one per device and role, made once, never the same stream for two roles.

Roles: ``heal`` (heal.graph: step's eager warm-up steps and its captures, tasks/healing/graphed.py) and ``copy``
(the store's host-to-device copies, tasks/store/stream.py). Why not a new ``torch.cuda.Stream()`` where one is
needed: torch hands out its 32 pooled streams per device round robin, so
- every new stream that runs a matrix product gets cuBLAS and cuBLASLt workspaces of its own, which the process
  keeps for its life (neither a collection nor ``empty_cache`` frees them): 65 MiB a stream on an H200. A trial
  actor (reused, heal after heal) that drew two warm-up streams per heal grew by 130 MiB a heal until the pool
  wrapped (benchmarks/results/gpu_graph_h200_2026-11-30_call3.json: +130 MiB per captured heal at batch 32 and at
  128 alike, +195 MiB for the first, which also drew the capture stream; flat after the 32nd stream);
- a stream drawn per epoch for the store's copies comes round again as any other role's stream: the prefetch
  thread's copies would then be queued on the stream a capture is recording (and join the graph).
Here each role has one stream per device and process, drawn until it differs from the other roles' streams."""
from __future__ import annotations

import threading
from typing import Callable, TypeVar

import torch

ROLES = ("heal", "copy")
POOL = 32  # torch's pooled streams per device and priority (c10/cuda/CUDAStream.h)
_STREAMS: dict[tuple[int, str], torch.cuda.Stream] = {}
_LOCK = threading.Lock()  # the store's prefetch thread may draw its role's stream while the heal draws its own
T = TypeVar("T")


def side_stream(device: torch.device | str | int, role: str) -> torch.cuda.Stream:
    """The process's side stream for ``role`` on CUDA ``device`` (made on first use)."""
    if role not in ROLES:
        raise ValueError(f"role must be one of {', '.join(ROLES)}, got {role!r}")
    dev = torch.device(device) if not isinstance(device, int) else torch.device("cuda", device)
    index = dev.index if dev.index is not None else torch.cuda.current_device()
    with _LOCK:
        stream = _STREAMS.get((index, role))
        if stream is None:
            taken = {s.cuda_stream for (i, _), s in _STREAMS.items() if i == index}
            stream = _STREAMS[(index, role)] = distinct_draw(lambda: torch.cuda.Stream(device=index),
                                                             lambda s: s.cuda_stream, taken)
    return stream


def distinct_draw(draw: Callable[[], T], handle: Callable[[T], int], taken: set[int], limit: int = 2 * POOL) -> T:
    """The first of up to ``limit`` calls of ``draw`` whose ``handle`` is not in ``taken`` (a pool that hands out its
    members round robin gives one within its size); RuntimeError if none is."""
    for _ in range(limit):
        item = draw()
        if handle(item) not in taken:
            return item
    raise RuntimeError(f"no stream distinct from {len(taken)} taken ones in {limit} draws")
