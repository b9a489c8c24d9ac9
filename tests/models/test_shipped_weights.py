"""The reference models' shipped weights: their sha256 and evaluation accuracy as recorded, every load verified;
a checkpoint with another digest, a truncated or a non-safetensors file refused in one line naming it, nothing
trained or written; ``healsweep models train`` writes a new file named by its own digest, never the shipped one."""
from __future__ import annotations

import hashlib
import json
import shutil

import pytest
import torch

from tasks.models import MODELS, ModelSourceError, load_model
from tasks.models.reference import train_reference
from tasks.models.weights import DATA_SEED, SHIPPED, WEIGHTS_DIR


@pytest.mark.parametrize("name", sorted(SHIPPED))
def test_shipped_file_has_its_recorded_sha256(name):
    w = SHIPPED[name]
    assert w.path.parent == WEIGHTS_DIR and w.path.name == f"{name}.safetensors"
    assert hashlib.sha256(w.path.read_bytes()).hexdigest() == w.sha256
    assert 1_000_000 < w.path.stat().st_size < 1_600_000  # ~1.3 MB each, as shipped


@pytest.mark.parametrize("name", sorted(SHIPPED))
def test_shipped_weights_evaluate_to_their_recorded_accuracy(name):
    """Exact: ``eval_correct`` of 360 evaluation images. Evaluation on fixed weights is deterministic on one
    machine; across CPU types the logits may differ in their last bits (other kernels), which cannot change a
    prediction whose top-1 leads the runner-up by far more than float32 rounding: the smallest such margin over the
    evaluation split is recorded (``eval_min_margin``) and must stay above 1e-3 here. Tolerance: 0 images."""
    w = SHIPPED[name]
    lm = load_model(name)
    ev = lm.dataset["evaluation"]
    with torch.no_grad():
        logits = lm.model(ev.images)
    top2 = logits.topk(2, dim=1).values
    correct = int((logits.argmax(1) == ev.labels).sum())
    assert (correct, len(ev.labels)) == (w.eval_correct, w.eval_total)
    margin = float((top2[:, 0] - top2[:, 1]).min())
    assert margin == pytest.approx(w.eval_min_margin, rel=1e-3) and margin > 1e-3
    assert lm.digest == w.sha256[:16] and lm.info["dense_eval_acc"] == pytest.approx(w.eval_acc, abs=1e-6)  # float32
    assert (lm.info["model"], lm.info["data_seed"], lm.info["train_seed"]) == (name, DATA_SEED, 0)


def _tampered(tmp_path, name: str):
    """A copy of the shipped file with one weight byte changed: a complete, loadable safetensors file."""
    raw = bytearray(SHIPPED[name].path.read_bytes())
    raw[-5] ^= 0x01
    p = tmp_path / f"{name}.safetensors"
    p.write_bytes(bytes(raw))
    return p


def _one_line(e) -> str:
    assert "\n" not in str(e.value)
    return str(e.value)


def test_a_shipped_file_with_another_digest_is_refused_and_nothing_is_written(tmp_path, monkeypatch):
    from dataclasses import replace

    import tasks.models.reference as reference

    bad = _tampered(tmp_path, "resnet_digits")
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    monkeypatch.setitem(reference.SHIPPED, "resnet_digits", replace(SHIPPED["resnet_digits"], file=str(bad)))
    with pytest.raises(ModelSourceError) as e:
        load_model("resnet_digits", tmp_path)
    msg = _one_line(e)
    assert msg.startswith(f"checkpoint {str(bad)!r}: sha256 ") and "does not match the expected " in msg
    assert SHIPPED["resnet_digits"].sha256[:16] in msg and "refused" in msg
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before  # nothing trained, written or replaced


