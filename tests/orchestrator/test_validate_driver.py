"""`healsweep validate` is a torch-free driver: with the compatibility verdicts cached it imports none of torch, ray
and mlflow (checked with -X importtime in a fresh interpreter), its counts are orchestrator.spec.plan's, and a combination
only an architecture can refuse is still refused in the same one line, cached or not."""
from __future__ import annotations

import os
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest

from orchestrator.commands.validate import cell_grids
from orchestrator.spec import SpecError, load_spec

REPO = Path(__file__).resolve().parents[2]
HEAVY = ("torch", "ray", "mlflow", "timm", "scipy", "pandas", "optuna")


def validate(spec: Path | str, cache: Path) -> tuple[subprocess.CompletedProcess, set[str]]:
    """Run the CLI in a fresh interpreter -> (the process, the top-level packages it imported)."""
    env = {**os.environ, "HEALSWEEP_CHECK_CACHE": str(cache), "PYTHONPATH": str(REPO)}
    p = subprocess.run([sys.executable, "-X", "importtime", "-m", "orchestrator.cli", "validate", str(spec)],
                       cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    lines = [ln for ln in p.stderr.splitlines() if ln.startswith("import time:")]
    imported = {ln.rsplit("|", 1)[-1].strip().split(".")[0] for ln in lines}
    errors = [ln for ln in p.stderr.splitlines() if not ln.startswith("import time:")]
    return subprocess.CompletedProcess(p.args, p.returncode, p.stdout, "\n".join(errors)), imported


def test_validate_default_imports_no_torch_ray_or_mlflow(tmp_path):
    first, _ = validate("configs/default.yaml", tmp_path)  # may build the architectures: a cold verdict cache
    second, imported = validate("configs/default.yaml", tmp_path)
    assert first.returncode == second.returncode == 0, first.stderr + second.stderr
    assert second.stdout == first.stdout and ": ok: 154 cells, " in second.stdout  # counts: test_validate_counts_the_cells_plan_expands
    assert "orchestrator" in imported and "yaml" in imported  # -X importtime did record the imports
    assert not imported & set(HEAVY), sorted(imported & set(HEAVY))


def test_a_combination_only_the_architecture_refuses_is_one_line_cached_or_not(tmp_path):
    spec = tmp_path / "bad.yaml"
    spec.write_text("name: bad\nmodels: [resnet_digits]\nsparsities: [0.5]\ncalib_sizes: [64]\npruners: [magnitude]\n"
                    "healers: [corp]\n")
    cold, cold_imports = validate(spec, tmp_path / "checks")
    warm, warm_imports = validate(spec, tmp_path / "checks")
    line = ("healsweep: error: healers[0].name: healer 'corp' with pruner 'magnitude' on model 'resnet_digits': healer "
            "'corp' compensates structured units of pruner 'corp' masks; pruner 'magnitude' does not produce them")
    assert (cold.returncode, cold.stderr.strip()) == (warm.returncode, warm.stderr.strip()) == (2, line)
    assert "torch" in cold_imports  # deciding it builds the architecture once ...
    assert not warm_imports & set(HEAVY)  # ... then its verdict is reused without torch


def test_an_unknown_method_lists_the_live_names(tmp_path):
    spec = tmp_path / "typo.yaml"
    spec.write_text("name: typo\nmodels: [vit_digits]\nsparsities: [0.5]\ncalib_sizes: [64]\npruners: [magnitud]\n"
                    "healers: [starfish]\n")
    p, _ = validate(spec, tmp_path / "checks")
    assert p.returncode == 2 and p.stderr.strip().startswith(
        "healsweep: error: pruners[0].name: unknown pruner 'magnitud'; allowed: corp, erk, global, global_magnitude")


CONFIGS = sorted((REPO / "configs").glob("*.yaml"))


@pytest.mark.parametrize("config", CONFIGS, ids=[c.stem for c in CONFIGS])
def test_validate_counts_the_cells_plan_expands(config, monkeypatch, tmp_path):
    """Cell by cell (grid, whether its healer trains, whether the draws re-evaluate it), in plan.expand_cells'
    order."""
    from dataclasses import asdict

    from orchestrator.search.records import redrawn_cell
    from orchestrator.spec.plan import expand_cells
    from tasks.healing import resolve_healer

    monkeypatch.setenv("HEALSWEEP_CHECK_CACHE", str(tmp_path))
    try:
        spec = load_spec(config)
    except SpecError as e:
        pytest.skip(f"{config.name} does not validate on this machine: {e}")
    want = [(c.grid, resolve_healer(c.healer, c.healer_settings).trains, redrawn_cell(asdict(c)))
            for c in expand_cells(spec, defaultdict(str))]
    assert [(g, h.trains, d) for g, h, d in cell_grids(spec)] == want


@pytest.mark.parametrize("search, healers, want", [
    ({"design": "grid", "lattice": [3, 2], "trials_per_cell": 4, "reevaluate": 0}, ["starfish"],
     "ok: 1 cell, 6 trials (design 'grid' runs all 6 lattice points of a cell (search.lattice 3 x 2); "
     "search.trials_per_cell 4 is not used)"),
    ({"design": "grid", "lattice": [2, 2], "trials_per_cell": 4, "reevaluate": 0}, ["starfish"], "ok: 1 cell, 4 trials"),
    # epochs [3, 4] on 5 points is 2 values: 10 trials ran 4 distinct configurations, each 2-3 times
    ({"design": "grid", "lattice": [2, 5], "epochs": [3, 4], "trials_per_cell": 3, "reevaluate": 0}, ["starfish"],
     "ok: 1 cell, 4 trials (design 'grid' runs all 4 lattice points of a cell (search.lattice 2 x 5: its distinct "
     "points); search.trials_per_cell 3 is not used)"),
    ({"trials_per_cell": 2, "reevaluate": 0, "widen": {"rounds": 2, "factor": 4}}, ["starfish"],
     "ok: 1 cell, 2 trials (search.widen: up to 2 more round(s) of trials for the cells whose winner sits on the "
     "search boundary, not counted here)"),
    ({"trials_per_cell": 2, "reevaluate": 0, "startup_trials": 2}, ["starfish"],
     "ok: 1 cell, 2 trials (search.startup_trials (TPE's random trials) is not used by design 'shared')"),
    ({"trials_per_cell": 1, "reevaluate": 0}, ["none"], "ok: 1 cell, 1 trial (1 cell whose healer does not train "
                                                         "runs 1 trial)"),
    ({"trials_per_cell": 2, "reevaluate": 2, "calib_draws": 2}, ["starfish"], "ok: 1 cell, 4 trials (re-evaluations "
     "heal on 2 other calibration draw(s), each with its own dense targets and, for pruners that read images, masks)"),
    ({"trials_per_cell": 2, "reevaluate": 3, "calib_draws": 2}, ["crbn", "none"], "ok: 2 cells, 4 trials (2 cells whose "
     "healer does not train run 1 trial, 1 of them also once on each of their grid's other calibration draws (it can "
     "change them); re-evaluations heal on 2 other calibration draw(s), each with its own dense targets and, for pruners that read "
     "images, masks)"),  # CR+BN: 1 + 2 (not 3: each draw once); none: 1
])
def test_validate_says_what_it_counts_in_words_that_fit(tmp_path, search, healers, want):
    """"1 cells, 1 trials" read wrong, and design 'grid' dropped trials_per_cell without a word (it runs every lattice
    point: the count was right, the spec's number silently unused)."""
    import yaml


    spec = tmp_path / "s.yaml"
    spec.write_text(yaml.safe_dump({"name": "v", "models": ["vit_digits"], "sparsities": [0.9], "calib_sizes": [64],
                                    "pruners": ["magnitude"], "healers": healers, "search": search}))
    r = validate(spec, tmp_path / "cache")[0]
    assert r.returncode == 0 and r.stdout.strip() == f"{spec}: {want}", (r.stdout, r.stderr[-2000:])
