"""Spec validation: every bad input is a one-line error naming the field, exit code 2, nothing started."""
from __future__ import annotations

import copy
from pathlib import Path

import pytest
import yaml

from orchestrator.cli import main
from orchestrator.spec import SpecError, load_spec, parse_spec

REPO = Path(__file__).resolve().parents[2]
BASE = yaml.safe_load((REPO / "configs" / "tiny.yaml").read_text())


def spec_with(**changes):
    d = copy.deepcopy(BASE)
    for dotted, value in changes.items():
        node, *path = dotted.split("__")
        target = d
        for p in [node, *path][:-1]:
            target = target.setdefault(p, {})
        last = [node, *path][-1]
        if value is KeyError:
            target.pop(last, None)
        else:
            target[last] = value
    return d


def _unavailable(raw: dict, where: Path) -> list[str]:
    """What a shipped config (in the folder ``where``) needs that this checkout lacks: unregistered methods, the
    user's checkpoint files (a relative path is taken from the spec file's folder)."""
    from tasks.healing import HEALERS
    from tasks.pruning import PRUNERS

    out = []
    for key, reg in (("pruners", PRUNERS), ("healers", HEALERS)):
        for m in raw[key]:
            parts = m["chain"] if isinstance(m, dict) and "chain" in m else [m]  # a chain names several healers
            for part in parts:
                name = part if isinstance(part, str) else part["name"]
                out += [f"{key[:-1]} {name!r}"] if name not in reg else []
    for m in raw["models"]:
        if isinstance(m, dict) and m.get("source") == "checkpoint" and not (where / m["path"]).is_file():
            out.append(f"checkpoint {m['path']}")
    return out


@pytest.mark.parametrize("path", sorted((REPO / "configs").glob("*.yaml")), ids=lambda p: p.name)
def test_shipped_configs_validate(path):
    missing = _unavailable(yaml.safe_load(path.read_text()), path.parent)
    if missing:
        with pytest.raises(SpecError):  # rejected before any work, naming what is missing
            load_spec(path)
        pytest.skip(f"{path.name} needs {', '.join(missing)}")
    spec = load_spec(path)
    assert spec.models and spec.pruners and spec.healers, path


def test_an_unknown_top_level_key_is_offered_only_keys_a_user_writes():
    """The allowed list names what a spec may hold; the tool's own fields (cells, model_refs, dataset_settings)
    are not offered, and `cells` (a widening round's spec) is still accepted."""
    with pytest.raises(SpecError) as e:
        parse_spec({**BASE, "modles": []})
    allowed = str(e.value).split("allowed: ")[1].split(", ")
    assert e.value.path == "modles" and "models" in allowed and "sparsities" in allowed
    assert not {"cells", "model_refs", "dataset_settings"} & set(allowed)


def test_defaults_fill_in():
    s = parse_spec(BASE)
    assert s.seeds == (0,) and s.heal.batch_size == 32 and s.heal.lr_min == 1e-6 and s.store.dtype == "float16"
    assert s.search.lr == (1e-3, 3e-3) and s.search.epochs == (3, 5)


