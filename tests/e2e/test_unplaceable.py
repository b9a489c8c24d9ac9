"""A spec that validates must run or be refused: a trial no node of a fixed (local) Ray instance can place is one
line and exit 2, instead of Tune waiting forever with an "insufficient resources" warning every minute."""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import yaml

from tests.orchestrator.run_cli import REPO, healsweep
from tests.orchestrator.test_cli_guards import assert_one_line_exit_2

pytestmark = pytest.mark.e2e


def test_trial_larger_than_every_node_is_refused_in_one_line(tmp_path):
    raw = yaml.safe_load((REPO / "configs" / "tiny.yaml").read_text())
    raw["resources"] = {**(raw.get("resources") or {}), "cpus_per_trial": 1000}
    (tmp_path / "big.yaml").write_text(yaml.safe_dump(raw))
    cache = Path(os.environ.get("HEALSWEEP_TEST_CACHE", REPO / ".healsweep" / "models")).resolve()
    r = healsweep("run", tmp_path / "big.yaml", "--out", tmp_path / "run", "--store", tmp_path / "store",
                  "--cache", cache, "--num-cpus", "2", "--quiet", "--no-report", timeout=300)
    assert_one_line_exit_2(r, "asks for 1000 CPU", "largest node has 2")
    assert not (tmp_path / "run" / "trials").exists()  # no trial ran
