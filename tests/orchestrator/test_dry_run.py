"""``healsweep run --dry-run``'s spec rewrite (orchestrator/spec/dry_run.py): the recipe's architectures, scopes,
sparsities, pruners and healers, with random-init weights, generated data and tiny sizes; the rewritten spec passes
every check of a real one. The dry runs themselves: tests/e2e/test_recipes.py."""
from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from orchestrator.spec.plan import expand_cells
from orchestrator.spec import parse_spec
from orchestrator.spec.dry_run import DRY_CALIB, DRY_SIZES, dry_run_spec, input_size, random_init
from tasks.data.synthetic import write_image_folder

REPO = Path(__file__).resolve().parents[2]


def _recipe(name: str) -> dict:
    return yaml.safe_load((REPO / "configs" / f"{name}.yaml").read_text())


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> str:
    return str(write_image_folder(tmp_path_factory.mktemp("dry") / "data", num_classes=10, per_class=2, size=8))


def test_the_deit_recipe_keeps_its_grid_with_random_weights_and_generated_data(folder):
    raw = _recipe("deit_imagenet_starfish")
    spec = parse_spec(dry_run_spec(raw, folder))
    assert spec.name == "deit_imagenet_starfish-dry-run" and spec.offline
    assert spec.models == tuple(m["name"] for m in raw["models"]) and spec.scope == raw["scope"]
    for m in raw["models"]:
        ref = spec.model_refs[m["name"]]
        assert (ref["source"], ref["arch"], ref["pretrained"], ref["weights"]) == ("timm", m["arch"], False, None)
    assert spec.dataset == "imagefolder" and spec.dataset_settings == {"root": folder, "sizes": DRY_SIZES}
    assert spec.sparsities == (0.5,) and spec.calib_sizes == (DRY_CALIB,) and spec.seeds == (0,)
    assert [p.name for p in spec.pruners] == ["corp"] and spec.pruners[0].settings == {"rank": "activation"}
    assert [h.name for h in spec.healers] == ["corp", "starfish", "corp+starfish"]
    assert spec.healers[1].settings == raw["healers"][1]["settings"]  # the recipe's method settings
    s = spec.search
    assert (s.trials_per_cell, s.epochs, s.reevaluate, s.lr, s.objective) == (1, (1, 1), 0, (6e-4, 6e-4),
                                                                              "selection_acc")
    r = spec.resources
    assert (r.gpus_per_trial, r.gpus_per_dense_task, r.cpus_per_trial, r.max_failures) == (0, 0, 1, 0)
    assert spec.store.uri is None and spec.store.shard_size == DRY_CALIB and spec.mlflow.tracking_uri is None
    assert spec.heal.batch_size == DRY_CALIB and spec.heal.lr_min == 1e-6 and spec.heal.latency_rounds == 1
    cells = expand_cells(spec, {m: spec.scope[m] for m in spec.models})
    assert len(cells) == 9 * 3  # every model entry x healer, once (the 3 calibration sizes capped to one)
    assert raw == _recipe("deit_imagenet_starfish")  # the caller's mapping is not changed


def test_the_resnet50_recipe_gets_quick_method_settings(folder):
    spec = parse_spec(dry_run_spec(_recipe("resnet50_imagenet_starfish"), folder))
    ref = spec.model_refs["resnet50"]
    assert (ref["source"], ref["arch"], ref["pretrained"], ref["weights"]) == ("torchvision", "resnet50", False, None)
    assert spec.sparsities == (0.5, 0.6, 0.7, 0.8) and [p.name for p in spec.pruners] == ["magnitude", "lamp"]
    crbn = next(h for h in spec.healers if h.name == "crbn")
    assert crbn.settings == {"bn_batches": 2, "bn_batch_size": 8}  # CR+BN's quick_settings, not 20 x 128
    assert len(expand_cells(spec, {"resnet50": "conv"})) == 16


