"""Hardware is a setting: heal.precision, heal.compile, heal.graph, heal.channels_last, resources.device and
store.targets are parsed, checked in one line, carried to every trial and logged; the device each trial and task
picks follows them."""
import pytest

from orchestrator.raytune.resources import task_device, task_gpus, trial_device
from orchestrator.spec import SpecError, parse_spec
from orchestrator.spec.checks import COMPILE_MODES, DEVICES, GRAPH_MODES, PRECISIONS
from orchestrator.raytune.tune_setup import trial_config

BASE = {"name": "t", "models": ["vit_digits"], "sparsities": [0.5], "calib_sizes": [64], "pruners": ["magnitude"],
        "healers": ["starfish"]}


def test_precision_names_are_the_tasks_registry():
    """The spec's static table (no torch import to check a spec) is the healing loop's own list."""
    from tasks.healing.precision import PRECISIONS as LIVE

    assert PRECISIONS == LIVE


def test_compile_names_are_the_tasks_registry_and_carried_to_every_trial():
    from tasks.healing.compiled import COMPILE_MODES as LIVE
    from orchestrator.spec.plan import expand_cells

    assert COMPILE_MODES == LIVE
    assert parse_spec(BASE).heal.compile == "off"  # the authors run eagerly
    spec = parse_spec({**BASE, "heal": {"compile": "blocks"}})
    cell = expand_cells(spec, {"vit_digits": "qkv_out_mlp"})[0]
    cfg = trial_config(cell, spec, {"targets": "t", "masks": "m", "cache": "c"}, "k", "mk", "token", 1, "cpu")
    assert cfg["compile"] == "blocks"


def test_graph_names_are_the_tasks_registry_and_carried_to_every_trial():
    from tasks.healing.graphed import GRAPH_MODES as LIVE
    from orchestrator.spec.plan import expand_cells

    assert GRAPH_MODES == LIVE
    assert parse_spec(BASE).heal.graph == "off"  # the authors launch every kernel from Python
    spec = parse_spec({**BASE, "heal": {"graph": "step", "compile": "blocks"}})
    cell = expand_cells(spec, {"vit_digits": "qkv_out_mlp"})[0]
    cfg = trial_config(cell, spec, {"targets": "t", "masks": "m", "cache": "c"}, "k", "mk", "token", 1, "cpu")
    assert cfg["graph"] == "step" and cfg["compile"] == "blocks"


@pytest.mark.parametrize("prec", PRECISIONS)
def test_precision_parsed_and_carried_to_every_trial(prec, tmp_path):
    spec = parse_spec({**BASE, "heal": {"precision": prec, "channels_last": False}})
    assert spec.heal.precision == prec and spec.heal.channels_last is False
    from orchestrator.spec.plan import expand_cells

    cell = expand_cells(spec, {"vit_digits": "qkv_out_mlp"})[0]
    cfg = trial_config(cell, spec, {"targets": "t", "masks": "m", "cache": "c"}, "k", "mk", "token", 1, "cpu")
    assert cfg["precision"] == prec and cfg["channels_last"] is False


def test_latency_rounds_parsed_and_carried_to_every_trial():
    assert parse_spec(BASE).heal.latency_rounds == 20
    spec = parse_spec({**BASE, "heal": {"latency_rounds": 3}})
    from orchestrator.spec.plan import expand_cells

    cell = expand_cells(spec, {"vit_digits": "qkv_out_mlp"})[0]
    cfg = trial_config(cell, spec, {"targets": "t", "masks": "m", "cache": "c"}, "k", "mk", "token", 1, "cpu")
    assert spec.heal.latency_rounds == 3 and cfg["latency_rounds"] == 3


@pytest.mark.parametrize("heal,match", [({"precision": "fp16"}, "heal.precision"),
                                        ({"channels_last": "yes"}, "heal.channels_last"),
                                        ({"compile": "max-autotune"}, "heal.compile"),
                                        ({"graph": "on"}, "heal.graph"),
                                        ({"latency_rounds": 0}, "heal.latency_rounds"),
                                        ({"latency_rounds": 2.5}, "heal.latency_rounds")])
def test_bad_heal_settings_refused_in_one_line(heal, match):
    with pytest.raises(SpecError, match=match) as e:
        parse_spec({**BASE, "heal": heal})
    assert "\n" not in str(e.value)


