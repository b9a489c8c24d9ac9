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


def budget_line(gb: pd.DataFrame, bounds: dict | None) -> str:
    """'Budget: bands and leads hold within 64 optimizer steps per trial (search.steps 4–64; lr 0.0001–0.01).'
    for one grid's winners ``gb`` and its search bounds ({"lr", "steps" | "epochs"}), followed by the precision
    note when the winners did not heal in fp32; '' when neither is known."""
    return " ".join(x for x in (_budget(gb, bounds), precision_note(gb)) if x)


def _budget(gb: pd.DataFrame, bounds: dict | None) -> str:
    if not bounds:
        return ""
    lr = bounds.get("lr") or [math.nan, math.nan]
    box = f"lr {lr[0]:.2g}–{lr[1]:.2g}"
    if bounds.get("steps"):
        lo, hi = bounds["steps"]
        return (f"Budget: bands and leads hold within {hi} optimizer step{'s' if hi != 1 else ''} per trial "
                f"(search.steps {lo}–{hi}; {box}).")
    lo, hi = bounds.get("epochs") or (None, None)
    if hi is None:
        return ""
    g = gb[gb["calib_size"].notna()] if "calib_size" in gb.columns else gb.iloc[:0]
    sizes = sorted({(int(n), int(b) if pd.notna(b) else 32)
                    for n, b in zip(g["calib_size"], g.get("batch_size", pd.Series(32, index=g.index)))})
    per = {n: hi * math.ceil(n / b) for n, b in sizes}
    steps = ", ".join(f"{per[n]} optimizer step{'s' if per[n] != 1 else ''} at {n} images" for n, _ in sizes)
    return (f"Budget: bands and leads hold within {hi} epoch{'s' if hi != 1 else ''} per trial"
            + (f" ({steps}, batch {sizes[0][1]})" if steps else "") + f" (search.epochs {lo}–{hi}; {box}).")
