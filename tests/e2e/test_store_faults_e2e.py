"""End to end, on real Ray: a sweep over a store with a truncated manifest and a rotted shard (mtime restored)
quarantines both, recomputes only the damaged rows and logs the integrity events; a second driver on a live
run directory is refused (issue 16.1-16.3, 16.9), and so is a store gc on the store it uses."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from mlflow import MlflowClient

from orchestrator.spec import parse_spec
from orchestrator.sweep.run import run_sweep

pytestmark = pytest.mark.e2e
REPO = Path(__file__).resolve().parents[2]
EXE = Path(sys.executable).with_name("healsweep")
SPEC = {"name": "storefault", "models": ["vit_digits"], "sparsities": [0.9], "calib_sizes": [128],
        "pruners": ["magnitude"], "healers": ["starfish"],
        "search": {"trials_per_cell": 1, "lr": [1.0e-3, 1.0e-3], "epochs": [1, 1], "startup_trials": 1}}


@pytest.fixture(scope="module")
def model_cache() -> Path:
    return Path(os.environ.get("HEALSWEEP_TEST_CACHE", REPO / ".healsweep" / "models"))


def _rot(path: Path) -> None:
    st = path.stat()
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x40
    path.write_bytes(bytes(data))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


def test_sweep_quarantines_damaged_store_files_and_logs_events(tmp_path, model_cache):
    spec = parse_spec(SPEC)
    first = run_sweep(spec, tmp_path / "run1", tmp_path / "store", model_cache, progress=False, report=False,
                      num_cpus=2)
    assert first.dense_forward_images == 128 and first.trials_failed == 0
    (key,) = json.loads((tmp_path / "run1" / "targets.json").read_text())["keys"].values()
    kdir = tmp_path / "store" / "targets" / key
    (kdir / "manifest.json").write_bytes((kdir / "manifest.json").read_bytes()[:50])  # truncated
    _rot(kdir / "shard-00001.arrow")  # bit rot in rows 64-128, size and mtime unchanged
    second = run_sweep(spec, tmp_path / "run2", tmp_path / "store", model_cache, progress=False, report=False,
                       num_cpus=2)
    assert second.trials_failed == 0 and second.dense_forward_images == 64  # only the rotted shard
    client = MlflowClient(second.tracking_uri)
    m = client.get_run(second.parent_run_id).data.metrics
    assert m["store_integrity_events"] == 2 and m["dense_forward_images"] == 64
    events = client.download_artifacts(second.parent_run_id, "store_events_0.txt", str(tmp_path))
    text = Path(events).read_text()
    assert "unreadable JSON" in text and "shard-00001.arrow (rows 64-128) fails its sha256 check" in text
    assert sorted(p.name.split("-", 2)[2] for p in (tmp_path / "store" / "targets" / ".quarantine").iterdir()) == [
        "manifest.json", "shard-00001.arrow"]


def test_second_driver_is_refused_while_the_first_is_alive(tmp_path, model_cache):
    out = tmp_path / "run"
    env = dict(os.environ, PYTHONPATH=str(REPO), RAY_USAGE_STATS_ENABLED="0")
    first = subprocess.Popen([str(EXE), "run", str(REPO / "configs" / "tiny.yaml"), "--out", str(out), "--store",
                              str(tmp_path / "store"), "--cache", str(model_cache), "--num-cpus", "1", "--quiet"],
                             cwd=REPO, env=env, start_new_session=True, stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 120
        users = tmp_path / "store" / ".users"
        while time.time() < deadline and first.poll() is None and not list(users.glob("sweep-*")):
            time.sleep(0.2)
        assert first.poll() is None and (out / "driver.lock").read_text().strip() == str(first.pid)
        r = subprocess.run([str(EXE), "run", "--resume", str(out)], capture_output=True, text=True, cwd=REPO,
                           env=env, timeout=120)
        assert r.returncode == 2 and "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1
        assert f"another healsweep driver (pid {first.pid}) is running this sweep" in r.stderr
        # store gc deleted the targets and masks of a live sweep (every trial then failed): refused while it runs
        gc = [str(EXE), "store", "gc", "--older-than", "0", "--store", str(tmp_path / "store")]
        r = subprocess.run(gc, capture_output=True, text=True, cwd=REPO, env=env, timeout=120)
        using = f"{tmp_path / 'store'} is in use now by a sweep (pid {first.pid}, run directory {out})"
        assert r.returncode == 2 and r.stderr.strip() == (
            f"healsweep: error: store gc: {using}: gc could delete the targets and masks a sweep reads; run it when "
            "no sweep uses the store")
        r = subprocess.run([*gc, "--dry-run"], capture_output=True, text=True, cwd=REPO, env=env, timeout=120)
        assert r.returncode == 0 and f"note: {using}: a real gc is refused" in r.stdout, r.stdout + r.stderr
        assert first.poll() is None  # the first driver goes on undisturbed
    finally:
        try:
            os.killpg(first.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        first.wait()
    r = subprocess.run(gc, capture_output=True, text=True, cwd=REPO, env=env, timeout=120)  # its driver is gone
    assert r.returncode == 0 and not list(users.iterdir()), r.stdout + r.stderr  # its stale file removed too