def test_store_targets_choice():
    assert parse_spec(BASE).store.targets == "auto"
    assert parse_spec({**BASE, "store": {"targets": "recompute"}}).store.targets == "recompute"
    with pytest.raises(SpecError, match="store.targets"):
        parse_spec({**BASE, "store": {"targets": "ram"}})


@pytest.mark.parametrize("res,device,gpus", [
    ({}, "cpu", 0.0),
    ({"gpus_per_trial": 0.25}, "cuda", 0.25),
    ({"gpus_per_trial": 0.25, "gpus_per_dense_task": 1}, "cuda", 1.0),
    ({"gpus_per_trial": 0.25, "device": "cpu"}, "cpu", 0.0),  # logical GPUs only pack trials
    ({"gpus_per_trial": 2, "device": "cuda"}, "cuda", 2.0),
])
def test_trial_device_and_task_gpus(res, device, gpus):
    spec = parse_spec({**BASE, "resources": res})
    assert trial_device(spec.resources) == device
    assert task_gpus(spec.resources) == gpus


def test_cuda_without_gpus_is_refused():
    with pytest.raises(SpecError, match="resources.device: cuda needs resources.gpus_per_trial > 0"):
        parse_spec({**BASE, "resources": {"device": "cuda"}})
    with pytest.raises(SpecError, match="resources.device"):
        parse_spec({**BASE, "resources": {"device": "tpu"}})
    assert "tpu" not in DEVICES


@pytest.mark.parametrize("setting,ids,want", [("auto", [0], "cuda"), ("auto", [], "cpu"), ("cpu", [0], "cpu"),
                                              ("cuda", ["1"], "cuda")])
def test_task_device(setting, ids, want):
    assert task_device(setting, ids) == want


def _models(spec):
    from types import SimpleNamespace

    return {m: SimpleNamespace(scope="qkv_out_mlp", digest="d" * 16) for m in spec.models}


@pytest.mark.parametrize("store,res,budget,want,why", [
    ({}, {}, "store", "store", "CPU trials"),  # CPU: the store, no probe (no Ray task started)
    ({"targets": "recompute"}, {}, "store", "recompute", "store.targets: recompute"),
    ({"targets": "store"}, {"gpus_per_trial": 0.5}, "store", "store", "store.targets: store"),
    ({"targets": "store"}, {}, "recompute", "recompute", "store.budget_gb"),  # the budget wins
    ({}, {"gpus_per_trial": 0.5, "device": "cpu"}, "store", "store", "CPU trials"),
])
def test_planner_decisions_without_a_probe(tmp_path, store, res, budget, want, why):
    from orchestrator.sweep.planner import decision_line, plan_target_modes

    spec = parse_spec({**BASE, "store": store, "resources": res})
    modes = {"vit_digits": budget}
    d = plan_target_modes(spec, _models(spec), modes, str(tmp_path), tmp_path)
    assert modes == {"vit_digits": want} and d["vit_digits"]["pick"] == want
    assert why in d["vit_digits"]["why"] and decision_line("vit_digits", d["vit_digits"]).startswith(f"vit_digits: {want}")


def test_a_cached_planner_decision_holds_for_one_heal_configuration():
    """orchestrator/sweep/planner.py: a probe's decision is cached by every setting that changes a step's cost, so a
    sweep with ``heal.graph: step`` (or compile, channels_last, precision) never reads one measured without it."""
    from orchestrator.sweep.planner import heal_settings, probe_identity
    from tasks.store import content_key

    heal = heal_settings(parse_spec(BASE).heal)
    assert heal == {"precision": "fp32", "compile": "off", "graph": "off", "channels_last": "auto"}
    keys = {content_key(probe_identity("d" * 64, "c" * 16, "NVIDIA H200", "2.11.0", 32, {**heal, **change},
                                       "float16", "mlp"))
            for change in ({}, {"graph": "step"}, {"compile": "blocks"}, {"channels_last": True},
                           {"precision": "bf16"})}
    assert len(keys) == 5
    # the same weights on calibration images of another size (a model entry's input_size: its data digest)
    assert content_key(probe_identity("d" * 64, "e" * 16, "NVIDIA H200", "2.11.0", 32, heal, "float16", "mlp")) \
        not in keys
