"""``run --resume --retry-failed`` (orchestrator/tracking/retry.py) over every search design, without Ray: the
searcher is driven like Tune (tests/orchestrator/test_search_contract.py), the record is written from its journal
by the recorder's own ``optuna_part``, the retry drops the failed trials, and a resumed searcher runs them again."""
from __future__ import annotations

import pytest
from optuna.trial import TrialState

from orchestrator.rundir import records
from orchestrator.rundir.files import JOURNAL_FILE, told_states
from orchestrator.search import make_searcher, reevaluation_seeds
from orchestrator.search.records import REEVALUATE, SEARCH, Ask
from orchestrator.tracking import retry
from orchestrator.tracking.recorder import optuna_part
from tests.orchestrator.test_search_contract import BUDGET, FINISHED, _cells, design, landscape  # noqa: F401

pytestmark = pytest.mark.timeout(120)


def drive(searcher, fail=frozenset()) -> list[tuple[str, str, dict]]:
    """Ask until nothing is ready, then finish the oldest live trial, like Tune; the trials in ``fail`` raise.
    -> the events in order: ("ask", trial id, config) and ("tell", trial id, config)."""
    events, live, i = [], [], 0

    def finish() -> None:
        tid, c = live.pop(0)
        bad = c["trial_id"] in fail
        searcher.on_trial_complete(tid, None if bad else {"selection_acc": landscape(c), "final": True,
                                                         "epoch": c["epochs"]}, error=bad)
        events.append(("tell", c["trial_id"], c))
    while (cfg := searcher.suggest(f"t{i}")) != FINISHED:
        if cfg is None:
            finish()
            continue
        events.append(("ask", cfg["trial_id"], cfg))
        live.append((f"t{i}", cfg))
        i += 1
    while live:
        finish()
    searcher.flush_errors()  # as the trials stage does after Tune's fit
    return events


def write_record(run_dir, searcher, reasons: dict[str, str]) -> None:
    """trials.jsonl as the recorder writes it (its Optuna part; the MLflow part: the failure reason only)."""
    d = searcher.design
    for cid in d.cells:
        for stage in (SEARCH, REEVALUATE):
            study = d.study(cid, stage)
            for t in study.get_trials(deepcopy=False):
                tid = Ask(cid, t.number, {}, stage).trial_id
                mlflow = {"run_id": f"run-{tid}", "status": "FINISHED", "params": {}, "metrics": {}, "history": {},
                          "step": 0, "start_time": 0, "end_time": 0,
                          "tags": {"failure_reason": reasons[tid]} if tid in reasons else {}}
                records.append(run_dir / records.TRIALS_FILE, {
                    "kind": records.TRIAL, "trial_id": tid, "cell_id": cid, "mlflow": mlflow,
                    "optuna": optuna_part(study, t, stage, t.value, t.state.name)})


def make(design, run_dir, cells):  # noqa: F811 - ``design``: the contract suite's fixture, its name
    run_dir.mkdir(exist_ok=True)
    return make_searcher(cells, {c["cell_id"]: BUDGET for c in cells}, design, 0, run_dir / JOURNAL_FILE)