@pytest.mark.parametrize("changes, field, words", [
    ({"models": ["resnet99"]}, "models[0]", "unknown model 'resnet99'; allowed: resnet_digits, vit_digits"),
    ({"pruners": ["random"]}, "pruners[0].name", "unknown pruner 'random'; allowed: corp, erk, global, global_magnitude, lamp, magnitude"),
    ({"healers": ["magic"]}, "healers[0].name", "unknown healer 'magic'"),
    ({"colour": "red"}, "colour", "unknown key"),
    ({"search__tpe": 3}, "search.tpe", "unknown key"),
    ({"sparsities": [0.5, 1.0]}, "sparsities[1]", "must be < 1.0"),
    ({"sparsities": [-0.1]}, "sparsities[0]", "must be >= 0.0"),
    ({"sparsities": [0.5, 0.9, 0.5]}, "sparsities[2]", "0.5 is listed twice (also at [0])"),
    ({"calib_sizes": [128, 128]}, "calib_sizes[1]", "128 is listed twice (also at [0])"),
    ({"seeds": [3, 1, 3]}, "seeds[2]", "3 is listed twice (also at [0])"),
    ({"pruners": ["magnitude", "lamp", "magnitude"]}, "pruners[2]", "pruner 'magnitude' with these settings is listed twice"),
    ({"pruners": [{"name": "magnitude", "sparsities": [0.7, 0.7]}]}, "pruners[0].sparsities[1]", "listed twice"),
    # the same method once its defaults are filled in (planned twice, or one of them dropped, before)
    ({"pruners": ["nm", {"name": "nm", "settings": {"n": 2, "m": 4}}]}, "pruners[1]",
     "pruner 'nm' with these settings is listed twice (also at [0], the same once its defaults are filled in)"),
    ({"pruners": [{"name": "erk", "settings": {"cap": 1.0}}, {"name": "erk", "settings": {"floor": 0.025}}]},
     "pruners[1]", "the same once its defaults are filled in"),
    ({"healers": ["starfish", {"name": "starfish", "settings": {"granularity": "auto", "bn": "train"}}]}, "healers[1]",
     "healer 'starfish' with these settings is listed twice (also at [0], the same once its defaults are filled in)"),
    ({"healers": [{"chain": ["mse", "starfish"]}, {"chain": ["mse", {"name": "starfish", "settings": {
        "granularity": "auto"}}]}]}, "healers[1]", "healer 'mse+starfish' with these settings is listed twice"),
    ({"healers": [{"chain": ["mse", {"name": "starfish", "settings": {"bn": "train", "granularity": "auto"}}]},
                  {"chain": ["mse", {"name": "starfish", "settings": {"granularity": "auto", "bn": "train"}}]}]},
     "healers[1]", "healer 'mse+starfish' with these settings is listed twice"),
    ({"grids": [{"name": "g", "seeds": [0, 0]}]}, "grids[0].seeds[1]", "0 is listed twice (also at [0])"),
    ({"sparsities": ["high"]}, "sparsities[0]", "must be a number"),
    ({"pruners": [{"name": "nm", "settings": {"n": 4, "m": 4}}]}, "pruners[0].settings", "0 < n < m"),
    ({"pruners": [{"name": "nm", "settings": {"k": 4}}]}, "pruners[0].settings", "unknown setting 'k'"),
    ({"pruners": [{"name": "nm", "settings": {"n": 2, "m": 7}}]}, "pruners[0].settings.m", "does not divide"),
    ({"calib_sizes": [128, 321]}, "calib_sizes[1]", "must be <= 320"),
    ({"calib_sizes": [0]}, "calib_sizes[0]", "must be >= 1"),
    ({"search__lr": [0.0, 1e-3]}, "search.lr[0]", "must be > 0.0"),
    ({"search__lr": [-1e-3, 1e-3]}, "search.lr[0]", "must be > 0.0"),
    ({"search__lr": [1e-2, 1e-3]}, "search.lr[1]", "must be >= 0.01"),
    ({"search__epochs": [0, 3]}, "search.epochs[0]", "must be >= 1"),
    ({"search__trials_per_cell": 0}, "search.trials_per_cell", "must be >= 1"),
    ({"healers": [{"name": "starfish", "settings": {"granularity": "pixel"}}]}, "healers[0].settings",
     "must be one of ('auto', 'token', 'example')"),
    ({"scope": {"vit_digits": "conv"}}, "scope.vit_digits", "scope 'conv' is not defined"),
    ({"scope": {"resnet_digits": "conv"}}, "scope.resnet_digits", "not a model of this sweep"),
    ({"store__dtype": "float32"}, "store.dtype", "must be float16 or bfloat16"),
    ({"models": KeyError}, "models", "required key is missing"),
    ({"dataset": "imagenet-22k"}, "dataset", "unknown dataset"),
])
def test_bad_input_names_the_field(changes, field, words):
    with pytest.raises(SpecError) as e:
        parse_spec(spec_with(**changes))
    msg = str(e.value)
    assert e.value.path == field
    assert msg.startswith(field + ": ") and words in msg and "\n" not in msg


def test_malformed_yaml(tmp_path):
    p = tmp_path / "bad.yaml"
    p.write_text("name: x\nmodels: [vit_digits\n")
    with pytest.raises(SpecError, match=r"malformed YAML at line \d+, column \d+"):
        load_spec(p)


def test_yaml_is_loaded_safely(tmp_path):
    p = tmp_path / "evil.yaml"
    p.write_text("name: !!python/object/apply:os.system ['echo pwned']\n")
    with pytest.raises(SpecError, match="malformed YAML"):
        load_spec(p)


def test_cli_bad_spec_exits_2_and_starts_nothing(tmp_path, capsys):
    import ray

    p = tmp_path / "bad.yaml"
    p.write_text(yaml.safe_dump(spec_with(sparsities=[0.5, 1.5])))
    out = tmp_path / "run"
    code = main(["run", str(p), "--out", str(out), "--store", str(tmp_path / "store")])
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert err == "healsweep: error: sparsities[1]: must be < 1.0, got 1.5"
    assert not out.exists() and not (tmp_path / "store").exists()
    assert not ray.is_initialized()


