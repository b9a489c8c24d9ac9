"""Spec syntax for model sources and dataset settings; the GPU configs parse and hand the right load arguments to
the workers. Their pruners and healers are replaced by magnitude/starfish here: these tests are about model sources
and datasets (the shipped configs' methods are validated by test_spec.py::test_shipped_configs_validate)."""
from __future__ import annotations

import copy
import re
import json
from pathlib import Path

import pytest
import yaml

from orchestrator.spec import SpecError, parse_spec

REPO = Path(__file__).resolve().parents[2]
TINY = yaml.safe_load((REPO / "configs" / "tiny.yaml").read_text())


def _with_registered_methods(raw: dict) -> dict:
    d = copy.deepcopy(raw)
    d["pruners"], d["healers"] = ["magnitude"], ["starfish"]
    return d


def test_deit_imagenet_config_parses():
    raw = _with_registered_methods(yaml.safe_load((REPO / "configs" / "deit_imagenet_starfish.yaml").read_text()))
    spec = parse_spec(raw)  # builds each DeiT untrained (no download) to check its scope
    assert len(spec.models) == 9 and spec.scope["deit_base-qk_mlp"] == "qk_mlp" and spec.calib_sizes == (1000, 2500, 5000)
    kw = spec.load_kwargs("deit_small-qk")
    assert kw["source"]["source"] == "timm" and kw["source"]["arch"] == "deit_small_patch16_224" and kw["source"]["pretrained"]
    assert kw["dataset"]["name"] == "imagenet1k" and kw["dataset"]["sizes"]["evaluation"] == 50000
    assert spec.search.lr == (6e-4, 6e-4) and spec.search.epochs == (10, 10) and spec.heal.batch_size == 32


def test_resnet_cifar_config_parses_with_a_local_checkpoint(tmp_path):
    import timm
    from safetensors.torch import save_file

    raw = _with_registered_methods(yaml.safe_load((REPO / "configs" / "resnet_cifar_rr.yaml").read_text()))
    m = timm.create_model("resnet18", pretrained=False, num_classes=100)
    save_file(m.state_dict(), str(tmp_path / "r18.safetensors"))
    raw["models"][0]["path"] = str(tmp_path / "r18.safetensors")
    spec = parse_spec(raw)
    assert spec.models == ("resnet18_cifar100",) and spec.dataset == "cifar100" and spec.calib_sizes == (2560,)
    assert spec.load_kwargs("resnet18_cifar100")["source"]["path"] == str(tmp_path / "r18.safetensors")


def test_reference_models_keep_their_path():
    spec = parse_spec(TINY)
    assert spec.load_kwargs("vit_digits") == {} and spec.model_refs["vit_digits"]["source"] == "reference"


def test_calib_seed_reaches_every_model_load_and_survives_sweep_json():
    spec = parse_spec({**copy.deepcopy(TINY), "calib_seed": 4})
    assert spec.calib_seed == 4 and spec.load_kwargs("vit_digits") == {"calib_seed": 4}
    again = parse_spec(json.loads(json.dumps(spec.to_dict(), default=list)))  # what resume and refine read back
    assert again == spec and again.grids == spec.grids
    external = parse_spec({**copy.deepcopy(TINY), "calib_seed": 4, "dataset": "cifar10", "models": [{"name": "resnet18"}]})
    kw = external.load_kwargs("resnet18")
    assert kw["calib_seed"] == 4 and kw["source"]["source"] == "timm"
    assert parse_spec(TINY).calib_seed == 0
    for bad, words in ((-1, "calib_seed: must be >= 0"), (1.5, "calib_seed: must be an integer"),
                       ("x", "calib_seed: must be an integer")):
        with pytest.raises(SpecError, match=words):
            parse_spec({**copy.deepcopy(TINY), "calib_seed": bad})


