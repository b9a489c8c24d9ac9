"""The healing budget a grid's claims hold within, for the report's first screen: every band and lead is "within
N optimizer steps per trial" (the search's length cap, the declared budget), not a property of the method alone."""
from __future__ import annotations

import math

import pandas as pd


PRECISION_WORDS = {"tf32": "TF32 matrix products", "bf16": "bf16 autocast"}


def precision_note(gb: pd.DataFrame) -> str:
    """'Healed in bf16 autocast (heal.precision; the authors heal in fp32).' when any winner of ``gb`` healed in a
    precision other than fp32 (the precision moves a few cells by more than the cross-machine tolerance:
    docs/gpu.md), else ''."""
    used = sorted({str(p) for p in gb.get("precision", pd.Series(dtype=object)).dropna()} - {"fp32"})
    if not used:
        return ""
    return f"Healed in {' and '.join(PRECISION_WORDS.get(p, p) for p in used)} (heal.precision; the authors heal in fp32)."


def budget_line(gb: pd.DataFrame, bounds: dict | None, trials: pd.DataFrame | None = None) -> str:
    """'Budget: bands and leads hold within 64 optimizer steps per trial (search.steps 4–64; lr 0.0001–0.01).'
    for one grid's winners ``gb`` and its search bounds ({"lr", "steps" | "epochs"}), followed by the precision
    note when the winners did not heal in fp32; '' when neither is known. ``trials``: the grid's trials: a box
    its trials went past (a widening round, ``refine --widen``, a converging search) is the budget, named so."""
    return " ".join(x for x in (_budget(gb, bounds, searched_bounds(bounds, trials)), precision_note(gb)) if x)


def searched_bounds(bounds: dict | None, trials: pd.DataFrame | None) -> dict | None:
    """``bounds`` stretched to the lr and training length the grid's gradient trials ran (lr > 0)."""
    if not bounds or trials is None or "lr" not in trials.columns:
        return bounds
    g = trials[pd.to_numeric(trials["lr"], errors="coerce") > 0]
    if "status" in g.columns:  # what finished trials ran (a failed one's length was never healed through)
        g = g[g["status"] == "FINISHED"]
    out = {k: list(v) if v else v for k, v in bounds.items()}
    key = "steps" if bounds.get("steps") else "epochs"
    for k, cast, tol in (("lr", float, 1e-5), (key, int, 0.0)):  # lr: the lattice's 6 significant figures
        v = pd.to_numeric(g[k], errors="coerce").dropna() if k in g.columns else pd.Series(dtype=float)
        if out.get(k) and len(v):
            lo, hi = cast(v.min()), cast(v.max())
            out[k] = [lo if lo < out[k][0] * (1 - tol) else out[k][0], hi if hi > out[k][1] * (1 + tol) else out[k][1]]
    return out


def _budget(gb: pd.DataFrame, declared: dict | None, bounds: dict | None) -> str:
    if not bounds:
        return ""
    key = "steps" if bounds.get("steps") else "epochs"
    lo, hi = bounds.get(key) or (None, None)
    if hi is None:
        return ""
    lr = bounds.get("lr") or [math.nan, math.nan]
    box = f"search.{key} {lo}–{hi}; lr {lr[0]:.2g}–{lr[1]:.2g}"
    if bounds != declared:  # the trials went past the spec's box: what they ran is the budget
        d = declared.get("lr") or [math.nan, math.nan]
        box = (f"searched {key} {lo}–{hi}, lr {lr[0]:.2g}–{lr[1]:.2g}: past the spec's search.{key} "
               f"{declared[key][0]}–{declared[key][1]}, lr {d[0]:.2g}–{d[1]:.2g}")
    if key == "steps":
        return f"Budget: bands and leads hold within {hi} optimizer step{'s' if hi != 1 else ''} per trial ({box})."
    g = gb[gb["calib_size"].notna()] if "calib_size" in gb.columns else gb.iloc[:0]
    sizes = sorted({(int(n), int(b) if pd.notna(b) else 32)
                    for n, b in zip(g["calib_size"], g.get("batch_size", pd.Series(32, index=g.index)))})
    per = {n: hi * math.ceil(n / b) for n, b in sizes}
    steps = ", ".join(f"{per[n]} optimizer step{'s' if per[n] != 1 else ''} at {n} images" for n, _ in sizes)
    return (f"Budget: bands and leads hold within {hi} epoch{'s' if hi != 1 else ''} per trial"
            + (f" ({steps}, batch {sizes[0][1]})" if steps else "") + f" ({box}).")
