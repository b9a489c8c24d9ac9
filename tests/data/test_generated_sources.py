"""Generated image data (tasks/data/synthetic.py) through every image source, a local ``save_to_disk`` Hugging Face
dataset as the ``hf`` source, and the one-line ``DatasetError`` for the bad files a user meets."""
from __future__ import annotations

import re

import numpy as np
import pytest
import torch

from tasks.data import SPLITS, DatasetError, load_dataset
from tasks.data.synthetic import synthetic_images, write_hf_dataset, write_image_folder, write_image_table

SIZES = {"train": 2, "calibration": 6, "selection": 4, "evaluation": 6}  # 18 of 4 x 5 = 20 images


def _transform():
    from torchvision import transforms as T

    return T.Compose([T.Resize(8), T.ToTensor()]), "test:resize8"


@pytest.fixture(scope="module")
def generated(tmp_path_factory):
    root = tmp_path_factory.mktemp("gen")
    kw = {"num_classes": 4, "per_class": 5, "size": 12, "seed": 3}
    return {"folder": write_image_folder(root / "folder", **kw), "table": write_image_table(root / "t.parquet", **kw),
            "hf": write_hf_dataset(root / "hf", **kw), "root": root}


def _load(name: str, **settings):
    t, tid = _transform()
    return load_dataset(name, seed=0, transform=t, transform_id=tid, **{"sizes": SIZES, **settings})


def test_generated_images_are_seeded_class_colours():
    a, b = list(synthetic_images(3, 2, 6, seed=1)), list(synthetic_images(3, 2, 6, seed=1))
    assert [(lab, rel) for _, lab, rel in a] == [(0, "c000/img000.png"), (0, "c000/img001.png"),
                                                  (1, "c001/img000.png"), (1, "c001/img001.png"),
                                                  (2, "c002/img000.png"), (2, "c002/img001.png")]
    assert all(np.array_equal(x[0], y[0]) and x[0].shape == (6, 6, 3) for x, y in zip(a, b))
    assert not np.array_equal(a[0][0], next(synthetic_images(3, 2, 6, seed=2))[0])
    means = [img.reshape(-1, 3).mean(0) for img, _, _ in a]  # same class: colours agree within the noise
    assert np.abs(means[0] - means[1]).max() < 15 and np.abs(means[0] - means[2]).max() > 15
    with pytest.raises(ValueError, match="need num_classes, per_class and size >= 1"):
        next(synthetic_images(0, 2, 6))


