"""tasks/healing/planner.py on the CPU: the cache-or-recompute probe heals with the trials' settings (precision,
compile, graph) and times replays: its baseline run holds the set-up, and under ``heal.graph: step`` also the
warm-up steps, the capture and the first replay (on a GPU a capture costs many steps; nothing is captured here,
the step counts are what is checked). What the orchestrator keys a cached decision by:
tests/orchestrator/test_gpu_settings.py."""
from __future__ import annotations

import pytest

from tasks.healing import planner
from tasks.healing.graphed import WARMUP
from tasks.models import get_adapter
from tests.conftest import build_model, calib_images


@pytest.mark.timeout(120)
@pytest.mark.parametrize("graph,base", [("off", 1), ("step", WARMUP + 2)])
def test_the_probe_heals_as_the_trials_do_and_times_the_steps_past_its_baseline(monkeypatch, graph, base):
    runs = []
    real = planner._heal_seconds

    def spy(*a):  # the real heal, its config recorded
        runs.append(a[5])
        return real(*a)

    monkeypatch.setattr(planner, "_heal_seconds", spy)
    dense = build_model("timm_vit", 0)
    secs = planner.time_target_modes(dense, get_adapter(dense), "qkv_out_mlp", calib_images("timm_vit", 24), 8,
                                     steps=3, repeats=1, precision="bf16", compile="off", graph=graph)
    assert set(secs) == {"store", "recompute"} and all(v > 0 for v in secs.values())
    assert len(runs) == 2 * 2 * 2  # (warm-up round + 1 repeat) x 2 modes x (baseline, full)
    assert {(c.steps, c.precision, c.compile, c.graph) for c in runs} == {
        (base, "bf16", "off", graph), (base + 2, "bf16", "off", graph)}
    assert all(c.epochs * 3 >= c.steps for c in runs)  # 24 images, batch 8: 3 steps an epoch cover the budget
