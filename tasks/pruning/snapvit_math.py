"""SnapViT elastic structured ranking (docs/methods.md#snapvit, the SnapViT paper): units, local sensitivity, xNES, one total order.

Units are the attention heads and MLP hidden neurons of every ViT block. A head removes its q, k and v rows
of the fused qkv weight (and bias) and its columns of the attention projection; a neuron removes its fc1
row (and bias entry) and its fc2 column. Output biases (proj, fc2) are not per-unit and stay.

Units are grouped per block part: one group for the heads and one for the neurons of each block (B = 2 x depth
groups for the full scope; B = depth when the scope holds only attention or only MLP).

1. Local sensitivity (label-free). Loss: the DINO objective the paper adopts, on the model's own final
   embedding z (the classifier's input, L2-normalized; no projection head, so models without a classifier
   work too): the teacher is the frozen model on the clean image ("global view"), the student is the same
   model on a random resized crop ("local view", side 60-90 %, resized back); L_i = CE(softmax((z_t - c) /
   tau_t), log_softmax(z_s / tau_s)), tau_t = 0.04, tau_s = 0.1, centre c = mean teacher embedding over the
   calibration set. Diagonal Hessian ~ squared gradients: F = mean over micro-batches of grad(L)^2
   (micro-batch 1 = per-sample, the default). Saliency of a weight = F w^2 (OBD's 1/2 H w^2 up to the
   constant), summed over the unit's weights and biases and divided by the unit's weight count (saliency per
   removed weight; inside a group every unit has the same size, so this only sets where xNES starts).
2. Global: xNES (tasks/pruning/xnes.py) over z in R^B, block weights c = exp(z) (log-space keeps weights positive:
   a negative weight would invert a block's order; m0 = 0, Sigma0 = sigma0^2 I as in the paper's m<-0, S<-I).
   Unit score = c_group * s_unit. Fitness of z = mean over the fitness sparsities (default 0.1, 0.25, 0.4,
   0.6) of the mean cosine similarity between PCA-projected final embeddings of the dense and the pruned model
   (PCA fitted on the dense embeddings, min(192, D, N) components), on the first ``fitness_images``
   calibration images. The final weights are exp(m) unless the best sample seen scored higher.
3. Output: the units sorted by final score (ascending, ties by unit index) = the pruning order. Sparsity s
   is a prefix of it: the prefix whose removed weights are closest to s x (prunable weights of the scope),
   which is exactly ``achieved_sparsity`` over the masks (biases do not count). Prefixes of one order are
   nested for increasing s.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Mapping

import torch
import torch.nn as nn
import torch.nn.functional as F

from tasks.catalog import SNAPVIT_VARIANTS, check_snapvit
from tasks.models.adapter import ModelAdapter, ScopeEntry
from tasks.models.params import bias_name
from tasks.pruning.snapvit_authors import authors_ranking
from tasks.pruning.xnes import xnes

DEFAULTS: dict[str, Any] = {"variant": "authors", "evaluations": 50, "min_head_keep": 0.2, "min_neuron_keep": 0.05,
                            "global_crops": 2, "local_crops": 10,
                            "iterations": 50, "popsize": 0, "sigma0": 1.0, "pca_dim": 192, "fitness_images": 128,
                            "fitness_sparsities": [0.1, 0.25, 0.4, 0.6], "grad_batch": None, "tau_t": 0.04,
                            "tau_s": 0.1}
VARIANTS = SNAPVIT_VARIANTS  # ("authors", "joint"); authors: snapvit_authors.py; joint: this module (the project's earlier method)


@dataclass(frozen=True)
class Group:
    """All units of one kind in one block. ``weights``/``biases``: part -> parameter name."""

    block: str
    kind: str  # "head" | "neuron"
    n: int  # units in the group
    unit_params: int  # prunable weights one unit removes (biases excluded: sparsity counts weights)
    head_dim: int  # for heads; 0 for neurons
    weights: tuple[tuple[str, str], ...]  # (("qkv", name), ("proj", name)) or (("fc1", ..), ("fc2", ..))
    biases: tuple[tuple[str, str], ...]  # (("qkv", name),) or (("fc1", name),) where the model has them


@dataclass(frozen=True)
class Layout:
    groups: tuple[Group, ...]

    @property
    def n_units(self) -> int:
        return sum(g.n for g in self.groups)

    def unit_params(self) -> torch.Tensor:
        return torch.cat([torch.full((g.n,), g.unit_params, dtype=torch.int64) for g in self.groups])  # (U,)

    def group_index(self) -> torch.Tensor:
        return torch.cat([torch.full((g.n,), i, dtype=torch.int64) for i, g in enumerate(self.groups)])  # (U,)

    def describe(self) -> list[list]:
        return [[g.block, g.kind, g.n, g.unit_params] for g in self.groups]


def _num_heads(block: nn.Module) -> int:
    for mod in block.modules():
        if isinstance(getattr(mod, "num_heads", None), int):
            return mod.num_heads
    raise ValueError("block has no attention module with num_heads")


def vit_layout(model: nn.Module, adapter: ModelAdapter, entries: list[ScopeEntry]) -> Layout:
    """Units of a ViT scope; ValueError (saying why) when the scope cannot be cut into whole heads/neurons."""
    parts = getattr(adapter, "parts", None)
    if not parts or not {"qkv", "proj", "fc1", "fc2"} <= set(parts):
        raise ValueError("SnapViT needs a Vision Transformer (heads and MLP neurons); this model has neither")
    if any(e.rows is not None for e in entries):
        raise ValueError("scope holds row ranges (qk); SnapViT removes whole heads, including their V rows: "
                         "use scope qkv_out_mlp, qkv_out or mlp")
    params = dict(model.named_parameters())
    scoped = {e.param for e in entries}
    groups = []
    for bname, block in adapter.blocks(model):
        name = {p: f"{bname}.{parts[p]}" for p in ("qkv", "proj", "fc1", "fc2")}
        has = {p for p, n in name.items() if n in scoped}
        if has not in ({"qkv", "proj"}, {"fc1", "fc2"}, {"qkv", "proj", "fc1", "fc2"}):
            raise ValueError(f"scope covers {sorted(has)} of block {bname}; SnapViT needs qkv with proj (heads) "
                             "and/or fc1 with fc2 (neurons): use scope qkv_out_mlp, qkv_out or mlp")
        dim = params[name["proj"]].shape[0]
        if "qkv" in has:
            h = _num_heads(block)
            hd = params[name["qkv"]].shape[0] // 3 // h
            b = bias_name(name["qkv"])
            groups.append(Group(bname, "head", h, 4 * hd * dim, hd, (("qkv", name["qkv"]), ("proj", name["proj"])),
                                (("qkv", b),) if b in params else ()))
        if "fc1" in has:
            hidden = params[name["fc1"]].shape[0]
            b = bias_name(name["fc1"])
            groups.append(Group(bname, "neuron", hidden, 2 * dim, 0, (("fc1", name["fc1"]), ("fc2", name["fc2"])),
                                (("fc1", b),) if b in params else ()))
    return Layout(tuple(groups))


# --- unit <-> parameter maps ------------------------------------------------------------------------

def _per_unit(g: Group, part: str, t: torch.Tensor) -> torch.Tensor:
    """Sum a parameter-shaped tensor into (g.n,) per-unit totals."""
    if part == "qkv":  # (3D, D) rows [q; k; v], heads contiguous inside each -> (3, H, hd, ...)
        return t.reshape(3, g.n, g.head_dim, -1).sum(dim=(0, 2, 3))
    if part == "proj":  # (D, D) columns head-major
        return t.reshape(t.shape[0], g.n, g.head_dim).sum(dim=(0, 2))
    if part == "fc1":  # (hidden, D) rows, or (hidden,) bias
        return t.reshape(g.n, -1).sum(dim=1)
    return t.sum(dim=0)  # fc2: (D, hidden) columns


def _unit_mask(g: Group, part: str, keep: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """(g.n,) bool keep -> bool mask of a parameter's ``shape``."""
    if part == "qkv":
        m = keep.view(1, g.n, 1).expand(3, g.n, g.head_dim).reshape(-1)  # (3D,)
        return m.view(-1, *([1] * (len(shape) - 1))).expand(shape).clone()
    if part == "proj":
        return keep.repeat_interleave(g.head_dim).view(1, -1).expand(shape).clone()
    if part == "fc1":
        return keep.view(-1, *([1] * (len(shape) - 1))).expand(shape).clone()
    return keep.view(1, -1).expand(shape).clone()  # fc2 columns


