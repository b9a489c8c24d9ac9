"""SnapViT as the authors run it (``variant: authors``, docs/methods.md#snapvit; WalterSimoncini/SnapViT with
pypop7's xNES). Pure compute on a model and calibration images; the joint variant lives in snapvit_math.py.

- Search space: one weight per block MLP and one per head, x = [x_mlp (B_mlp,); x_head (B_head·H,)], unit
  weight c = |x|, start m0 = linspace(1.2, 0.8) over blocks (a block's heads start at its MLP value), Σ0 = I.
- Sensitivity: the gradient G of the multi-crop DINO loss accumulated over all batches (2 global crops, scale
  (0.25, 1); 10 local crops, scale (0.05, 0.25); all at the input size; teacher = the frozen model on the
  global crops; τ = 1, no centring; 22 (teacher, student ≠ teacher) pairs per image), then
  neuron score = mean_D (G_fc1 row)², head score = mean_(hd, D) (G_V rows)².
- Per-block soft floors: the top int(H·min_head_keep) heads and int(hidden·min_neuron_keep) neurons of each
  block (by scaled score) get score finfo.max, so they are pruned last.
- Cut: heads and neurons in separate ascending orders; prune the first int(N_kind·r) of each, with
  r_m = s + 0.05, r_h = s − 0.10 for s ≥ 0.1 (r_h = 0, r_m = 1.5 s below) when both kinds are in scope, r = s
  when only one is. Both orders are fixed, counts grow with s: masks are nested.
- Fitness: mean over the fitness sparsities of the mean cosine of final embeddings (PCA with ``pca_dim``
  centred components; raw and uncentred when pca_dim ≥ D); xNES budget ``evaluations``; result = the best
  sample ever evaluated.
"""
from __future__ import annotations

import math
from typing import Any, Mapping

import torch
import torch.nn as nn
import torch.nn.functional as F

from tasks.pruning.xnes import xnes

MAX = torch.finfo(torch.float64).max


def ratios(s: float, kinds: set[str]) -> tuple[float, float]:
    """(r_m, r_h) for weight sparsity s (MLP ratio 4: s = ⅔ r_m + ⅓ r_h)."""
    if kinds != {"head", "neuron"}:
        return s, s
    if s >= 0.1:
        return min(1.0, s + 0.05), s - 0.10
    return 1.5 * s, 0.0


def search_index(layout) -> tuple[torch.Tensor, torch.Tensor]:
    """Per unit (U,): its coordinate in x; and m0 (d,). MLP coordinates first (one per neuron group), then one
    per head, in group order; block b of n_blocks starts at linspace(1.2, 0.8)[b]."""
    blocks = list(dict.fromkeys(g.block for g in layout.groups))
    start = torch.linspace(1.2, 0.8, len(blocks), dtype=torch.float64)
    mlp = [g for g in layout.groups if g.kind == "neuron"]
    coord, m0, nxt = [], [start[blocks.index(g.block)] for g in mlp], len(mlp)
    mlp_pos = {g.block: i for i, g in enumerate(mlp)}
    for g in layout.groups:
        if g.kind == "neuron":
            coord.append(torch.full((g.n,), mlp_pos[g.block], dtype=torch.int64))
        else:
            coord.append(torch.arange(nxt, nxt + g.n))
            m0 += [start[blocks.index(g.block)]] * g.n
            nxt += g.n
    return torch.cat(coord), torch.stack(m0) if m0 else torch.zeros(0, dtype=torch.float64)


def floored_scores(x: torch.Tensor, sens: torch.Tensor, layout, coord: torch.Tensor, min_head: float,
                   min_neuron: float) -> torch.Tensor:
    """(U,) scores |x|·s with each block's protected top-k set to finfo.max (the authors' soft floors)."""
    scores = x.abs()[coord] * sens  # (U,)
    start = 0
    for g in layout.groups:
        k = int(g.n * (min_head if g.kind == "head" else min_neuron))
        if k > 0:
            seg = scores[start : start + g.n]
            top = torch.topk(seg, k, sorted=False).indices
            seg[top] = MAX
        start += g.n
    return scores


def keep_from_scores(scores: torch.Tensor, layout, sparsity: float) -> torch.Tensor:
    """(U,) bool keep: per kind, prune the int(N_kind·r_kind) lowest scores (stable ties by unit index)."""
    kind = torch.cat([torch.full((g.n,), g.kind == "head", dtype=torch.bool) for g in layout.groups])  # True = head
    kinds = {g.kind for g in layout.groups}
    r_m, r_h = ratios(sparsity, kinds)
    keep = torch.ones(len(scores), dtype=torch.bool)
    for is_head, r in ((True, r_h), (False, r_m)):
        idx = (kind == is_head).nonzero().flatten()
        k = int(len(idx) * r + 1e-9)
        order = idx[torch.argsort(scores[idx], stable=True)]
        keep[order[:k]] = False
    return keep


