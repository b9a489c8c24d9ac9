"""Real data and model sources on files the tests make: an image folder, a Parquet image table and a
Hugging Face ``datasets.Dataset`` (map-style and streamed) through the same split code; timm checkpoints;
offline mode; spec mapping entries."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from tasks.data import SPLITS, load_dataset
from tasks.data.hub import hf_splits
from tasks.data.tables import ArrowTable, FolderTable, LazyImages, table_splits
from tasks.models import MODEL_SOURCES, ModelRef, ModelSourceError, file_digest, load_external, parse_ref

N_CLASSES, PER_CLASS = 3, 12
SIZES = {"train": 4, "calibration": 12, "selection": 6, "evaluation": 10}


def _transform():
    from torchvision import transforms as T

    return T.Compose([T.Resize(16), T.ToTensor()]), "test:resize16"


def _images():
    """36 seeded 20x20 RGB images, label-dependent colour + noise, in ImageFolder order (class, file name)."""
    from PIL import Image

    rng = np.random.default_rng(0)
    out = []
    for c in range(N_CLASSES):
        for i in range(PER_CLASS):
            arr = rng.integers(0, 60, (20, 20, 3), dtype=np.uint8)
            arr[..., c] += 150
            out.append((Image.fromarray(arr), c, f"c{c}/img{i:02d}.png"))
    return out


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """The same 36 images as an image folder, a Parquet table (HF-style {bytes, path} cells) and an HF Dataset."""
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    root = tmp_path_factory.mktemp("src")
    items = _images()
    rows = []
    for img, label, rel in items:
        p = root / "folder" / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        img.save(p)
        rows.append({"image": {"bytes": p.read_bytes(), "path": rel}, "label": label})
    pq.write_table(pa.Table.from_pylist(rows), root / "table.parquet")
    feats = datasets.Features({"image": datasets.Image(), "label": datasets.ClassLabel(num_classes=N_CLASSES)})
    hf = datasets.Dataset.from_dict({"image": [r["image"] for r in rows], "label": [r["label"] for r in rows]},
                                    features=feats)
    return {"root": root, "folder": root / "folder", "parquet": root / "table.parquet", "hf": hf}


def _all_three(sources, seed=0):
    t, tid = _transform()
    return {
        "folder": table_splits("f", FolderTable(sources["folder"]), SIZES, seed, t, tid),
        "parquet": table_splits("p", ArrowTable(sources["parquet"]), SIZES, seed, t, tid),
        "hf": hf_splits("h", {s: sources["hf"] for s in SPLITS}, SIZES, seed, t, tid, ident="tiny"),
    }


def test_three_sources_give_the_same_splits_and_pixels(sources):
    data = _all_three(sources)
    ref = data["folder"]
    for name, d in data.items():
        assert d.num_classes == N_CLASSES and d.image_shape == (3, 16, 16), name
        for s in SPLITS:
            assert np.array_equal(d[s].indices, ref[s].indices), (name, s)
            assert len(d[s]) == SIZES[s] and d[s].images.shape == (SIZES[s], 3, 16, 16)
            assert torch.equal(d[s].images[:], ref[s].images[:]), (name, s)  # PNG is lossless: bit-identical
            if s == "calibration":
                assert d[s].labels is None  # unlabeled by contract
            else:  # labels are the folder's class of each index
                assert d[s].labels.tolist() == [int(i) // PER_CLASS for i in d[s].indices]


def test_splits_are_disjoint_seeded_and_digested(sources):
    for name, d in _all_three(sources).items():
        seen = np.concatenate([d[s].indices for s in SPLITS])
        assert len(np.unique(seen)) == len(seen) == sum(SIZES.values()), name
        assert d.split_digest("calibration", 5) != d.split_digest("calibration", 6)
    a, b = _all_three(sources, seed=0)["parquet"], _all_three(sources, seed=1)["parquet"]
    assert not np.array_equal(a["calibration"].indices, b["calibration"].indices)
    assert a.digest != b.digest and a.split_digest("evaluation") != b.split_digest("evaluation")
    with pytest.raises(ValueError, match=r"^dataset p: splits need .* = 40 items from the table, which has 36; set smaller dataset.sizes"):
        t, tid = _transform()
        table_splits("p", ArrowTable(sources["parquet"]), {**SIZES, "evaluation": 18}, 0, t, tid)


def test_streamed_hub_splits_use_a_seeded_shuffle_buffer(sources):
    """Paper 000's layout: calibration streamed from one hub split, evaluation from another."""
    hf = sources["hf"]
    t, tid = _transform()
    test_split, val_split = hf.select(range(18)), hf.select(range(18, 36))
    stream = test_split.to_iterable_dataset()

    def load(seed):
        by = {"train": val_split, "calibration": stream, "selection": val_split, "evaluation": val_split}
        return hf_splits("im", by, {**SIZES, "train": 0, "selection": 4, "evaluation": 10}, seed, t, tid,
                         buffer_size=8, ident="tiny")

    a, a2, b = load(0), load(0), load(1)
    cal = a["calibration"].indices  # positions in the unshuffled stream
    assert len(cal) == 12 and len(set(cal.tolist())) == 12 and cal.max() < 18
    assert np.array_equal(cal, a2["calibration"].indices) and not np.array_equal(cal, b["calibration"].indices)
    assert not np.array_equal(cal, np.sort(cal))  # shuffled, not the stream's first 12 in order
    for row, pos in enumerate(cal[:4]):  # the streamed item is the map-style item at that position
        assert torch.equal(a["calibration"].images[row], t(test_split[int(pos)]["image"].convert("RGB")))
    ev, sel = a["evaluation"].indices, a["selection"].indices  # same hub split: disjoint slices
    assert not set(ev.tolist()) & set(sel.tolist())
    assert a["evaluation"].labels.tolist() == [val_split[int(i)]["label"] for i in ev]