def unit_masks(model: nn.Module, layout: Layout, keep: torch.Tensor) -> dict[str, torch.Tensor]:
    """(U,) bool keep vector -> full-shape bool masks of every touched weight and per-unit bias."""
    params = dict(model.named_parameters())
    out, start = {}, 0
    for g in layout.groups:
        k = keep[start : start + g.n].cpu()
        for part, name in g.weights + g.biases:
            out[name] = _unit_mask(g, part, k, params[name].shape)
        start += g.n
    return out


def prefix_length(order: torch.Tensor, unit_params: torch.Tensor, sparsity: float) -> int:
    """Units of ``order`` to remove so that their weights are closest to sparsity x total (ties: fewer)."""
    cum = torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(unit_params[order], 0)])  # (U+1,)
    target = sparsity * float(cum[-1])
    i = int(torch.searchsorted(cum.to(torch.float64), torch.tensor([target], dtype=torch.float64))[0])
    if i >= len(cum):
        return len(cum) - 1
    if i > 0 and target - float(cum[i - 1]) <= float(cum[i]) - target:
        return i - 1
    return i


def keep_vector(order: torch.Tensor, unit_params: torch.Tensor, sparsity: float) -> torch.Tensor:
    keep = torch.ones(len(order), dtype=torch.bool)
    keep[order[: prefix_length(order, unit_params, sparsity)]] = False
    return keep  # (U,)


