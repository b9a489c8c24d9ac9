"""The report's first line for a sweep that did not end complete (analysis/sweep_state.py)."""
from __future__ import annotations

from pathlib import Path

from analysis.sweep_state import state_note

OUT = Path("/runs/x")
RESUME = "Resume with healsweep run --resume /runs/x"


def test_an_interrupted_sweep_names_what_stopped_it_and_its_counts():
    info = {"status": "KILLED", "partial": {"finished": "3", "planned": "8", "signal": "SIGTERM"}}
    assert state_note(info, 3, OUT, None) == ("Partial sweep: interrupted by SIGTERM with 3 of 8 trials finished; the "
                                             f"findings cover those trials only. {RESUME}")
    info["partial"]["planned"] = None  # stopped before its trials were planned, or recorded by doctor --repair
    assert state_note(info, 3, OUT, "").startswith("Partial sweep: interrupted by SIGTERM with 3 trials finished;")


def test_a_running_parent_run_is_in_progress_or_unended_by_what_holds_the_run_directory():
    info = {"status": "RUNNING", "partial": None}
    assert state_note(info, 5, OUT, None) == ""  # not looked at: the report a sweep's own driver writes
    assert state_note(info, 5, OUT, "4242") == ("Sweep in progress: a healsweep driver (pid 4242) is running it; 5 "
                                               "trials finished so far, and the findings cover those only.")
    assert state_note(info, 5, OUT, "") == ("Unfinished sweep: its driver stopped without ending it (killed, or its "
                                           f"machine went down) with 5 trials finished; the findings cover those "
                                           f"trials only. {RESUME}")
    assert state_note(info, 5, OUT, "4242 doctor") == ""  # doctor --repair holds it: told once it ends
    assert state_note({"status": "FINISHED", "partial": None}, 8, OUT, "") == ""


def test_a_running_resume_of_an_interrupted_sweep_is_in_progress_not_partial():
    """The parent run of an interrupted sweep keeps its partial tag while a resume runs it (RUNNING again): the
    report said "Partial sweep: interrupted by SIGTERM" beside the live driver, and the old counts after a kill."""
    info = {"status": "RUNNING", "partial": {"finished": "3", "planned": "8", "signal": "SIGTERM"}}
    assert state_note(info, 5, OUT, "4242").startswith("Sweep in progress: a healsweep driver (pid 4242)")
    assert state_note(info, 5, OUT, "").startswith("Unfinished sweep: its driver stopped without ending it")
    assert state_note(info, 5, OUT, None).startswith("Partial sweep: interrupted by SIGTERM with 3 of 8")


def test_an_interrupted_refine_round_is_continued_by_refine(tmp_path):
    """`run --resume` resumes the main grid only: a refine round sweep.json marks interrupted (orchestrator/lifecycle/
    refine.py, from before it starts) is continued by `healsweep refine DIR`, whatever stopped it."""
    import json

    (tmp_path / "sweep.json").write_text(json.dumps({"refinements": [
        {"round": 1, "trials_finished": 4}, {"round": 2, "trials_finished": 1, "interrupted": True}]}))
    info = {"status": "KILLED", "partial": {"finished": "9", "planned": "16", "signal": "SIGINT"}}
    assert state_note(info, 9, tmp_path, None).endswith(f"Continue it with healsweep refine {tmp_path}")
    assert state_note({"status": "RUNNING"}, 9, tmp_path, "").endswith(f"Continue it with healsweep refine {tmp_path}")
    (tmp_path / "sweep.json").write_text(json.dumps({"refinements": [{"round": 1, "trials_finished": 4}]}))
    assert state_note(info, 9, tmp_path, None).endswith(f"Resume with healsweep run --resume {tmp_path}")
