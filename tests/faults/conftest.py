"""The fault campaign's one undamaged tiny sweep (configs/tiny.yaml, 8 trials), run once per session: every test
copies its run directory (and, where it damages the store, its store) and breaks the copy."""
from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from tests.faults.helpers import REPO, ok, quoted, recorded, run_cli


@pytest.fixture(scope="session")
def reference(tmp_path_factory) -> dict:
    base = tmp_path_factory.mktemp("faults-ref")
    run, store, cache = base / "run", base / "store", base / "models"
    ok(run_cli("run", REPO / "configs" / "tiny.yaml", "--out", run, "--store", store, "--cache", cache, "--quiet"))
    from orchestrator.rundir.files import told_states

    return {"run": run, "store": store, "cache": cache, "trials": sorted(recorded(run)), "quoted": quoted(run),
            "states": {k: v.name for k, v in told_states(run / "optuna.journal").items()}}


@pytest.fixture
def small_disk(tmp_path, monkeypatch):
    """A small file system at tmp_path/full: a tmpfs where this machine can mount one (root), else a directory
    with an injected quota (tests/faults/quota_plugin.py: ENOSPC from inside the project's writes, the spec must
    list ``PLUGINS``). -> (mount(MiB) -> the directory, resize(MiB), the plugins a spec needs)."""
    where = tmp_path / "full"
    where.mkdir()
    mounted, plugins = [], []

    def mount(mib: int) -> Path:
        r = None if os.environ.get("HEALSWEEP_TEST_NO_TMPFS") else subprocess.run(  # =1: the quota path anyway
            ["mount", "-t", "tmpfs", "-o", f"size={mib}m", "tmpfs", str(where)], capture_output=True)
        if r is not None and r.returncode == 0:
            mounted.append(where)
        else:
            plugins.append("tests.faults.quota_plugin")
            monkeypatch.setenv("HEALSWEEP_TEST_QUOTA", f"{where}:{mib << 20}")
        return where

    def resize(mib: int) -> None:
        if mounted:
            subprocess.run(["mount", "-o", f"remount,size={mib}m", str(where)], check=True)
        else:
            monkeypatch.setenv("HEALSWEEP_TEST_QUOTA", f"{where}:{mib << 20}")

    yield mount, resize, plugins
    for w in mounted:
        subprocess.run(["umount", "-l", str(w)], check=False)
