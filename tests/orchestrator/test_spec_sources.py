"""Spec syntax for model sources and dataset settings; the GPU configs parse and hand the right load arguments to
the workers. Their pruners and healers are replaced by magnitude/starfish here: these tests are about model sources
and datasets (the shipped configs' methods are validated by test_spec.py::test_shipped_configs_validate)."""
from __future__ import annotations

import copy
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


@pytest.mark.parametrize("changes, field, words", [
    ({"models": [{"name": "deit_tiny_patch16_224"}]}, "models[0]", "needs an image dataset, not the digits"),
    ({"models": [{"name": "x", "source": "timm", "arch": "nope_net"}], "dataset": "cifar10"}, "models[0]",
     "'nope_net' is not a timm model name"),
    ({"models": ["vit_digits", {"name": "vit_digits"}]}, "models[1].name", "listed twice"),
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

    save_file(timm.create_model("resnet18", pretrained=False, num_classes=10).state_dict(), str(tmp_path / "r.safetensors"))
    d = {**copy.deepcopy(TINY), "dataset": {"name": "imagefolder", "root": str(tmp_path), "sizes": {"calibration": 300}},
         "models": [{"name": "r18", "source": "checkpoint", "arch": "resnet18", "num_classes": 10,
                     "path": str(tmp_path / "r.safetensors")}], "offline": True}
    spec = parse_spec(d)
    as_json = lambda s: json.loads(json.dumps(s.to_dict(), default=list))  # noqa: E731 - as in sweep.json
    again = parse_spec(as_json(spec))
    assert again.load_kwargs("r18") == spec.load_kwargs("r18") and again.offline
    assert parse_spec(as_json(parse_spec(TINY))).models == ("vit_digits",)
