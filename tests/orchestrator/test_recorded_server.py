"""A recorded sweep whose MLflow server is down: `report` and `run --resume` answer in one line within the 3-s
connection check (MLflow's client retried for ~4 min, then said the parent run was missing or raised a traceback)."""
from __future__ import annotations

import json
import socket
import time

from orchestrator.cli import main


def test_report_and_resume_of_a_sweep_whose_server_is_down(tmp_path, capsys):
    with socket.socket() as s:  # a port nothing listens on any more
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    run = tmp_path / "run"
    run.mkdir()
    (run / "sweep.json").write_text(json.dumps({
        "sweep_id": "s", "tracking_uri": f"http://127.0.0.1:{port}", "store": str(tmp_path / "store"),
        "cache": str(tmp_path / "cache"), "spec": {}, "parent_run_id": "0" * 32}))
    for argv in (["report", str(run)], ["run", "--resume", str(run)]):
        t0 = time.perf_counter()
        assert main(argv) == 2
        assert time.perf_counter() - t0 < 10
        assert capsys.readouterr().err.strip() == (
            f"healsweep: error: {run / 'sweep.json'}: tracking_uri: cannot reach 127.0.0.1:{port} within 3 s "
            "(Connection refused); start the tracking server or fix the URI")
