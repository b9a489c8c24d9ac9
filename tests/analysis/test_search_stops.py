"""The report's search stops (analysis/search_stops.py) read from a sweep's Optuna journal, also when a line of it
is damaged."""
from __future__ import annotations

import math

from orchestrator.search import Budget
from tests.orchestrator.test_search_contract import _cells
from tests.orchestrator.test_search_converge import CONV, drive, make


def test_the_reports_search_stops_survive_a_damaged_journal_line(tmp_path):
    """``healsweep report`` read the journal with Optuna and ended in a traceback on a damaged line (NUL bytes, a
    line that is not an operation); the report is read-only, so it replays the intact lines (doctor mends the file)."""
    import shutil

    from analysis.search_stops import JOURNAL, search_stops

    b = Budget(trials=10, lr=(1e-4, 1e-2), length=("steps", (4, 64)), reevaluate=2, explore=2, lattice=(5, 3),
               converge=CONV)
    cells = _cells(4)
    drive(make(tmp_path, cells, b), lambda c: 0.9 - 0.05 * (math.log10(c["lr"]) + 3) ** 2)
    run = tmp_path / "run"
    run.mkdir()
    shutil.copy(tmp_path / "j0", run / JOURNAL)
    whole = search_stops(run)
    assert sorted(whole) == sorted(c["cell_id"] for c in cells) and all(r["reason"] for r in whole.values())
    lines = (run / JOURNAL).read_bytes().splitlines(keepends=True)
    k = len(lines) // 2
    (run / JOURNAL).write_bytes(b"".join(lines[:k] + [b"\0" * 40 + b"\n", b'{"hello": 1}\n', b"[1]\n"] + lines[k:]))
    assert search_stops(run) == whole  # lines that are no operation: the same stops
    lines[k] = b"\0" * len(lines[k])  # an operation lost: no traceback, the stops the rest still gives
    (run / JOURNAL).write_bytes(b"".join(lines))
    assert set(search_stops(run)) <= set(whole)
