"""CORP closed-form compensation as the healer ``corp`` (the CORP paper §3.3-3.4, docs/methods.md#corp): no gradients.

Statistics come from the *dense* model on the calibration images (paper Alg. 1: one pass, then compensate every
module independently), gathered through tasks.stats in float64. MLP: ridge/OAS affine prediction of the removed
hidden units from the kept ones, folded into fc2's kept columns and bias. Q/K: per head, the Sylvester ridge
solve on the Q/K Grams, folded into the kept q/k rows *and their biases* (see tasks.healing.corp_math). Masked entries
stay exactly 0; the only entries outside the prunable weights it changes are fc2 biases and the q/k entries of
the kept dims of the qkv bias (``may_change``).
"""
from __future__ import annotations

import time

import torch

import tasks.healing.corp_math as corp_math
from tasks.healing.base import HEALERS, HealConfig, HealContext, Healer, HealResult
from tasks.models.adapter import get_adapter
from tasks.models.params import bias_name
from tasks.pruning.corp import scope_parts, unit_stats, vit_blocks


@HEALERS.register("corp")
class CORPHealer(Healer):
    """Closed-form CORP compensation (no gradients) from dense calibration statistics.

    Settings (docs/methods.md#corp): ``lambda`` ('authors' default: the authors' code, λ = max(lambda_floor,
    ρ_Chen(Σ_SS)·tr(Σ_SS)/|S|) on the kept units, n = tokens; 'oas': the project's earlier scikit-learn OAS on
    the full covariance; a float: fixed absolute λ), ``lambda_floor`` (1e-3), ``qk_ridge`` (relative Q/K ridge
    used with 'oas', default 1e-3), ``qk_symmetrize`` (true: the authors' sym(I + M) before the SVD)."""

    requires_pruner = "corp"  # the only masks it can compensate (check_cell; the conformance suite reads it)
    trains = False  # no lr/epochs: a sweep needs one trial per cell
    uses_calibration = True  # dense statistics on the calibration images
    settings_schema = {"lambda": object, "lambda_floor": float, "qk_ridge": float, "qk_symmetrize": (True, False)}

    def check(self, settings):
        super().check(settings)
        for k in ("lambda_floor", "qk_ridge"):
            v = settings.get(k, 0.0)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0:
                raise ValueError(f"healer 'corp' setting {k!r} must be a number >= 0, got {v!r}")
        lam = settings.get("lambda", "authors")
        if lam not in ("authors", "oas") and (isinstance(lam, (bool, str)) or not isinstance(lam, (int, float))
                                               or not 0 <= lam < float("inf")):
            raise ValueError(f"healer 'corp' setting 'lambda' must be 'authors', 'oas' or a number >= 0, got {lam!r}")

    def resolved_settings(self, settings):
        lam = settings.get("lambda", "authors")
        return {"lambda": lam if isinstance(lam, str) else float(lam),
                "lambda_floor": float(settings.get("lambda_floor", 1e-3)),
                "qk_ridge": float(settings.get("qk_ridge", 1e-3)),
                "qk_symmetrize": bool(settings.get("qk_symmetrize", True))}

    def check_cell(self, model, adapter, pruner, pruner_settings, settings):
        if pruner != self.requires_pruner:
            raise ValueError(f"healer 'corp' compensates structured units of pruner 'corp' masks; pruner {pruner!r} "
                             f"does not produce them")
        if not {"fc1", "fc2", "qkv"} <= set(getattr(adapter, "parts", {})):
            raise ValueError(f"healer 'corp' needs a ViT; a {adapter.family} has no MLP hidden units or Q/K dims")

    def may_change(self, model, entries, settings=None):
        names = set(model.state_dict())
        out = set()
        for blk in vit_blocks(model, get_adapter(model)):
            mlp, qk = scope_parts(entries, blk)
            if mlp:
                out.add(bias_name(blk.fc2))  # b~ = b + W_P c
            if qk:
                out.add(bias_name(blk.qkv))  # q/k biases of kept dims are rotated with their weights
        return out & names

    @torch.no_grad()
    def heal(self, ctx: HealContext, cfg: HealConfig, on_epoch=None) -> HealResult:
        t0 = time.perf_counter()
        if ctx.dense_model is None:
            raise ValueError("healer 'corp' needs the dense model (HealContext.dense_model)")
        s = self.resolved_settings(cfg.settings)
        dense = ctx.dense_model()
        adapter = get_adapter(ctx.model)
        blocks = vit_blocks(dense, adapter)
        stats = unit_stats(dense, blocks, ctx.entries, ctx.images, full=True)
        dp, mp = dict(dense.named_parameters()), dict(ctx.model.named_parameters())
        for blk in blocks:
            mlp, qk = scope_parts(ctx.entries, blk)
            if mlp:
                self._fold_mlp(blk, stats[f"{blk.name}/hidden"], ctx.masks[blk.fc1].any(dim=1), dp, mp, s)
            if qk:
                q_mean = _q_means(blk, stats[f"{blk.name}/qkv_in"].mean, dp)  # (H, dh)
                self._fold_qk(blk, stats[f"{blk.name}/qkv"], ctx.masks[blk.qkv][: blk.dim].any(dim=1), mp, s, q_mean)
        return HealResult([], time.perf_counter() - t0, 0)  # closed form: no epochs to report

    @staticmethod
    def _fold_mlp(blk, st, keep, dp, mp, s) -> None:
        cov = st.cov  # (H, H) centered
        lam = _mlp_lambda(cov, keep.cpu(), st.count, s)
        b, c = corp_math.affine_predictor(st.mean, cov, keep.cpu(), lam)
        w2 = dp[blk.fc2].detach().cpu()  # dense fc2 (D, H): W_P is the part the pruned model lost
        b2 = dp[bias_name(blk.fc2)].detach().cpu() if bias_name(blk.fc2) in dp else torch.zeros(w2.shape[0])
        ws, bias = corp_math.fold_mlp(w2, b2, keep.cpu(), b, c)
        tgt = mp[blk.fc2]
        tgt[:, keep.to(tgt.device)] = ws.to(tgt.device, tgt.dtype)
        if bias_name(blk.fc2) in mp:
            mp[bias_name(blk.fc2)].copy_(bias.to(tgt.device, tgt.dtype))

    @staticmethod
    def _fold_qk(blk, st, keep, mp, s, q_mean) -> None:
        d, h, dh = blk.dim, blk.num_heads, blk.head_dim
        w = mp[blk.qkv]  # (3D, D)
        bias = mp.get(bias_name(blk.qkv))  # (3D,)
        keep = keep.cpu().view(h, dh)
        for i in range(h):
            lam = _qk_lambda(st.gram_q[i], q_mean[i], keep[i], st.tokens, s)  # mean-Gram units (None: relative)
            u, v = corp_math.qk_compensation(st.gram_q[i], st.gram_k[i], keep[i], s["qk_ridge"], lam=lam,
                                             symmetrize=s["qk_symmetrize"])  # (k, k) each
            rows = keep[i].nonzero().flatten() + i * dh
            for off, m in ((0, u), (d, v)):  # q rows, then k rows: W_S <- M^T W_S, b_S <- M^T b_S
                r = (rows + off).to(w.device)
                w[r] = (m.T @ w[r].double().cpu()).to(w.device, w.dtype)
                if bias is not None:
                    bias[r] = (m.T @ bias[r].double().cpu()).to(w.device, w.dtype)