@pytest.mark.parametrize("changes, field, words", [
    ({"models": [{"name": "deit_tiny_patch16_224"}]}, "models[0]", "needs an image dataset, not the digits"),
    ({"models": [{"name": "x", "source": "timm", "arch": "nope_net"}], "dataset": "cifar10"}, "models[0]",
     "'nope_net' is not a timm model name"),
    ({"models": ["vit_digits", {"name": "vit_digits"}]}, "models[1].name", "listed twice"),
    ({"models": [{"name": "vit_digits", "sorce": "timm"}]}, "models[0].sorce", "unknown key; allowed: name, source"),
    ({"models": [{"name": "resnet18", "pretrained": "yes"}], "dataset": "cifar10"}, "models[0].pretrained",
     "must be true or false, got 'yes'"),
    ({"models": [{"name": "vit_digits", "sha256": "zz"}]}, "models[0].sha256", "must be 16 to 64 hex characters"),
    ({"models": [{"name": "vit_digits", "weights": "x"}]}, "models[0].weights", "not a setting of reference models"),
    ({"models": [{"name": "a", "source": "hub"}]}, "models[0].source", "unknown model source 'hub'"),
    ({"dataset": {"name": "imagefolder"}}, "dataset", "root: required for a folder dataset"),
    ({"dataset": {"name": "cifar10", "sizes": {"calibration": 64}}, "models": ["resnet18"]}, "calib_sizes[0]",
     "must be <= 64"),
    ({"dataset": {"name": "digits", "root": "x"}}, "dataset.root", "takes no settings"),
    ({"offline": "yes"}, "offline", "must be true or false"),
    ({"dataset": {"name": "imagefolder", "root": "/nonexistent/images"}}, "dataset",
     "root: image folder '/nonexistent/images' does not exist"),
    ({"models": [{"name": "cx", "source": "timm", "arch": "convnext_atto", "pretrained": False}], "dataset": "cifar10"},
     "models[0]", "model 'cx': no adapter for architecture timm.models.convnext.ConvNeXt"),
    ({"models": [{"name": "r", "source": "timm", "arch": "resnet18", "pretrained": False, "model_args": {"depth": 2}}],
      "dataset": "cifar10"}, "models[0]", "timm could not create 'resnet18': ResNet.__init__() got an unexpected"),
])
def test_bad_source_entries_name_the_field(changes, field, words):
    d = {**copy.deepcopy(TINY), **changes}
    with pytest.raises(SpecError) as e:
        parse_spec(d)
    assert e.value.path == field and words in str(e.value) and "\n" not in str(e.value)


def test_offline_setting_reaches_the_model_refs():
    d = {**copy.deepcopy(TINY), "offline": True, "dataset": "cifar10", "models": [{"name": "resnet18"}]}
    spec = parse_spec(d)
    assert spec.offline and spec.load_kwargs("resnet18")["source"]["offline"] is True


def test_to_dict_round_trip_keeps_sources_and_dataset_settings(tmp_path):
    """sweep.json holds spec.to_dict(); refine rounds parse it again."""
    import timm
    from safetensors.torch import save_file

    from tasks.data.synthetic import write_image_folder

    save_file(timm.create_model("resnet18", pretrained=False, num_classes=10).state_dict(), str(tmp_path / "r.safetensors"))
    root = write_image_folder(tmp_path / "images", num_classes=10, per_class=40, size=8)  # 400 images
    d = {**copy.deepcopy(TINY), "dataset": {"name": "imagefolder", "root": str(root), "sizes": {"calibration": 300}},
         "models": [{"name": "r18", "source": "checkpoint", "arch": "resnet18", "num_classes": 10,
                     "path": str(tmp_path / "r.safetensors")}], "offline": True}
    spec = parse_spec(d)
    as_json = lambda s: json.loads(json.dumps(s.to_dict(), default=list))  # noqa: E731 - as in sweep.json
    again = parse_spec(as_json(spec))
    assert again.load_kwargs("r18") == spec.load_kwargs("r18") and again.offline
    assert parse_spec(as_json(parse_spec(TINY))).models == ("vit_digits",)