def test_lazy_images_index_like_a_tensor(sources):
    t, _ = _transform()
    table = FolderTable(sources["folder"])
    rows = np.array([5, 0, 30])
    lazy = LazyImages(table, rows, t, (3, 16, 16))
    full = torch.stack([t(table.image(i)) for i in rows])
    assert lazy.shape == (3, 3, 16, 16) and len(lazy) == 3
    assert torch.equal(lazy[1:], full[1:]) and torch.equal(lazy[torch.tensor([2, 0])], full[[2, 0]])
    assert torch.equal(lazy[np.array([1])], full[[1]]) and torch.equal(lazy[0], full[0])
    assert lazy[3:].shape == (0, 3, 16, 16)


def test_registered_loaders_validate_settings(sources):
    t, tid = _transform()
    d = load_dataset("imagefolder", seed=0, transform=t, transform_id=tid, root=str(sources["folder"]), sizes=SIZES)
    e = load_dataset("image_table", seed=0, transform=t, transform_id=tid, path=str(sources["parquet"]), sizes=SIZES)
    assert np.array_equal(d["evaluation"].indices, e["evaluation"].indices)
    from tasks.data import DATASETS

    with pytest.raises(ValueError, match="^colour: unknown dataset setting; allowed: root, sizes$"):
        DATASETS.get("imagefolder").check({"root": "x", "colour": 1})
    with pytest.raises(ValueError, match="^image_size: not a sweep setting: each model preprocesses images its own"):
        DATASETS.get("imagefolder").check({"root": str(sources["folder"]), "image_size": 32})  # it would be ignored
    assert load_dataset("imagefolder", root=str(sources["folder"]), sizes=SIZES, image_size=24)["evaluation"] \
        .images[:1].shape == (1, 3, 24, 24)  # the fallback preprocessing (no transform given) takes it
    with pytest.raises(ValueError, match="^sizes.test: unknown split"):
        DATASETS.get("imagenet1k").check({"sizes": {"test": 3}})
    assert DATASETS.get("imagenet1k").check({"sizes": {"calibration": 2500}}) == 2500
    assert DATASETS.get("cifar100").settings({})["splits"] == {"train": "train", "calibration": "train",
                                                              "selection": "train", "evaluation": "test"}


# --- model sources --------------------------------------------------------------------------------------

