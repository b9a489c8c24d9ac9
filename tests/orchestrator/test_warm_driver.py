"""A driver over a warm store and model cache imports no torch (issue #35): the spec check, the models stage (cached
facts), the cells, the store budget, the planner, the dense stage (every shard verified), the diagnostics and mask
stages (everything found in the store), the trials' configs and every module the driver imports on the way to Tune,
MLflow and the report. The first run (cold) computes targets and masks and so imports torch: the probe sees it.

Each run is a fresh interpreter with an audit hook that records the first ``import torch`` and where it came from
(no Ray: the dense and mask stages run in the process, as a local CPU sweep runs them; the real console script twice
in a row is tests/e2e/test_warm_driver_e2e.py)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
CACHE = os.environ.get("HEALSWEEP_TEST_CACHE", str(REPO / ".healsweep" / "models"))
pytestmark = pytest.mark.timeout(300)

SPEC = """name: warm
models: [vit_digits]
sparsities: [0.5, 0.9]
calib_sizes: [64]
pruners: [magnitude]
healers: [starfish]
search: {trials_per_cell: 1, epochs: [1, 1], reevaluate: 0}
"""

PROBE = r"""
import json, sys, traceback
first = []


def audit(event, args):
    if event == "import" and args[0] == "torch" and not first:
        first.append("".join(traceback.format_stack(limit=30)[:-1]))


sys.addaudithook(audit)
from pathlib import Path

import orchestrator.cli, orchestrator.commands.run, orchestrator.sweep.run  # noqa: F401, E401  (the driver's path)
import orchestrator.sweep.end, orchestrator.sweep.parent, orchestrator.tracking.logger  # noqa: F401, E401
import analysis.report, analysis.rr, analysis.transition_report  # noqa: F401, E401  (the report, in the driver)
from orchestrator.commands.common import load_spec_or_exit
from orchestrator.raytune.tune_setup import trial_config, tune_trainable
from orchestrator.search.records import fixed_cell
from orchestrator.spec.plan import expand_cells
from orchestrator.sweep.dense import budget_modes
from orchestrator.sweep.diagnostics import diagnostics_stage
from orchestrator.sweep.planner import plan_target_modes
from orchestrator.sweep.stages import dense_stage, mask_stage, prepare_models, store_paths

spec_file, store, cache = sys.argv[1:4]
spec = load_spec_or_exit(spec_file)
paths = store_paths(spec.store.uri, Path(store), Path(cache))
models = prepare_models(spec, paths["cache"], progress=False)
cells = expand_cells(spec, {m: i.scope for m, i in models.items()})
rows = {m: max(c.calib_size for c in cells if c.model == m) for m in models}
modes = budget_modes(spec, models, rows, paths["targets"], paths["cache"])
plan_target_modes(spec, models, modes, paths["cache"], Path(store))
dense = dense_stage(spec, models, rows, paths["targets"], paths["cache"], progress=False, in_driver=True)
diag = diagnostics_stage(cells, models, paths["diagnostics"], paths["cache"], spec.data_seed)
masks = mask_stage(cells, models, paths["masks"], paths["cache"], spec.data_seed, in_driver=True,
                   diagnostics=diag.tables(paths["diagnostics"]))
configs = [trial_config(c, spec, paths, models[c.model].store_key, masks[c.cell_id], "token", 1, "cpu",
                        modes[c.model]) for c in cells]
fixed = [fixed_cell(c) for c in configs]
print(json.dumps({"torch": "torch" in sys.modules, "first": first[0] if first else "", "dense": dense,
                  "masks": masks.placement, "trainable": tune_trainable.__module__, "fixed": fixed}))
"""


def _drive(tmp_path: Path) -> dict:
    spec = tmp_path / "warm.yaml"
    spec.write_text(SPEC)
    env = dict(os.environ, PYTHONPATH=str(REPO), HEALSWEEP_CHECK_CACHE=str(tmp_path / "checks"))
    r = subprocess.run([sys.executable, "-c", PROBE, str(spec), str(tmp_path / "store"), CACHE],
                       capture_output=True, text=True, env=env, cwd=tmp_path, timeout=280)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_a_warm_driver_imports_no_torch(tmp_path):
    cold = _drive(tmp_path)
    assert cold["torch"] and cold["first"]  # targets and masks computed: torch, and the probe sees it
    assert cold["dense"] == {"vit_digits": 64} and cold["masks"] == "driver"
    warm = _drive(tmp_path)
    assert warm["dense"] == {"vit_digits": 0} and warm["masks"] == "cached"  # everything read from the store
    assert not warm["torch"], "a warm driver imported torch:\n" + warm["first"]
    assert warm["trainable"] == "orchestrator.raytune.trial_entry" and warm["fixed"] == [False, False]
