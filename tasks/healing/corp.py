"""CORP closed-form compensation as the healer ``corp`` (the CORP paper §3.3-3.4, docs/methods.md#corp): no gradients.

Statistics come from the *dense* model on the calibration images (paper Alg. 1: one pass, then compensate every
module independently), gathered through tasks.stats in float64. MLP: ridge/OAS affine prediction of the removed
hidden units from the kept ones, folded into fc2's kept columns and bias. Q/K: per head, the Sylvester ridge
solve on the Q/K Grams, folded into the kept q/k rows *and their biases* (see tasks.corp_math). Masked entries
stay exactly 0; the only entries outside the prunable weights it changes are fc2 biases and the q/k entries of
the kept dims of the qkv bias (``may_change``).
"""
from __future__ import annotations

import time

import torch

import tasks.healing.corp_math as corp_math
from tasks.healing.base import HEALERS, HealConfig, HealContext, Healer, HealResult
from tasks.models.adapter import get_adapter
from tasks.pruning.corp import _bias_name, scope_parts, unit_stats, vit_blocks


@HEALERS.register("corp")
class CorpHealer(Healer):
    """Closed-form CORP compensation (no gradients) from dense calibration statistics.

    Settings: ``shrinkage`` ('oas' default, the authors' choice, or 'fixed'), ``ridge`` (float; with 'fixed',
    lam = ridge * mean variance of the kept hidden units), ``qk_ridge`` (float, relative, default 1e-3)."""

    requires_pruner = "corp"  # the only masks it can compensate (check_cell; the conformance suite reads it)
    trains = False  # no lr/epochs: a sweep needs one trial per cell
    settings_schema = {"shrinkage": ("oas", "fixed"), "ridge": float, "qk_ridge": float}

    def check(self, settings):
        super().check(settings)
        for k in ("ridge", "qk_ridge"):
            v = settings.get(k, 0.0)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0:
                raise ValueError(f"healer 'corp' setting {k!r} must be a number >= 0, got {v!r}")

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
                out.add(_bias_name(blk.fc2))  # b~ = b + W_P c
            if qk:
                out.add(_bias_name(blk.qkv))  # q/k biases of kept dims are rotated with their weights
        return out & names

    @torch.no_grad()
    def heal(self, ctx: HealContext, cfg: HealConfig, on_epoch=None) -> HealResult:
        t0 = time.perf_counter()
        if ctx.dense_model is None:
            raise ValueError("healer 'corp' needs the dense model (HealContext.dense_model)")
        s = cfg.settings
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
                self._fold_qk(blk, stats[f"{blk.name}/qkv"], ctx.masks[blk.qkv][: blk.dim].any(dim=1), mp,
                              float(s.get("qk_ridge", 1e-3)))
        return HealResult([], time.perf_counter() - t0, 0)  # closed form: no epochs to report

    @staticmethod
    def _fold_mlp(blk, st, keep, dp, mp, s) -> None:
        cov = st.cov  # (H, H) centered
        if s.get("shrinkage", "oas") == "oas":
            lam = corp_math.oas_ridge(cov, st.count)
        else:
            lam = float(s.get("ridge", 1e-3)) * float(cov.diagonal()[keep].mean()) if keep.any() else 0.0
        b, c = corp_math.affine_predictor(st.mean, cov, keep.cpu(), lam)
        w2 = dp[blk.fc2].detach().cpu()  # dense fc2 (D, H): W_P is the part the pruned model lost
        b2 = dp[_bias_name(blk.fc2)].detach().cpu() if _bias_name(blk.fc2) in dp else torch.zeros(w2.shape[0])
        ws, bias = corp_math.fold_mlp(w2, b2, keep.cpu(), b, c)
        tgt = mp[blk.fc2]
        tgt[:, keep.to(tgt.device)] = ws.to(tgt.device, tgt.dtype)
        if _bias_name(blk.fc2) in mp:
            mp[_bias_name(blk.fc2)].copy_(bias.to(tgt.device, tgt.dtype))

    @staticmethod
    def _fold_qk(blk, st, keep, mp, ridge) -> None:
        d, h, dh = blk.dim, blk.num_heads, blk.head_dim
        w = mp[blk.qkv]  # (3D, D)
        bias = mp.get(_bias_name(blk.qkv))  # (3D,)
        keep = keep.cpu().view(h, dh)
        for i in range(h):
            u, v = corp_math.qk_compensation(st.gram_q[i], st.gram_k[i], keep[i], ridge)  # (k, k) each
            rows = keep[i].nonzero().flatten() + i * dh
            for off, m in ((0, u), (d, v)):  # q rows, then k rows: W_S <- M^T W_S, b_S <- M^T b_S
                r = (rows + off).to(w.device)
                w[r] = (m.T @ w[r].double().cpu()).to(w.device, w.dtype)
                if bias is not None:
                    bias[r] = (m.T @ bias[r].double().cpu()).to(w.device, w.dtype)