TINY = {"img_size": 32, "patch_size": 8, "depth": 2}


def _tiny_checkpoint(tmp_path, suffix=".safetensors"):
    import timm
    from safetensors.torch import save_file

    torch.manual_seed(3)
    m = timm.create_model("deit_tiny_patch16_224", pretrained=False, num_classes=N_CLASSES, **TINY).eval()
    path = tmp_path / f"tiny{suffix}"
    if suffix == ".safetensors":
        save_file({k: v.contiguous() for k, v in m.state_dict().items()}, str(path))
    else:
        torch.save({"state_dict": m.state_dict()}, str(path))
    return m, path


@pytest.mark.parametrize("suffix", [".safetensors", ".pt"])
def test_local_timm_checkpoint_gives_identical_logits(tmp_path, suffix):
    m, path = _tiny_checkpoint(tmp_path, suffix)
    ref = parse_ref({"name": "tiny", "source": "checkpoint", "arch": "deit_tiny_patch16_224", "path": str(path),
                     "num_classes": N_CLASSES, "model_args": TINY})
    src = MODEL_SOURCES.get("checkpoint")
    loaded = src.load(ref)
    x = torch.randn(4, 3, 32, 32)
    with torch.no_grad():
        assert torch.equal(loaded(x), m(x))
    assert src.digest(ref) == file_digest(path)
    _, tid = src.transform(ref, loaded)  # timm data config follows the model's input size
    assert '"input_size": [3, 32, 32]' in tid and '"interpolation": "bicubic"' in tid


def test_checkpoint_errors_are_one_line(tmp_path):
    _, path = _tiny_checkpoint(tmp_path)
    bad = ModelRef("tiny", "checkpoint", "deit_small_patch16_224", path=str(path), num_classes=N_CLASSES,
                   model_args=TINY)
    with pytest.raises(ModelSourceError, match=r"^model 'tiny': checkpoint .* does not fit 'deit_small_patch16_224'") as e:
        MODEL_SOURCES.get("checkpoint").load(bad)
    assert "\n" not in str(e.value)
    with pytest.raises(ModelSourceError, match="checkpoint file not found"):
        parse_ref({"name": "x", "source": "checkpoint", "arch": "resnet18", "path": str(tmp_path / "nope.pt")})


