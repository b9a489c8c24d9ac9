"""Why a checkpoint does not fit its architecture, in one line (tasks/models/checkpoint_file.py ``fit_problem``):
torch's message was cut at its header line ("Error(s) in loading state_dict for ResNet:"), naming nothing."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from tasks.models.base import ModelSourceError
from tasks.models.checkpoint_file import fit_problem, read_state_dict


def net(classes: int = 4, depth: int = 2) -> nn.Module:
    return nn.Sequential(*[nn.Linear(8, 8) for _ in range(depth)], nn.Linear(8, classes))


def test_other_classes_name_the_head_and_the_num_classes_to_set():
    assert fit_problem(net(10).state_dict(), net(4).state_dict()) == (
        "2 of another shape (e.g. 2.weight: file [4, 8], model [10, 8]); the last layer differs: the file's has 4 "
        "outputs (set num_classes: 4)")


def test_a_data_parallel_prefix_is_named():
    sd = {f"module.{k}": v for k, v in net().state_dict().items()}
    assert fit_problem(net().state_dict(), sd) == (
        "6 missing key(s) (e.g. 0.weight, 0.bias), 6 unexpected (e.g. module.0.weight, module.0.bias); its keys carry "
        "a 'module.' prefix (a DistributedDataParallel save): strip it")


def test_another_depth_names_the_missing_keys_without_a_hint():
    assert fit_problem(net(depth=3).state_dict(), net(depth=2).state_dict()) == (
        "2 missing key(s) (e.g. 3.weight, 3.bias), 2 of another shape (e.g. 2.weight: file [4, 8], model [8, 8])")


def test_a_whole_pickled_model_says_to_save_its_state_dict(tmp_path):
    torch.save(net(), tmp_path / "full.pt")
    with pytest.raises(ModelSourceError, match=r"save model.state_dict\(\) instead\): Weights only load failed") as e:
        read_state_dict(tmp_path / "full.pt")
    assert "\x1b[" not in str(e.value)  # torch's ANSI bold codes stripped


def test_an_input_size_the_model_does_not_take_is_one_line():
    """A timm ViT built for 32 px fed 48-px images ended the dense stage in a 73-line traceback."""
    import timm

    from tasks.models.external import forward_problem

    vit = timm.create_model("vit_tiny_patch16_224", img_size=32, patch_size=8, depth=1, num_classes=4).eval()
    assert forward_problem("v", vit, torch.zeros(1, 3, 32, 32)) == ""
    assert forward_problem("v", vit, torch.zeros(1, 3, 48, 48)) == (
        "model 'v': a forward pass on one preprocessed image [3, 48, 48] fails (Input height (48) doesn't match model "
        "(32).); the preprocessing size must be one the model takes (the model entry's input_size; for timm also "
        "model_args img_size)")
