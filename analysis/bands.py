"""Repairability bands from sweep results (docs/methods.md#calibration-transition-score-and-bands), and their
agreement with the CTS core/band.

Per model × pruner × healer (× calibration size, scope, granularity when they vary), the best trial
of every cell is taken (``runs.best_per_cell``, chosen by the sweep's objective), then averaged over
seeds at each nominal sparsity (N:M patterns are left out: they are not on the sparsity axis).
Each sparsity point is classified on the seed means:

- **collapse**: healed accuracy ≤ p + z·sqrt(p(1 − p)/n), p = 1/num_classes (chance), n = n_eval (the
  evaluation set size; binomial standard error of an at-chance classifier, z = 2 by default). The seeds
  share one evaluation set, so n is not multiplied by the number of seeds. Checked first.
- **recoverable**: mean retention (healed / dense) ≥ ``retention`` (0.9).
- **transition**: otherwise.

Intervals are maximal runs of consecutive sweep sparsities with one class. Agreement with the
calibration-only CTS core/band is the interval IoU, after widening every interval by half a
resolution step on each side (so one-point intervals have a width); ``coverage`` is the fraction of the
CTS interval inside the accuracy transition hull.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import numpy as np
import pandas as pd

from .runs import grid_names, is_nm

__all__ = ["BandSettings", "chance_limit", "classify", "seed_means", "bands", "intervals", "iou",
           "agreement", "GROUP_COLS"]

GROUP_COLS = ("model", "grid", "pruner", "healer", "calib_size", "scope", "granularity")
LABELS = ("recoverable", "transition", "collapse")


@dataclass(frozen=True)
class BandSettings:
    retention: float = 0.9
    z: float = 2.0
    resolution: float = 0.005  # interval widening for IoU (half on each side)

    def to_dict(self) -> dict:
        return asdict(self)


def chance_limit(num_classes: float, n_eval: float, z: float) -> float:
    """p + z·sqrt(p(1−p)/n) with p = 1/num_classes; NaN when either is unknown."""
    if not (num_classes and n_eval) or any(map(math.isnan, (float(num_classes), float(n_eval)))):
        return math.nan
    p = 1.0 / float(num_classes)
    return p + z * math.sqrt(p * (1 - p) / float(n_eval))


def classify(healed_acc: float, retention: float, limit: float, st: BandSettings) -> str:
    if not math.isnan(limit) and healed_acc <= limit:
        return "collapse"
    return "recoverable" if retention >= st.retention else "transition"


def class_resolved(healed: float, dense: float, limit: float, noise: float, st: BandSettings) -> bool:
    """The band class is resolved when the quoted accuracy is more than ``reported.Z`` noise units from both
    class edges it could cross: the retention edge (``st.retention`` × dense) and the chance limit."""
    from .reported import Z

    if noise is None or math.isnan(noise):
        return False
    edges = [st.retention * dense] + ([] if math.isnan(limit) else [limit])
    return all(abs(healed - e) > Z * noise for e in edges)


def _point_noise(r) -> float:
    """The measured noise of a point's seed mean; without re-evaluations (``noise`` unknown), the seeds' own
    standard error when there are several seeds, else NaN (nothing resolved on one unrepeated draw)."""
    if not math.isnan(r.noise):
        return float(r.noise)
    return float(r.healed_std) / math.sqrt(r.n_seeds) if r.n_seeds > 1 else math.nan


def seed_means(best: pd.DataFrame) -> pd.DataFrame:
    """Mean/std over seeds per group × sparsity; keeps the run ids of the seeds (';'-joined)."""
    df = best[~best["pattern"].map(is_nm)].copy()
    df["grid"] = grid_names(df)  # grids are never averaged together
    for c in ("n_eval", "num_classes", "noise"):
        if c not in df.columns:
            df[c] = np.nan
    df["_noise2"] = df["noise"].astype(float) ** 2  # the mean's noise: sqrt(Σ noise²) / n (analysis/reported.py)
    keys = [*GROUP_COLS, "sparsity"]
    df[list(GROUP_COLS)] = df[list(GROUP_COLS)].astype("object").fillna("")
    g = df.groupby(keys, dropna=False, sort=True)
    out = g.agg(healed_mean=("healed_acc", "mean"), healed_std=("healed_acc", "std"),
                retention_mean=("retention", "mean"), retention_std=("retention", "std"),
                pruned_mean=("pruned_acc", "mean"), dense_mean=("dense_acc", "mean"),
                n_seeds=("run_id", "size"), n_eval=("n_eval", "min"), num_classes=("num_classes", "max"),
                noise2=("_noise2", lambda v: v.sum() if v.notna().all() else np.nan),
                run_ids=("run_id", lambda s: ";".join(map(str, s))),
                experiment_id=("experiment_id", "first")).reset_index()
    out["noise"] = np.sqrt(out.pop("noise2")) / out["n_seeds"]
    out["healed_std"] = out["healed_std"].fillna(0.0)
    out["retention_std"] = out["retention_std"].fillna(0.0)
    return out


def intervals(s: list[float], labels: list[str]) -> list[dict]:
    """Maximal runs of equal labels over ascending s -> [{"label", "lo", "hi"}]."""
    out: list[dict] = []
    for x, lab in zip(s, labels):
        if out and out[-1]["label"] == lab:
            out[-1]["hi"] = float(x)
        else:
            out.append({"label": lab, "lo": float(x), "hi": float(x)})
    return out


def iou(a: tuple[float, float] | None, b: tuple[float, float] | None, pad: float) -> float:
    """IoU of [lo − pad, hi + pad] intervals; 0 when either is missing."""
    if a is None or b is None:
        return 0.0
    a0, a1, b0, b1 = a[0] - pad, a[1] + pad, b[0] - pad, b[1] + pad
    inter = max(0.0, min(a1, b1) - max(a0, b0))
    union = (a1 - a0) + (b1 - b0) - inter
    return inter / union if union > 0 else 0.0


def _coverage(cts: tuple[float, float] | None, hull: tuple[float, float] | None, pad: float) -> float:
    if cts is None or hull is None:
        return 0.0
    a0, a1, b0, b1 = cts[0] - pad, cts[1] + pad, hull[0] - pad, hull[1] + pad
    return max(0.0, min(a1, b1) - max(a0, b0)) / (a1 - a0)


def agreement(transition_hull: tuple[float, float] | None, cts_result: dict | None,
              st: BandSettings) -> dict:
    """IoU and coverage of the CTS core and broad band against the accuracy transition hull; None (n/a) where
    the CTS has no such interval (no diagnostics, or CTS̄ never rises above its baseline)."""
    out = {}
    for key in ("core", "band"):
        iv = (cts_result or {}).get(key)
        if not iv:  # no CTS (or no core/band): nothing to agree with -> n/a, not 0
            out[f"{key}_iou"] = out[f"{key}_coverage"] = None
            continue
        iv = (iv["lo"], iv["hi"])
        out[f"{key}_iou"] = iou(iv, transition_hull, st.resolution / 2)
        out[f"{key}_coverage"] = _coverage(iv, transition_hull, st.resolution / 2)
    return out


def bands(best: pd.DataFrame, cts: dict[str, dict] | None = None,
          st: BandSettings = BandSettings()) -> list[dict]:
    """One record per group: points (seed means + class), intervals, transition hull, agreement."""
    means = seed_means(best)
    out = []
    for key, g in means.groupby(list(GROUP_COLS), dropna=False, sort=True):
        g = g.sort_values("sparsity")
        points, labels = [], []
        for r in g.itertuples(index=False):
            lim = chance_limit(r.num_classes, r.n_eval, st.z)
            lab = classify(float(r.healed_mean), float(r.retention_mean), lim, st)
            labels.append(lab)
            points.append({"sparsity": float(r.sparsity), "label": lab,
                           "healed_mean": float(r.healed_mean), "healed_std": float(r.healed_std),
                           "retention_mean": float(r.retention_mean),
                           "retention_std": float(r.retention_std), "n_seeds": int(r.n_seeds),
                           "noise": None if math.isnan(r.noise) else float(r.noise),
                           "resolved": class_resolved(float(r.healed_mean), float(r.dense_mean), lim,
                                                      _point_noise(r), st),
                           "chance_limit": None if math.isnan(lim) else lim,
                           "run_ids": r.run_ids.split(";"), "experiment_id": str(r.experiment_id)})
        trans = [p["sparsity"] for p in points if p["label"] == "transition"]
        hull = (min(trans), max(trans)) if trans else None
        rec = dict(zip(GROUP_COLS, (str(k) for k in key)))
        rec.update(points=points, intervals=intervals([p["sparsity"] for p in points], labels),
                   transition=None if hull is None else {"lo": hull[0], "hi": hull[1]},
                   agreement=agreement(hull, (cts or {}).get(rec["model"]), st))
        out.append(rec)
    return out