def test_checkpoints_chains_grids_and_the_digits_set():
    raw = {"name": "x", "dataset": {"name": "cifar100", "sizes": {"train": 500, "calibration": 2560}},
           "models": [{"name": "r", "source": "checkpoint", "arch": "torchvision:resnet18", "path": "r.pt",
                       "sha256": "0" * 16, "num_classes": 100}, "resnet34"],
           "sparsities": [0.9], "calib_sizes": [128, 2560], "seeds": [3, 4],
           "pruners": [{"name": "rr", "settings": {"diag_images": 128, "tau": "median"}}],
           "healers": [{"chain": ["crbn", {"name": "starfish", "settings": {"bn": "train"}}]}],
           "grids": [{"name": "g", "calib_sizes": [64], "seeds": [1, 2], "search": {"trials_per_cell": 9,
                                                                                   "steps": [4, 64]}}]}
    d = dry_run_spec(raw, "/data")
    assert d["models"] == [{"name": "r", "source": "torchvision", "arch": "resnet18", "num_classes": 100,
                            "pretrained": False},
                           {"name": "resnet34", "source": "timm", "arch": "resnet34", "pretrained": False}]
    assert d["dataset"] == {"name": "imagefolder", "root": "/data", "sizes": {**DRY_SIZES, "train": DRY_CALIB}}
    assert d["calib_sizes"] == [DRY_CALIB] and d["seeds"] == [3]
    assert d["pruners"] == [{"name": "rr", "settings": {"diag_images": 8, "tau": "median"}}]
    assert d["healers"] == [{"chain": [{"name": "crbn", "settings": {"bn_batches": 2, "bn_batch_size": 8}},
                                       {"name": "starfish", "settings": {"bn": "train"}}]}]
    assert d["grids"] == [{"name": "g", "calib_sizes": [DRY_CALIB], "seeds": [1],
                           "search": {"trials_per_cell": 1, "steps": [2, 2], "reevaluate": 0}}]
    tiny = yaml.safe_load((REPO / "configs" / "tiny.yaml").read_text())
    d = dry_run_spec(tiny, None)  # reference models on the digits set: both kept
    assert d["models"] == ["vit_digits"] and "dataset" not in d and d["calib_sizes"] == [DRY_CALIB]
    assert random_init({"name": "vit_digits", "path": "ckpt.safetensors", "sha256": "0" * 16}) == {"name": "vit_digits"}
    assert parse_spec(d).search.epochs == (1, 1)


def test_input_size_follows_the_models():
    deit = {"models": [{"name": "d", "source": "timm", "arch": "deit_tiny_patch16_224", "pretrained": False}]}
    assert input_size(deit) == 224
    small = {"models": [{"name": "d", "source": "timm", "arch": "deit_tiny_patch16_224", "pretrained": False,
                         "model_args": {"img_size": 64}}, "vit_digits"]}
    assert input_size(small) == 64
    assert input_size({"models": ["vit_digits"]}) == 224  # no external model: the default size


def test_dry_run_flags_are_checked_in_one_line(tmp_path):
    from tests.orchestrator.run_cli import healsweep

    proc = healsweep("run", "--resume", tmp_path, "--dry-run", cwd=tmp_path, timeout=120)
    assert proc.returncode == 2 and proc.stderr.strip() == ("healsweep: error: --resume DIR takes no SPEC, --out or "
                                                            "--dry-run: the sweep's spec and paths are in DIR")
    bad = tmp_path / "bad.yaml"
    bad.write_text((REPO / "configs" / "resnet50_imagenet_starfish.yaml").read_text().replace("name: magnitude ",
                                                                                             "name: magnitud "))
    proc = healsweep("run", bad, "--dry-run", "--out", tmp_path / "run", "--quiet", cwd=tmp_path, timeout=300)
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert "pruners[0]" in proc.stderr and "magnitud" in proc.stderr and "Traceback" not in proc.stderr


def test_a_model_with_fewer_classes_than_ten_can_be_dry_run(tmp_path):
    """The generated folder has no more classes than the smallest ``num_classes`` (it always had 10, so the models
    stage refused a 3-class model: 'has 3 outputs but dataset ... has 10 classes'), and that model then loads with
    it as a real run's models stage loads it."""
    from orchestrator.cli import build_parser
    from orchestrator.commands.run import _dry_run
    from orchestrator.spec.dry_run import DRY_CLASSES, dry_classes
    from tasks.models import load_model

    rn = {"name": "rn", "source": "timm", "arch": "resnet18", "pretrained": False, "num_classes": 3}
    assert dry_classes({"models": [rn]}) == 3 and dry_classes({"models": [{**rn, "num_classes": 1000}]}) == DRY_CLASSES
    assert dry_classes({"models": ["vit_digits", {**rn, "num_classes": True}]}) == DRY_CLASSES  # not a class count
    spec_file = tmp_path / "s.yaml"
    spec_file.write_text(yaml.safe_dump({"name": "three", "models": [rn], "sparsities": [0.5], "calib_sizes": [8],
                                         "pruners": ["magnitude"], "healers": ["starfish"],
                                         "dataset": {"name": "imagefolder", "root": "nowhere-yet"}}))
    args = build_parser().parse_args(["run", str(spec_file), "--dry-run", "--out", str(tmp_path / "run")])
    spec, out = _dry_run(args)
    assert sorted(p.name for p in (out / "data").iterdir()) == ["c000", "c001", "c002"]
    kw = spec.load_kwargs("rn")
    lm = load_model("rn", **kw)  # the models stage's check of outputs against classes passes
    assert lm.dataset.num_classes == 3 and len(lm.dataset["calibration"]) == DRY_CALIB


