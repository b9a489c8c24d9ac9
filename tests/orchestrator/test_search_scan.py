"""The design's scan of its queue (``SearchDesign.ask``): Tune asks on every step of its loop while trials run, so
an ask that finds nothing ready must be cheap, and must never miss a result told while it scanned. No Ray: the
Tune ``Searcher`` is driven by hand, as in tests/orchestrator/test_search_converge.py."""
from __future__ import annotations

import threading

import pytest

from tests.orchestrator.test_search_contract import _cells
from tests.orchestrator.test_search_converge import make

pytestmark = pytest.mark.timeout(60)


def result(cfg) -> dict:
    return {"selection_acc": 0.5 + cfg["lr"], "final": True, "epoch": cfg["epochs"], "dense_selection_acc": 0.99,
            "n_selection": 180}


def until_idle(searcher) -> list[tuple[str, dict]]:
    """Ask until the design answers None (every remaining trial waits for results) -> the live trials."""
    live = []
    while (cfg := searcher.suggest(f"t{len(live)}")) is not None:
        assert cfg != "FINISHED"
        live.append((f"t{len(live)}", cfg))
    return live


def counting_reads(design) -> list[int]:
    """Count the design's reads of its studies' trials (each one re-syncs the Optuna journal file)."""
    reads, real = [0], design.storage.get_all_trials

    def get_all_trials(*a, **kw):
        reads[0] += 1
        return real(*a, **kw)
    design.storage.get_all_trials = get_all_trials
    return reads


def test_an_ask_with_nothing_told_since_an_idle_scan_reads_nothing_and_a_tell_wakes_it(tmp_path):
    cells = _cells(6)
    s = make(tmp_path, cells)
    live = until_idle(s)  # the first wave of every cell: the second waits for the family's first
    assert len(live) == 12
    reads = counting_reads(s.design)
    for _ in range(5):  # Tune's loop asks again and again while the trials run
        assert s.suggest("again") is None
    assert reads[0] == 0
    for tid, cfg in live:
        s.on_trial_complete(tid, result(cfg))
    nxt = s.suggest("next")
    assert nxt is not None and nxt != "FINISHED" and nxt["stage"] == "search"
    reads[0] = 0
    assert s.suggest("then") is not None  # the waves are decided: this scan only reads how many trials each study has
    assert len(s.design.queue) > 50 and reads[0] <= 2 * len(cells) + 5  # 6 cells x 2 studies; ~70 slots queued


def test_a_result_told_while_the_design_scans_is_not_missed(tmp_path):
    """Tells run on the MLflow writer's thread, beside the driver's scan: one that lands mid-scan must make the next
    ask scan again, or the sweep would wait for ever on a trial that is ready."""
    cells = _cells(2)
    s = make(tmp_path, cells)
    live = until_idle(s)
    *first, last = live
    for tid, cfg in first:
        s.on_trial_complete(tid, result(cfg))
    d, real = s.design, type(s.design).ready
    calls = [0]

    def ready_while_a_tell_lands(slot):
        calls[0] += 1
        if calls[0] == 1:
            s.on_trial_complete(last[0], result(last[1]))  # the last first-wave result arrives during this scan ...
        return False  # ... which read the state before it and found nothing ready
    d.ready = ready_while_a_tell_lands
    assert s.suggest("during") is None and calls[0] >= 1
    d.ready = lambda slot: real(d, slot)
    nxt = s.suggest("after")
    assert nxt is not None and nxt != "FINISHED" and nxt["stage"] == "search"


def test_a_result_told_from_another_thread_waits_for_the_ask_so_a_stopped_cell_gets_no_more_trials(tmp_path):
    """Every cell recovers at its first wave, so none may run a second. The last first-wave result is told from
    another thread right after the ask's ``settle`` (which stops finished cells) and before its scan: were the tell
    to land there, the scan would find the second wave decidable and ask a trial of a stopped cell."""
    cells = _cells(6)
    s = make(tmp_path, cells)
    d = s.design
    live = until_idle(s)
    *first, last = live
    for tid, cfg in first:
        s.on_trial_complete(tid, result(cfg) | {"selection_acc": 0.99})
    settle, teller = d.settle, []

    def settle_then_a_tell_arrives():
        settle()
        if not teller:
            t = threading.Thread(target=s.on_trial_complete, args=(last[0], result(last[1]) | {"selection_acc": 0.99}))
            teller.append(t)
            t.start()
            t.join(0.5)  # a tell that does not wait for the ask lands here
    d.settle = settle_then_a_tell_arrives
    got = [s.suggest("during")]
    d.settle = settle
    teller[0].join(10)
    assert not teller[0].is_alive()
    if got[0] is not None:
        s.on_trial_complete("during", result(got[0]) | {"selection_acc": 0.99})
    while (cfg := s.suggest(f"r{len(got)}")) != "FINISHED":
        assert cfg is not None
        got.append(cfg)
        s.on_trial_complete(f"r{len(got) - 1}", result(cfg) | {"selection_acc": 0.99})
    for c in cells:
        assert d.stops[c["cell_id"]].startswith("recovered")
        assert len(d.study(c["cell_id"]).get_trials(deepcopy=False)) == 2  # the first wave only