# --- embeddings, PCA fitness, SSL loss ---------------------------------------------------------------

def _head_module(model: nn.Module) -> nn.Module:
    if hasattr(model, "get_classifier"):
        return model.get_classifier()
    if hasattr(model, "heads"):
        return model.heads
    raise ValueError("cannot find the classifier module whose input is the final embedding")


def embed(model: nn.Module, images: torch.Tensor, batch_size: int = 256, grad: bool = False) -> torch.Tensor:
    """Final embeddings (N, D): the input of the classifier module (CLS / pooled, after the final norm)."""
    cap: list[torch.Tensor] = []
    handle = _head_module(model).register_forward_pre_hook(lambda _m, inp: cap.append(inp[0]))
    try:
        with torch.set_grad_enabled(grad):
            for i in range(0, len(images), batch_size):
                model(images[i : i + batch_size])
    finally:
        handle.remove()
    return torch.cat(cap)


def pca_basis(dense: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """dense: (N, D) -> (mean (D,), components (D, k')) with k' = min(k, D, N), float64."""
    x = dense.to(torch.float64)
    mu = x.mean(0)
    _, _, vt = torch.linalg.svd(x - mu, full_matrices=False)  # vt: (min(N, D), D)
    return mu, vt[: min(k, vt.shape[0])].T


def pca_cosine(dense: torch.Tensor, pruned: torch.Tensor, basis: tuple[torch.Tensor, torch.Tensor]) -> float:
    """Mean over rows of cos(PCA(dense_i), PCA(pruned_i)); (N, D) each."""
    mu, p = basis
    a = (dense.to(torch.float64) - mu) @ p  # (N, k)
    b = (pruned.to(torch.float64) - mu) @ p  # (N, k)
    return float(F.cosine_similarity(a, b, dim=1, eps=1e-12).mean())


def local_view(images: torch.Tensor, gen: torch.Generator, lo: float = 0.6, hi: float = 0.9) -> torch.Tensor:
    """Random resized crop per image (side fraction in [lo, hi]) back to the full size. (N, C, H, W)."""
    n, _, h, w = images.shape
    out = []
    for i in range(n):
        f = lo + (hi - lo) * float(torch.rand((), generator=gen))
        ch, cw = max(1, round(h * f)), max(1, round(w * f))
        y = int(torch.randint(0, h - ch + 1, (), generator=gen))
        x = int(torch.randint(0, w - cw + 1, (), generator=gen))
        crop = images[i : i + 1, :, y : y + ch, x : x + cw]
        out.append(F.interpolate(crop, size=(h, w), mode="bilinear", align_corners=False))
    return torch.cat(out)


def dino_loss(student: torch.Tensor, teacher: torch.Tensor, center: torch.Tensor, tau_s: float, tau_t: float
              ) -> torch.Tensor:
    """student, teacher: (B, D) L2-normalized embeddings; centre (D,). Mean cross-entropy (scalar)."""
    p_t = F.softmax((teacher - center) / tau_t, dim=-1)  # (B, D)
    return -(p_t * F.log_softmax(student / tau_s, dim=-1)).sum(-1).mean()


def local_sensitivity(model: nn.Module, layout: Layout, images: torch.Tensor, settings: Mapping[str, Any],
                      seed: int) -> torch.Tensor:
    """(U,) float64 saliency per unit: sum of F_ii w_i^2 over its weights and biases / unit weight count."""
    params = dict(model.named_parameters())
    names = sorted({n for g in layout.groups for _, n in g.weights + g.biases})
    flags = {n: p.requires_grad for n, p in params.items()}
    was_training = model.training
    model.eval()
    gen = torch.Generator().manual_seed(seed)
    dev = params[names[0]].device
    images = images.to(dev)
    fisher = {n: torch.zeros_like(params[n], dtype=torch.float64) for n in names}
    try:
        for p in params.values():
            p.requires_grad_(False)
        with torch.no_grad():
            teacher = F.normalize(embed(model, images), dim=-1)  # (N, D)
        center = teacher.mean(0)  # (D,)
        views = local_view(images.cpu(), gen).to(dev)  # (N, C, H, W)
        for n in names:
            params[n].requires_grad_(True)
        gb, steps = int(settings["grad_batch"]), 0
        for i in range(0, len(images), gb):
            z = F.normalize(embed(model, views[i : i + gb], grad=True), dim=-1)  # (b, D)
            loss = dino_loss(z, teacher[i : i + gb], center, settings["tau_s"], settings["tau_t"])
            grads = torch.autograd.grad(loss, [params[n] for n in names], allow_unused=True)
            for n, g in zip(names, grads):
                if g is not None:
                    fisher[n] += g.detach().to(torch.float64) ** 2
            steps += 1
    finally:
        for n, p in params.items():
            p.requires_grad_(flags[n])
        model.train(was_training)
    sal = []
    for g in layout.groups:
        tot = torch.zeros(g.n, dtype=torch.float64, device=dev)
        for part, n in g.weights + g.biases:
            tot += _per_unit(g, part, fisher[n] / steps * params[n].detach().to(torch.float64) ** 2)
        sal.append(tot.cpu() / g.unit_params)
    return torch.cat(sal)  # (U,)


# --- the global search ---------------------------------------------------------------------------------

@dataclass
class Ranking:
    order: torch.Tensor  # (U,) int64 unit indices, first = pruned first
    scores: torch.Tensor  # (U,) float64 final scores
    sensitivity: torch.Tensor  # (U,) float64 local saliency
    weights: torch.Tensor  # (B,) float64 final block-group weights c
    fitness: float  # fitness of the final weights
    history: list[float]  # best fitness per xNES generation
    layout: list[list]  # Layout.describe()


def order_from(weights: torch.Tensor, sens: torch.Tensor, group_idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    scores = weights[group_idx] * sens  # (U,)
    return torch.argsort(scores, stable=True), scores


class _Fitness:
    """Mean PCA-cosine over the fitness sparsities of the pruned copy vs the dense embeddings."""

    def __init__(self, model: nn.Module, layout: Layout, images: torch.Tensor, sens: torch.Tensor,
                 sparsities: list[float], pca_dim: int, raw_if_large: bool = False) -> None:
        self.work = copy.deepcopy(model).eval()
        self.layout, self.sens, self.sparsities = layout, sens, sparsities
        self.params = dict(self.work.named_parameters())
        self.names = sorted({n for g in layout.groups for _, n in g.weights + g.biases})
        self.dense_values = {n: self.params[n].detach().clone() for n in self.names}
        self.images = images.to(self.params[self.names[0]].device)
        self.dense = embed(self.work, self.images)  # (N, D)
        d = self.dense.shape[1]
        if raw_if_large and pca_dim >= d:  # the authors: no PCA at all, raw uncentred embeddings
            self.basis = (torch.zeros(d, dtype=torch.float64, device=self.dense.device),
                          torch.eye(d, dtype=torch.float64, device=self.dense.device))
        else:
            self.basis = pca_basis(self.dense, pca_dim)
        self.gidx, self.uparams = layout.group_index(), layout.unit_params()

    def of_order(self, order: torch.Tensor) -> float:
        return self.of_keep(lambda s: keep_vector(order, self.uparams, s))

    @torch.no_grad()
    def of_keep(self, keep_fn) -> float:
        """Mean PCA-cosine over the fitness sparsities; keep_fn(s) -> (U,) bool keep vector."""
        vals = []
        for s in self.sparsities:
            masks = unit_masks(self.work, self.layout, keep_fn(s))
            for n in self.names:
                self.params[n].copy_(self.dense_values[n] * masks[n].to(self.params[n].device))
            vals.append(pca_cosine(self.dense, embed(self.work, self.images), self.basis))
        return sum(vals) / len(vals)

    def __call__(self, z: torch.Tensor) -> float:
        return self.of_order(order_from(torch.exp(z), self.sens, self.gidx)[0])


def compute_ranking(model: nn.Module, layout: Layout, images: torch.Tensor, settings: Mapping[str, Any],
                    seed: int) -> Ranking:
    """The whole SnapViT search on calibration ``images`` (N, C, H, W); never changes ``model``."""
    if settings["variant"] == "authors":
        fit = _Fitness(model, layout, images[: settings["fitness_images"]], torch.zeros(layout.n_units),
                       list(settings["fitness_sparsities"]), settings["pca_dim"], raw_if_large=True)
        scores, sens, x, f, hist = authors_ranking(model, layout, images, settings, seed, fit.of_keep, embed)
        return Ranking(torch.argsort(scores, stable=True), scores, sens, x, f, hist, layout.describe())
    sens = local_sensitivity(model, layout, images, settings, seed)
    fit = _Fitness(model, layout, images[: settings["fitness_images"]], sens, list(settings["fitness_sparsities"]),
                   settings["pca_dim"])
    res = xnes(fit, torch.zeros(len(layout.groups), dtype=torch.float64), settings["sigma0"],
               settings["iterations"], settings["popsize"], seed=seed)
    z, f = res.mean, fit(res.mean)
    if res.best_f > f:
        z, f = res.best_x, res.best_f
    order, scores = order_from(torch.exp(z), sens, fit.gidx)
    return Ranking(order, scores, sens, torch.exp(z), f, res.history, layout.describe())


def resolve_settings(settings: Mapping[str, Any]) -> dict[str, Any]:
    out = {**DEFAULTS, **settings}
    if out["grad_batch"] is None:
        out["grad_batch"] = 16 if out["variant"] == "authors" else 1
    out["fitness_sparsities"] = [float(s) for s in out["fitness_sparsities"]]
    return out


check_settings = check_snapvit  # the rules live in the torch-free table (validate checks them without torch)