@pytest.mark.parametrize("damage, words", [
    (lambda raw: raw[: len(raw) // 2], "truncated or padded"),
    (lambda raw: raw[:7], "not a safetensors file (no valid header"),
    (lambda raw: b"PK\x03\x04 a zip, not safetensors" + raw[:64], "not a safetensors file"),
    (lambda raw: raw + b"\0" * 10, "truncated or padded"),
])
def test_truncated_or_foreign_files_are_refused_in_one_line(tmp_path, damage, words):
    from orchestrator.spec import SpecError, parse_spec

    p = tmp_path / "vit_digits-x.safetensors"
    p.write_bytes(damage(SHIPPED["vit_digits"].path.read_bytes()))
    with pytest.raises(ModelSourceError) as e:
        load_model("vit_digits", source={"name": "vit_digits", "source": "reference", "path": str(p)})
    assert _one_line(e).startswith(f"checkpoint {str(p)!r}: ") and words in str(e.value)
    with pytest.raises(SpecError) as e:  # the spec check refuses it before any work
        parse_spec({"name": "s", "models": [{"name": "vit_digits", "path": str(p)}], "sparsities": [0.5],
                    "calib_sizes": [64], "pruners": ["magnitude"], "healers": ["starfish"]})
    assert _one_line(e).startswith("models[0]: checkpoint ") and str(p) in str(e.value) and words in str(e.value)


def test_a_pinned_sha256_that_does_not_match_is_refused_by_the_spec_check(tmp_path):
    from orchestrator.spec import SpecError, parse_spec

    good = shutil.copy(SHIPPED["vit_digits"].path, tmp_path / "copy.safetensors")
    base = {"name": "s", "sparsities": [0.5], "calib_sizes": [64], "pruners": ["magnitude"], "healers": ["starfish"]}
    pin = SHIPPED["vit_digits"].sha256[:16]
    spec = parse_spec({**base, "models": [{"name": "vit_digits", "path": str(good), "sha256": pin}]})
    assert spec.load_kwargs("vit_digits")["source"]["sha256"] == pin
    again = parse_spec(json.loads(json.dumps(spec.to_dict(), default=list)))  # sweep.json: resume, refine
    assert again.load_kwargs("vit_digits") == spec.load_kwargs("vit_digits")
    bad = _tampered(tmp_path, "vit_digits")
    with pytest.raises(SpecError) as e:
        parse_spec({**base, "models": [{"name": "vit_digits", "path": str(bad), "sha256": pin}]})
    assert _one_line(e).startswith(f"models[0]: checkpoint {str(bad)!r}: sha256 ")
    with pytest.raises(SpecError, match="models\\[0\\]: .*shipped weights were trained on data_seed 0's train split; "
                                        "for data_seed 3 train one \\(healsweep models train vit_digits --data-seed 3"):
        parse_spec({**base, "models": ["vit_digits"], "data_seed": 3})
    with pytest.raises(SpecError, match="not a vit_digits checkpoint"):  # the ResNet's file named as the ViT
        parse_spec({**base, "models": [{"name": "vit_digits", "path": str(SHIPPED["resnet_digits"].path)}]})


def test_a_copy_of_the_shipped_file_is_the_same_model(tmp_path):
    """Identity is the file's sha256: a copy elsewhere loads as the same digest (same targets, masks, params)."""
    copy = shutil.copy(SHIPPED["resnet_digits"].path, tmp_path / "elsewhere.safetensors")
    a = load_model("resnet_digits")
    b = load_model("resnet_digits", source={"name": "resnet_digits", "source": "reference", "path": str(copy)})
    assert a.digest == b.digest == SHIPPED["resnet_digits"].sha256[:16]
    assert all(torch.equal(v, b.model.state_dict()[k]) for k, v in a.model.state_dict().items())


def test_training_writes_a_new_file_named_by_its_digest_and_never_the_shipped_one(tmp_path, monkeypatch):
    """One real epoch of the ResNet recipe (the registered entry with epochs=1): the file is named by the sha256
    of its bytes; the same seeds again give the same bytes (the file is left as it is); a spec uses it by path;
    a checkpoint of another data seed is refused for this one."""
    from dataclasses import replace

    shipped = {n: w.path.read_bytes() for n, w in SHIPPED.items()}
    src = MODELS.get("resnet_digits")
    monkeypatch.setitem(MODELS._entries, "resnet_digits", replace(src, recipe=replace(src.recipe, epochs=1)))
    path, sha, acc = train_reference("resnet_digits", tmp_path / "cache", progress=False)
    assert path == tmp_path / "cache" / f"resnet_digits-{sha[:16]}.safetensors"
    assert hashlib.sha256(path.read_bytes()).hexdigest() == sha != SHIPPED["resnet_digits"].sha256
    mtime = path.stat().st_mtime_ns
    again = train_reference("resnet_digits", tmp_path / "cache", progress=False)
    assert again == (path, sha, acc) and path.stat().st_mtime_ns == mtime  # same machine, same seeds, same bytes
    assert {n: w.path.read_bytes() for n, w in SHIPPED.items()} == shipped
    lm = load_model("resnet_digits", source={"name": "resnet_digits", "source": "reference", "path": str(path)})
    assert lm.digest == sha[:16] and lm.info["dense_eval_acc"] == acc
    other, _, _ = train_reference("resnet_digits", tmp_path / "cache", data_seed=1, progress=False)
    with pytest.raises(ModelSourceError, match="trained on data_seed 1's train split, not on data_seed 0's"):
        load_model("resnet_digits", source={"name": "resnet_digits", "source": "reference", "path": str(other)})
