"""The healing budget a grid's claims hold within, for the report's first screen: every band and lead is "within
N optimizer steps per trial" (the search's length cap, the declared budget), not a property of the method alone."""
from __future__ import annotations

import math

import pandas as pd


def budget_line(gb: pd.DataFrame, bounds: dict | None) -> str:
    """'Budget: bands and leads hold within 64 optimizer steps per trial (search.steps 4–64; lr 0.0001–0.01).'
    for one grid's winners ``gb`` and its search bounds ({"lr", "steps" | "epochs"}); '' when unknown."""
    if not bounds:
        return ""
    lr = bounds.get("lr") or [math.nan, math.nan]
    box = f"lr {lr[0]:.2g}–{lr[1]:.2g}"
    if bounds.get("steps"):
        lo, hi = bounds["steps"]
        return (f"Budget: bands and leads hold within {hi} optimizer steps per trial (search.steps {lo}–{hi}; "
                f"{box}).")
    lo, hi = bounds.get("epochs") or (None, None)
    if hi is None:
        return ""
    g = gb[gb["calib_size"].notna()] if "calib_size" in gb.columns else gb.iloc[:0]
    sizes = sorted({(int(n), int(b) if pd.notna(b) else 32)
                    for n, b in zip(g["calib_size"], g.get("batch_size", pd.Series(32, index=g.index)))})
    steps = ", ".join(f"{hi * math.ceil(n / b)} optimizer steps at {n} images" for n, b in sizes)
    return (f"Budget: bands and leads hold within {hi} epochs per trial"
            + (f" ({steps}, batch {sizes[0][1]})" if steps else "") + f" (search.epochs {lo}–{hi}; {box}).")