def test_folder_table_and_saved_hf_dataset_give_the_same_splits_and_pixels(generated):
    folder = _load("imagefolder", root=str(generated["folder"]))
    table = _load("image_table", path=str(generated["table"]))
    hf = _load("hf", path=str(generated["hf"]))
    streamed = _load("hf", path=str(generated["hf"]), streaming=True, buffer_size=4)
    for d in (folder, table, hf, streamed):
        assert d.num_classes == 4 and d.image_shape == (3, 8, 8)
        assert {s: len(d[s]) for s in SPLITS} == SIZES and d["calibration"].labels is None
    for d in (table, hf):  # the same rows, in the same order, bit-identical (PNG is lossless)
        for s in SPLITS:
            assert np.array_equal(d[s].indices, folder[s].indices)
            assert torch.equal(d[s].images[:], folder[s].images[:])
    assert hf["evaluation"].labels.tolist() == [int(i) // 5 for i in hf["evaluation"].indices]
    seen = np.concatenate([streamed[s].indices for s in SPLITS])  # stream positions: disjoint, in range
    assert len(set(seen.tolist())) == len(seen) == 18 and seen.max() < 20
    assert hf.digest == _load("hf", path=str(generated["hf"])).digest != streamed.digest


def test_a_saved_dataset_maps_hub_splits_by_name(generated, tmp_path):
    import datasets

    saved = datasets.load_from_disk(str(generated["hf"]))["train"]
    datasets.DatasetDict({"train": saved.select(range(12)), "test": saved.select(range(12, 20))}).save_to_disk(
        str(tmp_path / "two"))
    d = _load("hf", path=str(tmp_path / "two"), splits={"evaluation": "test"},
              sizes={**SIZES, "train": 0, "evaluation": 8})
    assert sorted(d["evaluation"].indices.tolist()) == list(range(8))  # rows of the test split
    assert d["evaluation"].labels.tolist() == [2 + int(i >= 3) for i in d["evaluation"].indices]
    with pytest.raises(DatasetError, match=r"has no split 'validation'; it holds: test, train$"):
        _load("hf", path=str(tmp_path / "two"), splits={"evaluation": "validation"})
    saved.save_to_disk(str(tmp_path / "one"))  # a single Dataset: its recorded split
    assert len(_load("hf", path=str(tmp_path / "one"))["calibration"]) == SIZES["calibration"]


def test_bad_files_are_one_line_dataset_errors(generated, tmp_path):
    from tasks.data import DATASETS

    with pytest.raises(DatasetError, match=r"^root: image folder '.*nope' does not exist$"):
        DATASETS.get("imagefolder").check({"root": str(tmp_path / "nope")})
    with pytest.raises(DatasetError, match=r"^path: image table '.*nope.parquet' does not exist$"):
        DATASETS.get("image_table").check({"path": str(tmp_path / "nope.parquet")})
    (tmp_path / "a.png").write_bytes(b"")
    with pytest.raises(DatasetError, match=r"^root: image folder '.*a.png' is not a folder$"):
        DATASETS.get("imagefolder").check({"root": str(tmp_path / "a.png")})
    with pytest.raises(ValueError, match=r"^root: must be a path or name \(a string\), got int$"):
        DATASETS.get("imagefolder").check({"root": 123})
    (tmp_path / "empty").mkdir()
    with pytest.raises(DatasetError, match=r"^image folder '.*empty': Couldn't find any class folder"):
        _load("imagefolder", root=str(tmp_path / "empty"))
    (tmp_path / "junk.parquet").write_text("not parquet")
    with pytest.raises(DatasetError, match=r"^image table '.*junk.parquet' is not a readable parquet file: "):
        _load("image_table", path=str(tmp_path / "junk.parquet"))
    with pytest.raises(DatasetError, match=r"^image table '.*' has no column 'img'; columns: image, label$"):
        _load("image_table", path=str(generated["table"]), image_column="img")
    with pytest.raises(DatasetError, match=r"folder: splits need train 2 \+ calibration 40 \+ selection 4 \+ "
                                           r"evaluation 6 = 52 items from the image folder, which has 20; set smaller "
                                           r"dataset.sizes \(docs/models-and-data.md#dataset-settings\) or add items$"):
        _load("imagefolder", root=str(generated["folder"]), sizes={**SIZES, "calibration": 40})
    bad = tmp_path / "bad"
    write_image_folder(bad, num_classes=2, per_class=2, size=4)
    (bad / "c000" / "img000.png").write_text("not a png")
    with pytest.raises(DatasetError, match=r"^cannot decode image '.*img000.png': cannot identify image file"):
        sizes = {"train": 0, "calibration": 4, "selection": 0, "evaluation": 0}
        _load("imagefolder", root=str(bad), sizes=sizes)["calibration"].images[:]  # at the probe or here


def test_a_label_column_that_holds_no_class_indices_is_one_line(generated, tmp_path):
    """Null labels were read as -2**63 (those images counted misclassified, the sweep ran), fractional labels were
    truncated, text labels ended in "invalid literal for int()": each is now one line naming the column, at the
    check (``validate``) and at load. Integral floats (0.0, 1.0, ...) are class indices."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from tasks.data import DATASETS

    table = pq.read_table(generated["table"])
    labels = table.column("label").to_pylist()
    cases = {"null": ([None if i % 5 == 0 else v for i, v in enumerate(labels)], "has 4 empty \\(null\\) label\\(s\\) of 20"),
             "half": ([v + 0.5 for v in labels], "holds non-integer labels \\(e.g. 0.5\\)"),
             "text": ([f"c{v}" for v in labels], "holds string values, not integer class indices")}
    for name, (values, why) in cases.items():
        path = tmp_path / f"{name}.parquet"
        pq.write_table(table.set_column(1, "label", pa.array(values)), path)
        with pytest.raises(DatasetError, match=f"^image table '.*{name}.parquet': label column 'label' {why}"):
            DATASETS.get("image_table").check({"path": str(path), "sizes": SIZES})
        with pytest.raises(DatasetError, match=f"^image table '.*{name}.parquet': label column 'label' {why}"):
            _load("image_table", path=str(path))
    pq.write_table(table.set_column(1, "label", pa.array([float(v) for v in labels])), tmp_path / "whole.parquet")
    got = _load("image_table", path=str(tmp_path / "whole.parquet"))
    assert got["evaluation"].labels.tolist() == _load("image_table", path=str(generated["table"]))["evaluation"].labels.tolist()


@pytest.mark.parametrize("name, key", [("imagefolder", "root"), ("image_table", "path")])
def test_the_check_counts_a_local_source_against_the_split_sizes(generated, tmp_path, name, key):
    """``check`` (what ``healsweep validate`` runs) refuses a folder or table with fewer items than the four splits
    need, with each split's size and what it holds; exactly enough passes. A folder counts what the loader would:
    files with an image extension in class folders (a text file beside the images is not an item)."""
    from tasks.data import DATASETS

    where = generated["folder"] if name == "imagefolder" else generated["table"]
    (generated["folder"] / "c000" / "notes.txt").write_text("not an image")
    check = DATASETS.get(name).check
    exactly = {"train": 0, "calibration": 10, "selection": 5, "evaluation": 5}  # 20 = 4 classes x 5
    assert check({key: str(where), "sizes": exactly}) == 10
    assert len(_load(name, **{key: str(where)}, sizes=exactly)["evaluation"]) == 5  # the loader agrees
    what = "image folder" if name == "imagefolder" else "table"
    with pytest.raises(DatasetError, match=rf"^sizes: splits need calibration 11 \+ selection 5 \+ evaluation 5 = 21 "
                                           rf"items from the {what} '{re.escape(str(where))}', which has 20; set smaller dataset.sizes"):
        check({key: str(where), "sizes": {**exactly, "calibration": 11}})


def test_the_check_refuses_an_empty_class_folder_as_the_loader_does(tmp_path):
    from tasks.data import DATASETS

    root = write_image_folder(tmp_path / "f", num_classes=3, per_class=4, size=8)
    (root / "zebra").mkdir()  # sorted last: counted after the 12 images already cover the splits
    (root / "zebra" / "notes.txt").write_text("no image here")
    sizes = {"train": 0, "calibration": 4, "selection": 2, "evaluation": 2}
    for refuse in (lambda: DATASETS.get("imagefolder").check({"root": str(root), "sizes": sizes}),
                   lambda: _load("imagefolder", root=str(root), sizes=sizes)):
        with pytest.raises(DatasetError, match=r"^image folder '.*f': Found no valid file for the classes zebra\. "
                                               r"Supported extensions are: \.jpg"):
            refuse()


@pytest.mark.parametrize("name, key", [("imagefolder", "root"), ("image_table", "path")])
def test_the_check_refuses_a_source_with_one_class(tmp_path, name, key):
    """A folder with one class folder, or a table whose labels are all 0, is refused at validate (every accuracy
    of a one-class problem is the same, so no cell could say anything); two classes pass."""
    from tasks.data import DATASETS
    from tasks.data.synthetic import write_image_table

    sizes = {"train": 0, "calibration": 4, "selection": 2, "evaluation": 2}
    check = DATASETS.get(name).check
    for classes in (1, 2):
        where = (write_image_folder(tmp_path / f"f{classes}", num_classes=classes, per_class=8, size=4)
                 if name == "imagefolder" else
                 write_image_table(tmp_path / f"t{classes}.parquet", num_classes=classes, per_class=8, size=4))
        if classes == 2:
            assert check({key: str(where), "sizes": sizes}) == 4
            continue
        with pytest.raises(DatasetError, match=rf"^{key}: the (image folder|table) '.*' holds 1 class; "
                                               r"classification needs at least 2$"):
            check({key: str(where), "sizes": sizes})


@pytest.mark.parametrize("streaming", [False, True])
def test_a_column_the_dataset_lacks_is_one_line(generated, streaming):
    """A misspelt label_column gave every image the label -1: the sweep finished with every accuracy 0 % and no
    error; a misspelt image_column ended in a KeyError traceback. Each is now one line naming the column."""
    path, kw = str(generated["hf"]), ({"streaming": True, "buffer_size": 4} if streaming else {})
    for key in ("label_column", "image_column"):
        with pytest.raises(DatasetError, match=f"has no column 'lbl' \\({key}\\); its columns: image, label$"):
            _load("hf", path=path, **kw, **{key: "lbl"})


def test_an_unlabeled_split_may_serve_calibration_only(generated, tmp_path):
    """Calibration needs no labels: a hub split without the label column still serves it; serving selection or
    evaluation it is refused in one line."""
    import datasets

    saved = datasets.load_from_disk(str(generated["hf"]))["train"]
    datasets.DatasetDict({"train": saved.select(range(12)),
                          "unlabeled": saved.select(range(12, 20)).remove_columns("label")}).save_to_disk(
        str(tmp_path / "two"))
    d = _load("hf", path=str(tmp_path / "two"), splits={"calibration": "unlabeled"},
              sizes={"train": 0, "calibration": 6, "selection": 4, "evaluation": 6})
    assert len(d["calibration"]) == 6 and d["calibration"].labels is None and d.num_classes == 4
    with pytest.raises(DatasetError, match="has no column 'label' \\(label_column\\); its columns: image$"):
        _load("hf", path=str(tmp_path / "two"), splits={"evaluation": "unlabeled"},
              sizes={"train": 0, "calibration": 6, "selection": 4, "evaluation": 6})
