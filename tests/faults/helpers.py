"""Helpers of the fault campaign (tests/faults/): the CLI in a subprocess, copies of the one undamaged run,
damage, and the checks every fault ends with (one line, no traceback; every trial once; the same numbers)."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def run_cli(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    """``healsweep ARGS`` in a fresh process (what a user runs; every command that starts Ray), from the
    repository root."""
    env = dict(os.environ, PYTHONPATH=str(REPO), RAY_USAGE_STATS_ENABLED="0")
    return subprocess.run([sys.executable, "-m", "orchestrator.cli", *map(str, args)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout)


def cli(*args: str) -> subprocess.CompletedProcess:
    """``healsweep ARGS`` in this process (doctor, report, refusals before Ray: the imports are paid once per
    session, not once per call); an exception that escapes the CLI fails the test with its traceback."""
    import contextlib
    import io

    from orchestrator.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main([str(a) for a in args])
    return subprocess.CompletedProcess(list(args), code, out.getvalue(), err.getvalue())


def one_line(r: subprocess.CompletedProcess, code: int, *needles: str) -> str:
    """The error line of a failed command: exit ``code``, no traceback, exactly one ``healsweep: error:`` line
    (notes about torn lines may precede it) holding every needle."""
    assert "Traceback" not in r.stderr + r.stdout, r.stderr[-3000:]
    errors = [ln for ln in r.stderr.splitlines() if ln.startswith("healsweep: error:")]
    others = [ln for ln in r.stderr.splitlines() if ln.strip() and not ln.startswith("healsweep: ")]
    assert r.returncode == code and len(errors) == 1 and not others, (r.returncode, r.stderr[-3000:])
    for n in needles:
        assert n in errors[0], (n, errors[0])
    return errors[0]


def ok(r: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert r.returncode == 0 and "Traceback" not in r.stderr, (r.returncode, r.stdout[-2000:], r.stderr[-3000:])
    return r


def copy_run(ref: dict, dst: Path, own_store: bool = False) -> Path:
    """A copy of the reference run directory (its sweep.json still names the original place: ``relocate``
    re-points it, as for any moved run); with ``own_store``, a copy of its store too."""
    shutil.copytree(ref["run"], dst, symlinks=True)
    if own_store:
        store = dst.parent / f"{dst.name}-store"
        shutil.copytree(ref["store"], store, symlinks=True)
        info = json.loads((dst / "sweep.json").read_text())
        info["store"] = str(store)
        (dst / "sweep.json").write_text(json.dumps(info, indent=1))
        targets = json.loads((dst / "targets.json").read_text())
        targets["store"] = str(store / "targets")
        (dst / "targets.json").write_text(json.dumps(targets, indent=1))
    return dst


def tear_last_line(path: Path) -> None:
    """What a kill or a full disk during an append leaves: the last line cut in half, no newline."""
    data = path.read_bytes()
    start = data[:-1].rfind(b"\n") + 1
    path.write_bytes(data[: start + (len(data) - start) // 2])


def damage_line(path: Path, n: int) -> None:
    """Line ``n`` (1-based) with some of its bytes overwritten (bit rot, a bad sector)."""
    lines = path.read_bytes().split(b"\n")
    line = lines[n - 1]
    lines[n - 1] = line[:10] + b"#\x00garbage" + line[19:]
    path.write_bytes(b"\n".join(lines))


def quoted(run: Path) -> list[str]:
    """The numbers the report quotes: its table rows, run ids taken out (a rebuilt run gets a new id)."""
    import re

    rows = [ln for ln in (run / "report.md").read_text().splitlines() if ln.startswith("|")]
    return [re.sub(r"`[0-9a-f]{32}`", "RUN", ln) for ln in rows]


def trial_runs(run: Path) -> Counter:
    """{trial id: number of live MLflow runs} of the sweep."""
    from mlflow import MlflowClient

    info = json.loads((run / "sweep.json").read_text())
    client = MlflowClient(info["tracking_uri"])
    exp = client.get_experiment_by_name(info.get("experiment") or "healsweep")
    runs = client.search_runs([exp.experiment_id], f"tags.sweep_id = '{info['sweep_id']}' and "
                                                   "tags.`healsweep.role` = 'trial'", max_results=1000)
    return Counter(r.data.tags["trial_id"] for r in runs)


def recorded(run: Path) -> Counter:
    """{trial id: trial lines} of DIR/trials.jsonl (every line intact)."""
    from orchestrator.rundir import records

    s = records.scan(run / records.TRIALS_FILE)
    assert s.clean, (s.damaged, s.torn)
    return Counter(r["trial_id"] for r in s.records if r["kind"] == records.TRIAL)


def assert_complete(run: Path, ref: dict) -> None:
    """The sweep of ``run`` is complete: every trial of the reference once in MLflow and in the record, none
    twice, the journal told them all, and the report quotes the reference's numbers."""
    from orchestrator.rundir.files import told_states

    want = Counter({t: 1 for t in ref["trials"]})
    assert trial_runs(run) == want
    assert recorded(run) == want
    assert {k: v.name for k, v in told_states(run / "optuna.journal").items()} == ref["states"]
    assert quoted(run) == ref["quoted"]


def trial_line(trial_id: str, cell_id: str = "c", state: str = "COMPLETE", tags: dict | None = None, **extra) -> dict:
    """A trial record of the shape orchestrator/tracking/recorder.py writes (what records.check_record wants)."""
    optuna = {"study": cell_id, "study_attrs": {}, "direction": "MAXIMIZE", "number": int(trial_id.rsplit("-")[-1]),
              "stage": "search", "params": {}, "distributions": {}, "user_attrs": {}, "intermediate": {},
              "value": 0.5, "state": state}
    mlflow = {"run_id": "r" * 32, "run_name": trial_id, "status": "FINISHED", "start_time": 1, "end_time": 2,
              "tags": dict(tags or {}), "params": {}, "metrics": {}, "step": 0, "history": {}}
    return {"kind": "trial", "trial_id": trial_id, "cell_id": cell_id, "optuna": optuna, "mlflow": mlflow, **extra}
