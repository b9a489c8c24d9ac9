"""What bench_retest.py and bench_regret.py share: run a spec through the real console script, read back the
numbers the report quotes (``analysis.reported.cell_results``)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]


def run_spec(spec: dict, run_dir: Path, store: str, cache: str, reuse: bool,
             env: dict | None = None) -> tuple[Path, float]:
    """``healsweep run`` of ``spec`` (written next to the run directory) -> (run dir, wall seconds; NaN when
    ``reuse`` found a finished run there). ``env``: extra environment variables for the driver (a local Ray's
    workers inherit them)."""
    if reuse and (run_dir / "report.md").is_file():
        return run_dir, float("nan")
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    path = run_dir.parent / f"spec-{run_dir.name}.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-m", "orchestrator.cli", "run", str(path), "--out", str(run_dir), "--store", store,
                    "--cache", cache, "--quiet"], check=True, cwd=REPO, env={**os.environ, **(env or {})})
    return run_dir, time.perf_counter() - t0


def quoted(run_dir: Path):
    """Per cell, the number the report quotes (indexed by cell id)."""
    from analysis.reported import cell_results

    meta = json.loads((run_dir / "sweep.json").read_text())
    return cell_results(meta["tracking_uri"], meta["sweep_id"], meta.get("experiment") or "healsweep").set_index("cell_id")


def uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