def test_offline_request_for_uncached_pretrained_weights_fails_clearly(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch"))
    ref = parse_ref("deit_tiny_patch16_224")
    assert ref.source == "timm" and ref.pretrained  # a bare timm name means its pretrained weights
    with pytest.raises(ModelSourceError) as e:
        MODEL_SOURCES.get("timm").load(ref)
    msg = str(e.value)
    assert msg.startswith("model 'deit_tiny_patch16_224': pretrained timm weights 'deit_tiny_patch16_224' are not "
                          "in the local cache") and str(tmp_path / "hf") in msg and "HF_HUB_OFFLINE=1" in msg
    assert "\n" not in msg
    tv = parse_ref({"name": "vitb", "source": "torchvision", "arch": "vit_b_16", "weights": "ViT_B_16_Weights.IMAGENET1K_V1"})
    with pytest.raises(ModelSourceError, match=r"torchvision weights ViT_B_16_Weights.IMAGENET1K_V1 are not in the "
                                               r"local cache .*offline mode is on"):
        MODEL_SOURCES.get("torchvision").load(tv)


def test_torchvision_weights_give_their_transforms_and_digest():
    from torchvision.models import ViT_B_16_Weights

    ref = parse_ref({"name": "vitb", "source": "torchvision", "arch": "vit_b_16",
                     "weights": "ViT_B_16_Weights.IMAGENET1K_V1"})
    t, tid = MODEL_SOURCES.get("torchvision").transform(ref, None)
    assert tid == "torchvision:ViT_B_16_Weights.IMAGENET1K_V1"
    assert repr(t) == repr(ViT_B_16_Weights.IMAGENET1K_V1.transforms())
    other = ModelRef("vitb", "torchvision", "vit_b_16", weights="ViT_B_16_Weights.IMAGENET1K_SWAG_E2E_V1")
    assert MODEL_SOURCES.get("torchvision").digest(ref) != MODEL_SOURCES.get("torchvision").digest(other)
    with pytest.raises(ModelSourceError, match="unknown torchvision weights 'ViT_B_16_Weights.NOPE'"):
        parse_ref({"name": "v", "source": "torchvision", "arch": "vit_b_16", "weights": "ViT_B_16_Weights.NOPE"})


def test_external_model_loads_with_its_dataset(tmp_path, sources):
    m, path = _tiny_checkpoint(tmp_path)
    ref = parse_ref({"name": "tiny", "source": "checkpoint", "arch": "deit_tiny_patch16_224", "path": str(path),
                     "num_classes": N_CLASSES, "model_args": TINY})
    lm = load_external(ref.to_dict(), {"name": "imagefolder", "root": str(sources["folder"]), "sizes": SIZES})
    assert lm.digest == file_digest(path) and lm.dataset.image_shape == (3, 32, 32)  # timm config: 32 px
    assert lm.dataset["evaluation"].images[:2].shape == (2, 3, 32, 32)


def test_input_size_sets_the_preprocessing_of_a_torchvision_checkpoint(tmp_path, sources):
    """A torchvision builder has no data config: its checkpoint was preprocessed at timm's 224 px whatever it was
    trained at (a digits ResNet trained at 64 px scored 32.8 %, 98.4 % at its own size). The entry's input_size
    sets the size; the weights' digest (every content key) does not change, the data's digest does."""
    from safetensors.torch import save_file
    from torchvision.models import resnet18

    path = tmp_path / "r18.safetensors"
    save_file({k: v.contiguous() for k, v in resnet18(num_classes=N_CLASSES).state_dict().items()}, str(path))
    entry = {"name": "r", "source": "checkpoint", "arch": "torchvision:resnet18", "path": str(path),
             "num_classes": N_CLASSES}
    ds = {"name": "imagefolder", "root": str(sources["folder"]), "sizes": SIZES}
    at_24 = load_external(parse_ref({**entry, "input_size": 24}).to_dict(), ds)
    at_20x28 = load_external(parse_ref({**entry, "input_size": [20, 28]}).to_dict(), ds)
    default = load_external(parse_ref(entry).to_dict(), ds)
    assert at_24.dataset["evaluation"].images[:2].shape == (2, 3, 24, 24)
    assert at_20x28.dataset["evaluation"].images[:1].shape == (1, 3, 20, 28)
    assert default.dataset["evaluation"].images[:1].shape == (1, 3, 224, 224)
    assert at_24.digest == default.digest == file_digest(path) and at_24.dataset.digest != default.dataset.digest
    assert at_24.dataset.split_digest("calibration") != default.dataset.split_digest("calibration")  # planner's key
    tv = MODEL_SOURCES.get("torchvision")  # a builder without weights: the entry's digest is its settings
    plain = parse_ref({"name": "r", "source": "torchvision", "arch": "resnet18", "num_classes": N_CLASSES})
    sized = parse_ref({"name": "r", "source": "torchvision", "arch": "resnet18", "num_classes": N_CLASSES,
                       "input_size": 64})
    assert tv.digest(plain) == tv.digest(sized) != tv.digest(parse_ref({"name": "r", "source": "torchvision",
                                                                         "arch": "resnet34", "num_classes": N_CLASSES}))


def test_the_driver_builds_an_external_model_once_and_gets_copies(tmp_path, sources, monkeypatch):
    """``load_model_shared`` (the driver's stages load one model several times): a random-init timm model is built
    once per process and arguments, every call gets its own deep copy with the first build's weights bit for bit,
    torch's global RNG is left as it was, and a checkpoint replaced on disk is built (and verified) again."""
    from tasks.models import load_model_shared
    from tasks.models import load as load_mod
    from tasks.models.external import TimmSource

    builds = []
    real_build = TimmSource.build
    monkeypatch.setattr(TimmSource, "build", lambda self, ref, pretrained: builds.append(ref.name)
                        or real_build(self, ref, pretrained))
    load_mod._KEPT.clear()
    ds = {"name": "imagefolder", "root": str(sources["folder"]), "sizes": SIZES}
    source = {"name": "t", "source": "timm", "arch": "deit_tiny_patch16_224", "pretrained": False,
              "num_classes": N_CLASSES, "model_args": TINY}
    rng = torch.get_rng_state()
    a = load_model_shared("t", source=source, dataset=ds)
    b = load_model_shared("t", source=source, dataset=ds)
    assert builds == ["t"] and torch.equal(torch.get_rng_state(), rng)
    assert a.model is not b.model and a.dataset is b.dataset
    for k, v in a.model.state_dict().items():
        assert torch.equal(v, b.model.state_dict()[k]), k
    with torch.no_grad():
        next(a.model.parameters()).zero_()  # a caller prunes its copy: the next copy is the pristine build
    assert torch.equal(next(load_model_shared("t", source=source, dataset=ds).model.parameters()),
                       next(b.model.parameters()))
    assert builds == ["t"]
    load_mod.forget()  # the driver drops its kept copy before the trials: the next call builds again
    assert not load_mod._KEPT and load_model_shared("t", source=source, dataset=ds) and builds == ["t", "t"]
    _, path = _tiny_checkpoint(tmp_path)
    ck = {"name": "c", "source": "checkpoint", "arch": "deit_tiny_patch16_224", "path": str(path),
          "num_classes": N_CLASSES, "model_args": TINY}
    first = load_model_shared("c", source=ck, dataset=ds)
    assert load_model_shared("c", source=ck, dataset=ds).digest == first.digest
    m2, _ = _tiny_checkpoint(tmp_path)  # same path, new bytes (seed 3 again: re-save with changed weights)
    with torch.no_grad():
        next(m2.parameters()).add_(1.0)
    from safetensors.torch import save_file
    save_file({k: v.contiguous() for k, v in m2.state_dict().items()}, str(path))
    again = load_model_shared("c", source=ck, dataset=ds)
    assert again.digest == file_digest(path) != first.digest
    assert torch.equal(next(again.model.parameters()), next(m2.parameters()))


@pytest.mark.parametrize("entry, words", [
    ({"name": "a", "source": "hub"}, "source: unknown model source 'hub'; allowed: reference, checkpoint, timm, torchvision"),
    ({"name": "a", "colour": 1}, "colour: unknown key; allowed: name, source"),
    ({"name": "not_a_model_name"}, "'not_a_model_name' is not a timm model name"),
    ({"name": "resnet18", "pretrained": "yes"}, "pretrained: must be true or false"),
    ({"name": "resnet18", "num_classes": 0}, "num_classes: must be a positive integer"),
    ({"name": "vit_digits", "weights": "x"}, "weights: not a setting of reference models"),
    ({"name": "v", "source": "torchvision", "arch": "vit_b_16", "pretrained": True}, "need `weights`"),
    ({"name": "r", "source": "torchvision", "arch": "resnet18", "input_size": 0}, "input_size: must be N or [H, W]"),
    ({"name": "r", "source": "torchvision", "arch": "resnet18", "input_size": [64]}, "input_size: must be N or [H, W]"),
    ({"name": "r", "source": "torchvision", "arch": "resnet18", "input_size": True}, "input_size: must be N or [H, W]"),
    ({"name": "r", "source": "torchvision", "arch": "resnet18", "weights": "ResNet18_Weights.IMAGENET1K_V1",
      "input_size": 64}, "input_size is set by the weights ResNet18_Weights.IMAGENET1K_V1' own preprocessing"),
    ({"name": "vit_digits", "input_size": 64}, "input_size: not a setting of reference models"),
])
def test_bad_model_entries(entry, words):
    with pytest.raises(ModelSourceError) as e:
        parse_ref(entry)
    assert words in str(e.value) and "\n" not in str(e.value)


def test_a_checkpoint_is_identified_by_its_file_sha256_in_every_key(tmp_path, sources):
    """Two entries naming the same file (a copy at another path, under another display name) share the digest, the
    dense-target key and the mask key; another file of the same architecture gets its own."""
    import shutil

    from safetensors.torch import save_file

    from orchestrator.spec.plan import expand_cells
    from orchestrator.spec import parse_spec
    from orchestrator.sweep.stages import model_info
    from tasks.store import content_key

    m, a = _tiny_checkpoint(tmp_path)
    (tmp_path / "elsewhere").mkdir()
    copy = shutil.copy(a, tmp_path / "elsewhere" / "copy.safetensors")
    sd = {k: v.clone().contiguous() for k, v in m.state_dict().items()}
    sd["head.bias"][0] += 1.0  # one weight differs
    save_file(sd, str(tmp_path / "b.safetensors"))

    def entry(name, path):
        return {"name": name, "source": "checkpoint", "arch": "deit_tiny_patch16_224", "path": str(path),
                "num_classes": N_CLASSES, "model_args": TINY}

    spec = parse_spec({"name": "k", "models": [entry("a", a), entry("a_copy", copy), entry("b", tmp_path / "b.safetensors")],
                       "dataset": {"name": "imagefolder", "root": str(sources["folder"]), "sizes": SIZES},
                       "sparsities": [0.5], "calib_sizes": [4], "pruners": ["magnitude"], "healers": ["starfish"],
                       "offline": True})
    infos = {n: model_info(spec, n, str(tmp_path / "cache")) for n in spec.models}
    assert infos["a"].digest == infos["a_copy"].digest == file_digest(a) != infos["b"].digest
    assert infos["a"].store_key == infos["a_copy"].store_key != infos["b"].store_key
    masks = {c.model: content_key(c.mask_identity(infos[c.model].digest, infos[c.model].calib_digest))
             for c in expand_cells(spec, {n: i.scope for n, i in infos.items()})}
    assert masks["a"] == masks["a_copy"] != masks["b"]
    assert not (tmp_path / "cache").exists()


def test_a_model_with_fewer_outputs_than_the_dataset_has_classes_is_refused(sources):
    """Labels past the logits would fail every trial (cross entropy, accuracy): one line when the model loads."""
    from tasks.models.external import num_outputs
    from torchvision.models import resnet18

    dataset = {"name": "imagefolder", "root": str(sources["folder"]), "sizes": SIZES}
    small = {"name": "r2", "source": "timm", "arch": "resnet18", "pretrained": False, "num_classes": N_CLASSES - 1}
    with pytest.raises(ModelSourceError, match=r"^model 'r2' has 2 outputs but dataset 'imagefolder' has 3 classes; "
                                               r"set num_classes: 3 on the model entry$"):
        load_external(small, dataset)
    assert load_external({**small, "num_classes": N_CLASSES}, dataset).dataset.num_classes == N_CLASSES
    assert num_outputs(resnet18(num_classes=7)) == 7  # torchvision: no num_classes attribute, its fc's width


def test_a_truncated_or_mismatching_external_checkpoint_is_refused_in_one_line(tmp_path):
    _, path = _tiny_checkpoint(tmp_path)
    entry = {"name": "t", "source": "checkpoint", "arch": "deit_tiny_patch16_224", "path": str(path),
             "num_classes": N_CLASSES, "model_args": TINY}
    cut = tmp_path / "cut.safetensors"
    cut.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(ModelSourceError) as e:
        parse_ref({**entry, "path": str(cut)})
    assert str(e.value).startswith(f"checkpoint {str(cut)!r}: truncated or padded") and "\n" not in str(e.value)
    pinned = parse_ref({**entry, "sha256": "0" * 16})  # a pin is checked when the file is loaded
    with pytest.raises(ModelSourceError, match=rf"^checkpoint {str(path)!r}: sha256 {file_digest(path)}… does not "
                                               r"match the expected 0000000000000000…; refused \(not loaded\)$"):
        MODEL_SOURCES.get("checkpoint").load(pinned)
    assert MODEL_SOURCES.get("checkpoint").digest(pinned) == file_digest(path)  # the pin is not the identity
    with pytest.raises(ModelSourceError, match="sha256: must be 16 to 64 hex characters"):
        parse_ref({**entry, "sha256": "xyz"})
