"""A reference model's facts (stages.ModelInfo) cached by its shipped weights' sha256 and settings
(orchestrator/sweep/model_facts.py): a hit equals a fresh load field for field and builds no model (timm never imported),
a different store dtype misses, a checkpoint given by path is always loaded, and the cache can be switched off."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
CACHE = REPO / ".healsweep" / "models"  # a --cache: loading reads the shipped weights, never this directory
pytestmark = pytest.mark.timeout(300)

PROBE = """
import json, sys
from dataclasses import asdict
from orchestrator.spec import parse_spec
from orchestrator.sweep.stages import dense_stage, prepare_models
spec = parse_spec(json.loads(sys.argv[1]))
info = prepare_models(spec, sys.argv[2], progress=False)
dense = None
if len(sys.argv) > 3:  # the dense stage too, into the target store sys.argv[3], in this process
    dense = dense_stage(spec, info, {m: 64 for m in info}, sys.argv[3], sys.argv[2], progress=False, in_driver=True)
print(json.dumps({"info": {m: asdict(i) for m, i in info.items()}, "timm": "timm" in sys.modules, "dense": dense}))
"""


def _spec(dtype: str = "float16") -> dict:
    return {"name": "facts", "models": ["vit_digits"], "sparsities": [0.5], "calib_sizes": [64],
            "pruners": ["magnitude"], "healers": ["starfish"], "store": {"dtype": dtype}}


def _prepare(checks: Path, spec: dict, cache: Path = CACHE, store: Path | None = None) -> dict:
    env = dict(os.environ, PYTHONPATH=str(REPO), HEALSWEEP_CHECK_CACHE=str(checks))
    r = subprocess.run([sys.executable, "-c", PROBE, json.dumps(spec), str(cache), *([str(store)] if store else [])],
                       capture_output=True, text=True, env=env, cwd=REPO, timeout=280)
    assert r.returncode == 0, r.stderr[-2000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_hit_equals_a_fresh_load_and_builds_no_model(tmp_path):
    cold = _prepare(tmp_path / "checks", _spec())
    assert cold["timm"] and len(list((tmp_path / "checks").glob("model-*.json"))) == 1
    warm = _prepare(tmp_path / "checks", _spec())
    assert not warm["timm"]
    fresh = cold["info"]["vit_digits"]
    assert warm["info"]["vit_digits"] == fresh
    assert fresh["default_granularity"] == "token" and fresh["store_key"] and fresh["blocks"][-1] == "logits"
    off = _prepare(Path("off"), _spec())  # HEALSWEEP_CHECK_CACHE=off: always loaded
    assert off["timm"] and off["info"] == cold["info"]


def test_other_dtype_misses_and_a_checkpoint_path_is_always_loaded(tmp_path):
    import shutil

    from tasks.models.weights import SHIPPED

    first = _prepare(tmp_path / "checks", _spec())
    other = _prepare(tmp_path / "checks", _spec("bfloat16"))  # the store key names the dtype
    assert other["timm"] and other["info"]["vit_digits"]["store_key"] != first["info"]["vit_digits"]["store_key"]
    copy = shutil.copy(SHIPPED["vit_digits"].path, tmp_path / "copy.safetensors")
    by_path = {**_spec(), "models": [{"name": "vit_digits", "path": str(copy)}]}
    for _ in range(2):  # never cached (its file may change under the same path): loaded both times
        again = _prepare(tmp_path / "checks", by_path)
        assert again["timm"] and again["info"] == first["info"]  # the same bytes: the same facts, the same keys
    assert len(list((tmp_path / "checks").glob("model-*.json"))) == 2


def test_warm_models_and_dense_stages_build_no_model(tmp_path):
    """With the facts cached and the targets in the store, the driver's models and dense stages never build the
    model (the dense stage reads the calibration order from the dataset alone); the first run computed them."""
    cold = _prepare(tmp_path / "checks", _spec(), store=tmp_path / "targets")
    assert cold["timm"] and cold["dense"] == {"vit_digits": 64}
    warm = _prepare(tmp_path / "checks", _spec(), store=tmp_path / "targets")
    assert not warm["timm"] and warm["dense"] == {"vit_digits": 0}


def test_calibration_rows_without_the_model_are_load_models():
    from orchestrator.sweep.dense_work import calibration_rows
    from tasks.models import load_model

    lm = load_model("vit_digits", CACHE, progress=False)  # data seed 0: the shipped weights
    assert calibration_rows("vit_digits", CACHE, 0) == [int(i) for i in lm.dataset["calibration"].indices]


def test_calibration_rows_of_an_external_model_follow_its_spec_entry(tmp_path):
    """An external model is loaded as its entry says (issue 33: loading it by name alone was a KeyError that ended
    every external sweep in the dense stage)."""
    from orchestrator.sweep.dense_work import calibration_rows
    from orchestrator.spec import parse_spec
    from tasks.data.synthetic import write_image_folder

    root = write_image_folder(tmp_path / "folder", num_classes=3, per_class=4, size=16)
    sizes = {"train": 0, "calibration": 5, "selection": 3, "evaluation": 4}
    entry = {"name": "r18", "source": "timm", "arch": "resnet18", "pretrained": False, "num_classes": 3}
    spec = parse_spec({"name": "x", "models": [entry], "dataset": {"name": "imagefolder", "root": str(root),
                       "sizes": sizes}, "sparsities": [0.5], "calib_sizes": [4], "pruners": ["magnitude"],
                       "healers": ["starfish"]})
    rows = [calibration_rows("r18", CACHE, s, spec.load_kwargs("r18")) for s in (0, 1)]
    assert len(rows[0]) == 5 and len(set(rows[0])) == 5 and max(rows[0]) < 12 and rows[0] != rows[1]  # seeded
    with pytest.raises(KeyError, match="unknown model 'r18'"):  # by its name alone: not a reference model
        calibration_rows("r18", CACHE, 0)


def test_another_calibration_draw_has_its_own_facts_store_rows_and_trial_images(tmp_path):
    """``calib_seed``: the driver's facts are computed (not the cached data-seed ones), the store key and the
    calibration digest are the draw's, the dense stage stores the targets of the drawn images in row order, and a
    trial (its load_kw) and the dense workers (calibration_rows) see those same images."""
    import torch

    from orchestrator.spec import parse_spec
    from orchestrator.sweep.dense_work import calibration_rows
    from tasks.healing import dense_targets
    from tasks.models import get_adapter, load_model, load_model_copy
    from tasks.store import TargetStore

    base = _prepare(tmp_path / "checks", _spec())["info"]["vit_digits"]
    drawn = _prepare(tmp_path / "checks", {**_spec(), "calib_seed": 3}, store=tmp_path / "targets")
    info = drawn["info"]["vit_digits"]
    assert drawn["dense"] == {"vit_digits": 64}  # not the cached facts of the data seed's order: its own key
    assert info["store_key"] != base["store_key"] and info["calib_digest"] != base["calib_digest"]
    assert len(list((tmp_path / "checks").glob("model-*.json"))) == 2  # the draw's facts under a key of their own
    warm = _prepare(tmp_path / "checks", {**_spec(), "calib_seed": 3})
    assert not warm["timm"] and warm["info"]["vit_digits"] == info  # a hit, the draw's

    kw = parse_spec({**_spec(), "calib_seed": 3}).load_kwargs("vit_digits")
    assert kw == {"calib_seed": 3}
    lm = load_model("vit_digits", CACHE, progress=False, **kw)
    plain = load_model_copy("vit_digits", CACHE)  # a trial process keeps what it loaded: the draw is in its key
    trial = load_model_copy("vit_digits", CACHE, **kw)  # what a trial's fresh_model loads
    assert not torch.equal(plain.dataset["calibration"].images, trial.dataset["calibration"].images)
    assert lm.dataset.split_digest("calibration") == info["calib_digest"]
    assert calibration_rows("vit_digits", CACHE, 0, kw) == [int(i) for i in lm.dataset["calibration"].indices]
    assert torch.equal(trial.dataset["calibration"].images, lm.dataset["calibration"].images)
    images = lm.dataset["calibration"].images[:64]  # (64, 1, 16, 16)
    want = dense_targets(lm.model, get_adapter(lm.model).blocks(lm.model), images)
    got = TargetStore(tmp_path / "targets").open(info["store_key"]).read_rows(torch.arange(64).numpy())
    for block, t in want.items():
        assert torch.allclose(got[block].float(), t.float(), atol=2e-2, rtol=1e-2), block
    base_images = load_model("vit_digits", CACHE, progress=False).dataset["calibration"].images[:64]
    assert not torch.equal(images, base_images)