def test_failed_trials_run_again_and_their_cells_winner_is_reevaluated_after_them(design, tmp_path):  # noqa: F811
    """The winner of cell 1 fails (an error: retried), a trial of cell 0 diverges (kept). The retry runs exactly
    the failed trial (same parameters) and cell 1's re-evaluations, these only once the retried trial is told, on
    the winner of the cell's whole search and the seeds every winner heals on; nothing else runs again."""
    cells = _cells(2)
    clean = drive(make(design, tmp_path / "clean", cells))
    search = [(c, landscape(c)) for k, _, c in clean if k == "ask" and c["stage"] == SEARCH]
    winner = max((x for x in search if x[0]["cell_id"] == "cmain1"), key=lambda x: x[1])[0]["trial_id"]
    worst0 = min((x for x in search if x[0]["cell_id"] == "cmain0"), key=lambda x: x[1])[0]["trial_id"]
    run_dir = tmp_path / "run"
    s = make(design, run_dir, cells)
    first = drive(s, fail={winner, worst0})
    reasons = {winner: "RuntimeError: CUDA out of memory", worst0: "HealingDiverged: loss became nan at epoch 2"}
    write_record(run_dir, s, reasons)
    before = {tid: c for k, tid, c in first if k == "ask"}
    old_reevals = [t for t in before if t.startswith("cmain1-r")]

    r = retry.drop_failed(run_dir, {c["cell_id"] for c in cells})
    assert r.failed == {winner: reasons[winner]} and r.diverged == [worst0] and not r.elsewhere
    assert sorted(r.again) == sorted(old_reevals) and len(old_reevals) == BUDGET.reevaluate
    kept = records.trials(records.scan(run_dir / records.TRIALS_FILE))
    assert set(kept) == set(before) - {winner, *old_reevals}  # the diverged trial's line stays
    assert told_states(run_dir / JOURNAL_FILE)[worst0] == TrialState.FAIL

    resumed = make(design, run_dir, cells)
    assert sorted(resumed.rerun) == sorted([winner, *old_reevals])
    again = drive(resumed)
    asked = [tid for k, tid, _ in again if k == "ask"]
    assert sorted(asked) == sorted([winner, *old_reevals])
    retried = next(c for k, tid, c in again if k == "ask" and tid == winner)
    assert (retried["lr"], retried["epochs"]) == (before[winner]["lr"], before[winner]["epochs"])
    told_at = next(i for i, (k, tid, _) in enumerate(again) if k == "tell" and tid == winner)
    best = resumed.design.pick("cmain1")
    for i, (k, tid, c) in enumerate(again):
        if k == "ask" and c["stage"] == REEVALUATE:
            assert i > told_at, "a re-evaluation was asked before the retried search trial was told"
            assert (c["lr"], c["epochs"]) == (best.params["lr"], resumed.design._params("cmain1", best.params)["epochs"])
    seeds = [c["heal_seed"] for k, _, c in again if k == "ask" and c["stage"] == REEVALUATE]
    assert sorted(seeds) == reevaluation_seeds(0, BUDGET.reevaluate)
    states = told_states(run_dir / JOURNAL_FILE)
    assert states[winner] == TrialState.COMPLETE and states[worst0] == TrialState.FAIL
    assert sum(st == TrialState.FAIL for st in states.values()) == 1


def test_a_failed_trial_retried_last_in_its_cell_gives_the_clean_sweeps_numbers(design, tmp_path):  # noqa: F811
    """A cell's last search trial failing, then retried: its cell ends as a sweep where nothing failed (the same
    trials, the same winner, the same re-evaluation mean), whatever design."""
    cells = _cells(2)
    clean = make(design, tmp_path / "clean", cells)
    drive(clean)
    last = f"cmain1-{clean.design.n_trials('cmain1') - 1}"
    run_dir = tmp_path / "run"
    s = make(design, run_dir, cells)
    drive(s, fail={last})
    write_record(run_dir, s, {last: "OSError: [Errno 28] No space left on device"})
    assert retry.retryable(run_dir) == 1
    retry.drop_failed(run_dir)
    resumed = make(design, run_dir, cells)
    drive(resumed)
    assert resumed.design.noise() == clean.design.noise()


def test_only_the_cells_this_run_holds_are_retried_and_nothing_failed_changes_nothing(tmp_path):
    cells = _cells(2)
    run_dir = tmp_path / "run"
    s = make("tpe", run_dir, cells)
    drive(s, fail={"cmain0-1"})
    write_record(run_dir, s, {"cmain0-1": "DatasetError: split 'validation' missing"})
    journal = (run_dir / JOURNAL_FILE).read_bytes()
    record = (run_dir / records.TRIALS_FILE).read_bytes()
    r = retry.drop_failed(run_dir, {"cmain1"})  # a refine round's cell: run --resume does not hold it
    assert r.elsewhere == ["cmain0-1"] and not r.dropped
    assert (run_dir / JOURNAL_FILE).read_bytes() == journal and (run_dir / records.TRIALS_FILE).read_bytes() == record
    lines: list[str] = []
    retry.retry_lines(r, lines.append)
    assert lines[0] == "--retry-failed: no failed trial to run again"
    assert "1 failed trial(s) of refine rounds kept (cmain0-1)" in lines[1]