def _crop(img: torch.Tensor, gen: torch.Generator, scale: tuple[float, float]) -> torch.Tensor:
    """torchvision-style RandomResizedCrop (ratio 3/4..4/3) of one (C, H, W) image back to (C, H, W)."""
    _, h, w = img.shape
    area = h * w
    for _ in range(10):
        a = area * (scale[0] + (scale[1] - scale[0]) * float(torch.rand((), generator=gen)))
        ratio = math.exp(math.log(3 / 4) + (math.log(4 / 3) - math.log(3 / 4)) * float(torch.rand((), generator=gen)))
        cw, ch = round(math.sqrt(a * ratio)), round(math.sqrt(a / ratio))
        if 0 < cw <= w and 0 < ch <= h:
            y = int(torch.randint(0, h - ch + 1, (), generator=gen))
            x = int(torch.randint(0, w - cw + 1, (), generator=gen))
            break
    else:
        ch, cw, y, x = h, w, 0, 0
    return F.interpolate(img[None, :, y : y + ch, x : x + cw], size=(h, w), mode="bilinear", align_corners=False)[0]


def multicrop(images: torch.Tensor, gen: torch.Generator, n_global: int, n_local: int) -> torch.Tensor:
    """(N, C, H, W) -> (V, N, C, H, W) views: n_global crops at scale (0.25, 1), then n_local at (0.05, 0.25)."""
    views = [[_crop(im, gen, (0.25, 1.0) if v < n_global else (0.05, 0.25)) for im in images]
             for v in range(n_global + n_local)]
    return torch.stack([torch.stack(v) for v in views])


def multicrop_dino_loss(student: torch.Tensor, teacher: torch.Tensor) -> torch.Tensor:
    """student (V, B, D), teacher (G, B, D) L2-normalised; τ = 1, no centre. Mean over images of
    Σ_t Σ_(s ≠ t) −⟨softmax(teacher_t), log_softmax(student_s)⟩."""
    p_t = F.softmax(teacher, dim=-1)  # (G, B, D)
    logp = F.log_softmax(student, dim=-1)  # (V, B, D)
    ce = -torch.einsum("gbd,vbd->gvb", p_t, logp)  # (G, V, B)
    g = torch.arange(teacher.shape[0])
    ce[g, g] = 0.0  # skip the same view
    return ce.sum((0, 1)).mean()


def accumulated_sensitivity(model: nn.Module, layout, images: torch.Tensor, settings: Mapping[str, Any],
                            seed: int, embed) -> torch.Tensor:
    """(U,) float64 unit scores from the gradient accumulated over all batches (then squared)."""
    params = dict(model.named_parameters())
    names = sorted({n for g in layout.groups for p, n in g.weights if p in ("fc1", "qkv")})
    flags = {n: p.requires_grad for n, p in params.items()}
    was = model.training
    model.eval()
    dev = params[names[0]].device
    gen = torch.Generator().manual_seed(seed)
    acc = {n: torch.zeros_like(params[n], dtype=torch.float64) for n in names}
    ng, nl, gb = int(settings["global_crops"]), int(settings["local_crops"]), int(settings["grad_batch"])
    try:
        for p in params.values():
            p.requires_grad_(False)
        for n in names:
            params[n].requires_grad_(True)
        for i in range(0, len(images), gb):
            views = multicrop(images[i : i + gb].cpu(), gen, ng, nl).to(dev)  # (V, b, C, H, W)
            v, b = views.shape[:2]
            flat = views.flatten(0, 1)  # (V·b, C, H, W)
            with torch.no_grad():
                teacher = F.normalize(embed(model, flat[: ng * b]), dim=-1).view(ng, b, -1)
            student = F.normalize(embed(model, flat, grad=True), dim=-1).view(v, b, -1)
            grads = torch.autograd.grad(multicrop_dino_loss(student, teacher), [params[n] for n in names])
            for n, g in zip(names, grads):
                acc[n] += g.detach().double()
    finally:
        for n, p in params.items():
            p.requires_grad_(flags[n])
        model.train(was)
    out = []
    for g in layout.groups:
        part, name = g.weights[0]
        if g.kind == "neuron":  # fc1 rows (hidden, D)
            out.append((acc[name] ** 2).mean(1).cpu())
        else:  # V rows of qkv (3D, D) -> (H, hd, D)
            out.append((acc[name].view(3, g.n, g.head_dim, -1)[2] ** 2).mean((1, 2)).cpu())
    return torch.cat(out)


def authors_ranking(model: nn.Module, layout, images: torch.Tensor, settings: Mapping[str, Any], seed: int,
                    fitness_of_keep, embed) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, float, list[float]]:
    """(scores (U,), sensitivity (U,), x (d,), fitness, history). ``fitness_of_keep(keep_fn)`` = mean embedding
    cosine over the fitness sparsities, with keep_fn(s) -> (U,) bool."""
    sens = accumulated_sensitivity(model, layout, images, settings, seed, embed)
    coord, m0 = search_index(layout)
    lo, ln_ = float(settings["min_head_keep"]), float(settings["min_neuron_keep"])

    def fit(x: torch.Tensor) -> float:
        sc = floored_scores(x, sens, layout, coord, lo, ln_)
        return fitness_of_keep(lambda s: keep_from_scores(sc, layout, s))

    res = xnes(fit, m0, 1.0, popsize=settings["popsize"], seed=seed, evaluations=int(settings["evaluations"]))
    x = res.best_x  # the best sample ever evaluated (the start mean is never evaluated)
    return floored_scores(x, sens, layout, coord, lo, ln_), sens, x.abs(), res.best_f, res.history