@pytest.mark.parametrize("search, length", [(None, ("steps", (2, 2))), ({"lr": [1e-3, 1e-2]}, ("steps", (2, 2))),
                                            ({"epochs": [3, 8]}, ("epochs", (1, 1))),
                                            ({"scheduler": "asha", "design": "tpe"}, ("epochs", (1, 1)))])
def test_a_dry_run_shortens_the_length_the_real_run_searches(folder, search, length):
    """A spec without a length searches steps (the default since 2026-12-01): its dry run takes steps too, so that
    it runs what the real run will (it took one epoch, the real run's path for epochs)."""
    raw = yaml.safe_load((REPO / "configs" / "tiny.yaml").read_text())
    raw.pop("search")
    if search is not None:
        raw["search"] = search
    assert parse_spec(raw).search.length[0] == length[0]
    assert parse_spec(dry_run_spec(raw, folder)).search.length == length


def test_a_dry_run_of_a_spec_with_calibration_draws_runs_no_reevaluation_and_no_draw(folder):
    """search.calib_draws needs re-evaluations; a dry run has none (one trial per cell), so it drops the draws
    instead of refusing the spec the real run accepts."""
    raw = yaml.safe_load((REPO / "configs" / "tiny.yaml").read_text())
    raw["search"] = {**raw["search"], "reevaluate": 2, "calib_draws": 2}
    assert parse_spec(raw).search.calib_draws == 2
    dry = parse_spec(dry_run_spec(raw, folder)).search
    assert (dry.reevaluate, dry.calib_draws) == (0, 0)


TINY = yaml.safe_load((REPO / "configs" / "tiny.yaml").read_text())


@pytest.mark.parametrize("change, error", [
    ({"heal": {"batch_size": "abc"}}, "heal.batch_size: must be an integer, got 'abc'"),
    ({"seeds": [0, -1]}, "seeds[1]: must be >= 0, got -1"),
    ({"calib_sizes": [128, "abc"]}, "calib_sizes[1]: must be an integer, got 'abc'"),
    ({"resources": {"cpus_per_trial": -1}}, "resources.cpus_per_trial: must be > 0.0, got -1"),
    ({"search": {**TINY["search"], "design": "foo"}}, "search.design: must be one of shared, tpe, grid, got 'foo'"),
    ({"grids": [{"name": "g", "seeds": 5}]}, "grids[0].seeds: must be a non-empty list, got 5"),
    ({"grids": [{"name": "g", "seeds": [0, -1]}]}, "grids[0].seeds[1]: must be >= 0, got -1"),
    ({"grids": [{"name": "g", "search": {"trials_per_cell": -3}}]}, "grids[0].search.trials_per_cell: must be >= 1"),
])
def test_a_dry_run_refuses_what_its_real_run_refuses_before_the_rewrite(change, error):
    """The rewrite replaces seeds, calibration sizes, search, heal and resources: a dry run used to pass specs its
    real run refuses (or end in a traceback reading them). The spec as written gets the real run's plain checks."""
    from orchestrator.spec import SpecError
    from orchestrator.spec.dry_run import check_recipe

    with pytest.raises(SpecError) as e:
        check_recipe({**TINY, **change}, REPO / "configs")
    assert str(e.value).startswith(error), str(e.value)
    check_recipe(TINY, REPO / "configs")  # the recipe as shipped passes
    for spec in sorted((REPO / "configs").glob("*.yaml")):  # and every shipped one
        check_recipe(yaml.safe_load(spec.read_text()), spec.parent)


def test_a_bad_spec_given_to_run_dry_run_is_one_line(tmp_path):
    from tests.orchestrator.run_cli import healsweep

    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump({**TINY, "grids": [{"name": "g", "seeds": 5}]}))
    proc = healsweep("run", bad, "--dry-run", "--out", tmp_path / "run", "--quiet", cwd=tmp_path, timeout=120)
    assert proc.returncode == 2 and proc.stderr.strip() == ("healsweep: error: grids[0].seeds: must be a non-empty "
                                                            "list, got 5"), proc.stderr
    assert not (tmp_path / "run").exists()