def test_cli_validate_counts_cells(capsys):
    assert main(["validate", str(REPO / "configs" / "default.yaml")]) == 0
    # main grid: ((6 magnitude + 2:4) x 2 models + CORP on the ViT + 5 allocation rules x 2 sparsities on the
    # ResNet) x 2 calib x 2 healers = 100 cells; grid `healers`: 3 sparsities x 6 healers x 3 seeds = 54 cells
    # search.calib_draws 2: the searched cells' re-evaluations move onto the draws (no trial added); the 50 CR+BN
    # cells (main grid) read the calibration images and heal once on each draw too (+100); the 9 `none` cells of
    # grid `healers` (magnitude masks) read none: 1 trial each
    assert "154 cells, 634 trials (59 cells whose healer does not train run 1 trial, 50 of them also once on each " \
           "of their grid's other calibration draws (it can change them); re-evaluations heal on 2 other " \
           "calibration draw(s)" in capsys.readouterr().out


def test_cli_report_on_non_run_dir(tmp_path, capsys):
    assert main(["report", str(tmp_path)]) == 2
    assert "no sweep in" in capsys.readouterr().err


def test_method_entries_can_be_restricted_to_models_sparsities_and_scope(capsys, tmp_path):
    from orchestrator.spec.plan import expand_cells

    d = spec_with(models=["vit_digits", "resnet_digits"], sparsities=[0.5, 0.9], calib_sizes=[128],
                  pruners=["magnitude",
                           {"name": "corp", "models": ["vit_digits"], "sparsities": [0.25], "scope": "mlp_qk"},
                           {"name": "erk", "models": ["resnet_digits"], "sparsities": [0.95]}],
                  healers=["starfish", {"name": "none", "models": ["resnet_digits"]}])
    spec = parse_spec(d)
    cells = expand_cells(spec, {"vit_digits": "qkv_out_mlp", "resnet_digits": "conv"})
    got = sorted((c.model, c.pruner, c.sparsity, c.scope, c.healer) for c in cells)
    assert got == sorted([
        ("vit_digits", "magnitude", 0.5, "qkv_out_mlp", "starfish"), ("vit_digits", "magnitude", 0.9, "qkv_out_mlp", "starfish"),
        ("vit_digits", "corp", 0.25, "mlp_qk", "starfish"),
        ("resnet_digits", "magnitude", 0.5, "conv", "starfish"), ("resnet_digits", "magnitude", 0.9, "conv", "starfish"),
        ("resnet_digits", "magnitude", 0.5, "conv", "none"), ("resnet_digits", "magnitude", 0.9, "conv", "none"),
        ("resnet_digits", "erk", 0.95, "conv", "starfish"), ("resnet_digits", "erk", 0.95, "conv", "none")])
    p = tmp_path / "s.yaml"
    p.write_text(yaml.safe_dump(d))
    assert main(["validate", str(p)]) == 0
    # 9 cells: 6 starfish cells x 2 trials + 3 `none` cells x 1 trial
    assert "9 cells, 15 trials (3 cells whose healer does not train run 1 trial)" in capsys.readouterr().out


@pytest.mark.parametrize("entry, field, words", [
    ({"name": "corp", "models": ["resnet_digits"]}, "pruners[0].models[0]", "not a model of this sweep"),
    ({"name": "corp", "scope": "conv"}, "pruners[0].scope", "scope 'conv' is not defined"),
    ({"name": "corp", "scope": "qkv_out_mlp"}, "pruners[0].name", "pruner 'corp' cannot serve model 'vit_digits'"),
    ({"name": "magnitude", "sparsities": [1.0]}, "pruners[0].sparsities[0]", "must be < 1.0"),
    # N:M is its pattern: the list was accepted and ignored (the sweep ran 2:4 = 0.5, not 0.9)
    ({"name": "nm", "sparsities": [0.9]}, "pruners[0].sparsities",
     "pruner 'nm' prunes to a fixed sparsity (0.5 with these settings); leave sparsities out"),
    ({"name": "nm", "settings": {"n": 1, "m": 4}, "sparsities": [0.75]}, "pruners[0].sparsities", "(0.75 with these"),
])
def test_restricted_entries_are_validated(entry, field, words):
    with pytest.raises(SpecError) as e:
        parse_spec(spec_with(pruners=[entry]))
    assert e.value.path == field and words in str(e.value)


def test_healer_entries_take_no_pruner_keys():
    with pytest.raises(SpecError) as e:
        parse_spec(spec_with(healers=[{"name": "starfish", "sparsities": [0.5]}]))
    assert e.value.path == "healers[0].sparsities" and "unknown key" in str(e.value)


def test_a_method_with_other_settings_than_its_defaults_is_another_entry():
    s = parse_spec(spec_with(pruners=["nm", {"name": "nm", "settings": {"n": 1, "m": 4}}],
                             healers=["starfish", {"name": "starfish", "settings": {"granularity": "token"}}]))
    assert [(p.name, p.settings) for p in s.pruners] == [("nm", {}), ("nm", {"n": 1, "m": 4})]
    assert [h.settings for h in s.healers] == [{}, {"granularity": "token"}]