def _mlp_lambda(cov: torch.Tensor, keep: torch.Tensor, n: int, s) -> float:
    """Ridge λ of the fc2 fold (docs/methods.md#corp). cov (H, H) centred, keep (H,) bool."""
    if s["lambda"] == "oas":
        return corp_math.oas_ridge(cov, n)
    if s["lambda"] == "authors":
        idx = keep.nonzero().flatten()
        return corp_math.authors_lambda(cov.double()[idx][:, idx], n, s["lambda_floor"])
    return float(s["lambda"])


def _q_means(blk, x_mean: torch.Tensor, dp) -> torch.Tensor:
    """E[q] per head (H, dh) from the mean attention input x_mean (D,): W_q E[x] + b_q."""
    w = dp[blk.qkv].detach().double().cpu()[: blk.dim]  # (D, D) q rows
    b = dp.get(bias_name(blk.qkv))
    mu = w @ x_mean.double().cpu() + (b.detach().double().cpu()[: blk.dim] if b is not None else 0.0)
    return mu.view(blk.num_heads, blk.head_dim)


def _qk_lambda(gram_q: torch.Tensor, q_mean: torch.Tensor, keep: torch.Tensor, n: int, s) -> float | None:
    """λ of one head's Sylvester solve in mean-Gram units: the authors' λ (Q-side centred Σ_SS, n = tokens,
    solved with sum-Grams) divided by n²; a fixed float likewise; None = the earlier relative ``qk_ridge``."""
    if s["lambda"] == "oas":
        return None
    if s["lambda"] == "authors":
        idx = keep.nonzero().flatten()
        g, mu = gram_q.double()[idx][:, idx], q_mean.double()[idx]
        lam = corp_math.authors_lambda(g - torch.outer(mu, mu), n, s["lambda_floor"])  # (k, k) centred Σ_SS
    else:
        lam = float(s["lambda"])
    return lam / float(n) ** 2
