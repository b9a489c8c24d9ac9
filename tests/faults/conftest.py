"""The fault campaign's one undamaged tiny sweep (configs/tiny.yaml, 8 trials), run once per session: every test
copies its run directory (and, where it damages the store, its store) and breaks the copy."""
from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from tests.faults.helpers import REPO, ok, quoted, recorded, run_cli


@pytest.fixture(scope="session")
def reference(tmp_path_factory) -> dict:
    base = tmp_path_factory.mktemp("faults-ref")
    run, store, cache = base / "run", base / "store", base / "models"
    ok(run_cli("run", REPO / "configs" / "tiny.yaml", "--out", run, "--store", store, "--cache", cache, "--quiet"))
    from orchestrator.resume import told_states

    return {"run": run, "store": store, "cache": cache, "trials": sorted(recorded(run)), "quoted": quoted(run),
            "states": {k: v.name for k, v in told_states(run / "optuna.journal").items()}}


@pytest.fixture
def tmpfs(tmp_path):
    """A small tmpfs at tmp_path/full (root only): ``mount(size)`` mounts it, ``resize(size)`` grows it."""
    where = tmp_path / "full"
    where.mkdir()
    mounted = []

    def mount(size: str) -> Path:
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)], capture_output=True)
        if r.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here ({r.stderr.decode().strip()[:80]}): needs root")
        mounted.append(where)
        return where

    def resize(size: str) -> None:
        subprocess.run(["mount", "-o", f"remount,size={size}", str(where)], check=True)

    yield mount, resize
    for w in mounted:
        subprocess.run(["umount", "-l", str(w)], check=False)