def test_relative_local_paths_are_taken_from_the_spec_files_directory(tmp_path, monkeypatch):
    """A checkpoint ``path`` and a dataset's ``root`` / ``path`` written relative to the spec file name files
    beside it, from any working directory, and reach the workers absolute (a trial runs in its own Tune
    directory: a relative path there named nothing and every trial failed). A hub id stays a hub id; ``~`` is
    the user's home."""
    import timm
    from safetensors.torch import save_file

    from orchestrator.spec import load_spec
    from tasks.data.synthetic import write_hf_dataset, write_image_folder, write_image_table

    here = tmp_path / "project" / "specs"
    write_image_folder(here / "images", num_classes=10, per_class=20, size=8)  # 200 >= 64 + 32 + 64
    write_image_table(here / "t.parquet", num_classes=10, per_class=20, size=8)
    write_hf_dataset(here / "hf", num_classes=10, per_class=20, size=8)
    save_file(timm.create_model("resnet18", pretrained=False, num_classes=10).state_dict(), str(here / "r.safetensors"))
    entry = {"name": "r18", "source": "checkpoint", "arch": "resnet18", "num_classes": 10, "path": "r.safetensors"}
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    monkeypatch.setenv("HOME", str(tmp_path / "project"))

    def parsed(dataset: dict):
        p = here / "s.yaml"
        p.write_text(yaml.safe_dump({**copy.deepcopy(TINY), "models": [entry], "dataset": dataset, "calib_sizes": [64]}))
        return load_spec(p)

    spec = parsed({"name": "imagefolder", "root": "images"})
    assert spec.load_kwargs("r18")["source"]["path"] == str(here / "r.safetensors")
    assert spec.dataset_settings["root"] == str(here / "images")
    assert parsed({"name": "imagefolder", "root": "~/specs/images"}).dataset_settings["root"] == str(here / "images")
    assert parsed({"name": "image_table", "path": "t.parquet"}).dataset_settings["path"] == str(here / "t.parquet")
    assert parsed({"name": "hf", "path": "hf"}).dataset_settings["path"] == str(here / "hf")
    assert parsed({"name": "hf", "path": "uoft-cs/cifar10"}).dataset_settings["path"] == "uoft-cs/cifar10"
    with pytest.raises(SpecError, match=rf"root: image folder '{re.escape(str(here / 'nope'))}' does not exist"):
        parsed({"name": "imagefolder", "root": "nope"})  # the message names the path it looked at


def test_ce_on_an_image_dataset_without_a_train_split_is_refused(tmp_path):
    """``ce`` trains on the labeled train split; an image dataset's default gives it 0 images. It was accepted and
    every ce trial 'finished' with 0 optimizer steps, quoted as a healed result (= the pruned model)."""
    from tasks.data.synthetic import write_image_folder

    root = write_image_folder(tmp_path / "images", num_classes=10, per_class=20, size=8)  # 200 images
    d = {**copy.deepcopy(TINY), "models": [{"name": "r18", "source": "timm", "arch": "resnet18", "pretrained": False,
                                            "num_classes": 10}], "calib_sizes": [64], "healers": ["ce"],
         "dataset": {"name": "imagefolder", "root": str(root)}}
    with pytest.raises(SpecError) as e:
        parse_spec(d)
    assert e.value.path == "healers[0]" and "gives it none: set dataset.sizes.train" in str(e.value)
    d["dataset"]["sizes"] = {"train": 16}
    assert parse_spec(d).healers[0].name == "ce"


@pytest.mark.parametrize("source", ["imagefolder", "image_table"])
def test_a_model_with_fewer_outputs_than_the_local_datasets_classes_is_refused(tmp_path, source):
    """Counted from the class folders or the label column before any work (it was refused by the models stage,
    after Ray had started)."""
    from tasks.data.synthetic import write_image_folder, write_image_table

    if source == "imagefolder":
        dataset = {"name": source, "root": str(write_image_folder(tmp_path / "f", num_classes=4, per_class=40, size=8))}
    else:
        dataset = {"name": source, "path": str(write_image_table(tmp_path / "t.parquet", num_classes=4, per_class=40,
                                                                size=8))}
    model = {"name": "r18", "source": "timm", "arch": "resnet18", "pretrained": False, "num_classes": 3}
    d = {**copy.deepcopy(TINY), "models": [model], "calib_sizes": [64], "dataset": dataset}
    with pytest.raises(SpecError) as e:
        parse_spec(d)
    assert e.value.path == "models[0]" and str(e.value).endswith(
        f"model 'r18' has 3 outputs but dataset '{source}' has 4 classes; set num_classes: 4 on the model entry")
    d["models"] = [{**model, "num_classes": 4}]
    assert parse_spec(d).models == ("r18",)
