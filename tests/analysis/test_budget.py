"""The budget the report's claims hold within (issue 34): stated on the first screen, and a winner that uses the
whole budget is not warned about as under-tuned (only an lr edge is)."""
from __future__ import annotations

import pandas as pd

from analysis.budget import budget_line
from analysis.findings import _warnings


def test_budget_line_states_steps_or_the_steps_epochs_give():
    gb = pd.DataFrame({"calib_size": [128, 128], "batch_size": [32, 32]})
    assert budget_line(gb, {"lr": [1e-4, 1e-2], "steps": [4, 64]}) == (
        "Budget: bands and leads hold within 64 optimizer steps per trial (search.steps 4–64; lr 0.0001–0.01).")
    line = budget_line(gb, {"lr": [1e-3, 1.5e-2], "epochs": [3, 8]})
    assert "within 8 epochs per trial (32 optimizer steps at 128 images, batch 32)" in line and "0.015" in line
    assert budget_line(gb, None) == ""
    one = pd.DataFrame({"calib_size": [16], "batch_size": [32]})  # 1 epoch of 16 images: one step ("1 epochs")
    assert "within 1 epoch per trial (1 optimizer step at 16 images, batch 32)" in budget_line(
        one, {"lr": [1e-3, 1e-3], "epochs": [1, 1]})
    assert "within 1 optimizer step per trial" in budget_line(one, {"lr": [1e-3, 1e-3], "steps": [1, 1]})


def test_budget_line_names_a_precision_other_than_the_authors_fp32():
    bounds = {"lr": [1e-4, 1e-2], "steps": [4, 64]}
    gb = pd.DataFrame({"calib_size": [128, 128], "batch_size": [32, 32], "precision": ["bf16", "bf16"]})
    assert budget_line(gb, bounds).endswith(
        "(search.steps 4–64; lr 0.0001–0.01). Healed in bf16 autocast (heal.precision; the authors heal in fp32).")
    assert budget_line(gb, None) == "Healed in bf16 autocast (heal.precision; the authors heal in fp32)."
    mixed = gb.assign(precision=["tf32", "fp32"])
    assert budget_line(mixed, bounds).endswith("Healed in TF32 matrix products (heal.precision; the authors heal in fp32).")
    for fp32 in (gb.assign(precision=["fp32", "fp32"]), gb.assign(precision=[None, None]), gb.drop(columns="precision")):
        assert "Healed" not in budget_line(fp32, bounds)  # the authors' precision, or runs logged before the param


def test_only_non_budget_edges_are_warned_about():
    mb = pd.DataFrame({"pruner": ["m", "m"], "healer": ["s", "s"], "pattern": ["0.9", "0.95"], "calib_size": [64, 64],
                       "seed": [0, 0], "lr": [1e-3, 1e-2], "batch_size": [32, 32], "steps": [64, 64],
                       "search_boundary": ["64 of 64 steps", "lr 0.01 at the 0.01 cap; 64 of 64 steps"]})
    (w,) = [x for x in _warnings(mb, []) if "search boundary" in x]
    assert w.startswith("1 of 2 searched cells' winners sit on the search boundary") and "0.95" in w


def test_a_budget_the_trials_went_past_is_the_one_stated():
    """A widening round (search.widen, refine --widen) or a converging search runs past the spec's box: the first
    screen said "within 5 epochs (search.epochs 3–5; lr 0.001–0.003)" under a winner healed 7 epochs at lr 0.012."""
    gb = pd.DataFrame({"calib_size": [128], "batch_size": [32]})
    declared = {"lr": [1e-3, 3e-3], "epochs": [3, 5]}
    trials = pd.DataFrame({"lr": [1e-3, 3e-3, 1.2e-2, 0.0], "epochs": [3, 5, 7, 0]})  # lr 0: a closed-form cell
    assert budget_line(gb, declared, trials) == (
        "Budget: bands and leads hold within 7 epochs per trial (28 optimizer steps at 128 images, batch 32) "
        "(searched epochs 3–7, lr 0.001–0.012: past the spec's search.epochs 3–5, lr 0.001–0.003).")
    inside = trials.iloc[:2]
    assert budget_line(gb, declared, inside) == budget_line(gb, declared) == (
        "Budget: bands and leads hold within 5 epochs per trial (20 optimizer steps at 128 images, batch 32) "
        "(search.epochs 3–5; lr 0.001–0.003).")
    steps = pd.DataFrame({"lr": [4e-4, 1e-3], "steps": [8, 16]})
    assert budget_line(gb, {"lr": [1e-3, 1e-2], "steps": [4, 64]}, steps).endswith(
        "within 64 optimizer steps per trial (searched steps 4–64, lr 0.0004–0.01: past the spec's search.steps 4–64, "
        "lr 0.001–0.01).")


def test_the_lattice_rounding_and_failed_trials_do_not_stretch_the_budget():
    """log_axis prints lr at 6 significant figures (0.0123457 above a 0.0123456789 bound): no "past the box"; a
    failed trial's length was never healed through."""
    gb = pd.DataFrame({"calib_size": [128], "batch_size": [32]})
    declared = {"lr": [1e-4, 0.0123456789], "steps": [4, 64]}
    trials = pd.DataFrame({"lr": [1e-4, 0.0123457, 1e-3], "steps": [4, 64, 128],
                           "status": ["FINISHED", "FINISHED", "FAILED"]})
    assert budget_line(gb, declared, trials) == budget_line(gb, declared)
