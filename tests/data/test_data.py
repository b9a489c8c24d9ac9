"""Data splits (tasks.data): disjointness, sizes, unlabeled calibration, seeded order, digests."""
import numpy as np
import pytest
import torch

from tasks.data import (DIGITS_SPLIT_SIZES, SPLITS, DatasetSplits, SplitData, digits_preprocess, load_dataset,
                        load_digits, redraw_calibration, split_indices)


def test_digits_splits_disjoint_sizes_and_unlabeled_calibration():
    d = load_digits(0)
    assert (d.name, d.num_classes, d.image_shape) == ("digits", 10, (1, 16, 16))
    assert {s: len(d[s]) for s in SPLITS} == DIGITS_SPLIT_SIZES == {"train": 937, "calibration": 320,
                                                                    "selection": 180, "evaluation": 360}
    idx = [d[s].indices for s in SPLITS]
    allidx = np.concatenate(idx)
    assert len(np.unique(allidx)) == len(allidx) == 1797  # disjoint, and together the whole dataset
    assert allidx.min() == 0 and allidx.max() == 1796
    assert d["calibration"].labels is None
    for s in ("train", "selection", "evaluation"):
        sd = d[s]
        assert sd.labels.dtype == torch.int64 and sd.labels.shape == (len(sd),)
        assert sd.images.shape == (len(sd), 1, 16, 16) and sd.images.dtype == torch.float32
    assert set(torch.cat([d[s].labels for s in ("train", "evaluation")]).tolist()) == set(range(10))


def test_digits_images_follow_split_indices():
    from sklearn.datasets import load_digits as sk

    raw = sk().images
    d = load_digits(0)
    for s in ("calibration", "evaluation"):
        i = d[s].indices[:7]
        assert torch.equal(d[s].images[:7], digits_preprocess(raw[i]))
    i = d["evaluation"].indices[:7]
    assert d["evaluation"].labels[:7].tolist() == sk().target[i].tolist()


def test_digits_preprocess_range_and_constants():
    raw = np.stack([np.zeros((8, 8)), np.full((8, 8), 16.0), np.full((8, 8), 8.0)])
    x = digits_preprocess(raw)
    assert x.shape == (3, 1, 16, 16) and x.dtype == torch.float32
    assert torch.all(x[0] == -1.0) and torch.all(x[1] == 1.0) and torch.all(x[2] == 0.0)
    d = load_digits(0)
    assert d["train"].images.min() >= -1.0 and d["train"].images.max() <= 1.0


def test_seeded_order():
    a, b, c = load_digits(0), load_digits(0), load_digits(1)
    for s in SPLITS:
        np.testing.assert_array_equal(a[s].indices, b[s].indices)
        assert not np.array_equal(a[s].indices, c[s].indices)
    assert a.digest == b.digest != c.digest
    assert load_dataset("digits", seed=1).digest == c.digest
    with pytest.raises(KeyError, match="unknown dataset"):
        load_dataset("imagenet-typo")


def test_split_indices_properties():
    sizes = {"train": 5, "calibration": 3, "selection": 2, "evaluation": 4}
    a = split_indices(20, sizes, seed=4)
    assert list(a) == list(SPLITS) and {s: len(v) for s, v in a.items()} == sizes
    allidx = np.concatenate(list(a.values()))
    assert len(set(allidx.tolist())) == 14 and all(0 <= i < 20 for i in allidx)
    assert all(v.dtype == np.int64 for v in a.values())
    perm = np.random.default_rng(4).permutation(20)  # consecutive slices of one seeded permutation
    np.testing.assert_array_equal(allidx, perm[:14])
    b = split_indices(20, sizes, seed=4)
    assert all(np.array_equal(a[s], b[s]) for s in SPLITS)
    c = split_indices(20, sizes, seed=5)
    assert not all(np.array_equal(a[s], c[s]) for s in SPLITS)
    assert sum(len(v) for v in split_indices(14, sizes, seed=0).values()) == 14  # exactly fits


def test_split_indices_rejects_oversized():
    with pytest.raises(ValueError, match="add up to 15 but the dataset has 14"):
        split_indices(14, {"train": 5, "calibration": 4, "selection": 2, "evaluation": 4}, seed=0)


def test_split_digest_prefix_semantics():
    d = load_digits(0)
    digests = [d.split_digest("calibration", n) for n in (1, 10, 11, 100, 320)]
    assert len(set(digests)) == 5 and all(len(h) == 16 for h in digests)
    assert d.split_digest("calibration", 10) == load_digits(0).split_digest("calibration", 10)  # stable
    assert d.split_digest("calibration") == d.split_digest("calibration", 320)  # None = all
    assert d.split_digest("calibration", 10) != d.split_digest("selection", 10)
    assert d.split_digest("calibration", 10) != load_digits(1).split_digest("calibration", 10)


def test_split_digest_depends_only_on_the_prefix():
    def ds(idx):
        n = len(idx)
        sd = SplitData(torch.zeros(n, 1, 2, 2), None, np.asarray(idx, dtype=np.int64))
        return DatasetSplits("toy", 2, (1, 2, 2), {"calibration": sd}, digest="abc")

    a, b = ds([4, 1, 7, 2, 9]), ds([4, 1, 7, 3, 8])
    assert a.split_digest("calibration", 3) == b.split_digest("calibration", 3)
    assert a.split_digest("calibration", 4) != b.split_digest("calibration", 4)
    assert ds([4, 1, 7]).split_digest("calibration") == a.split_digest("calibration", 3)
    c = DatasetSplits("toy", 2, (1, 2, 2), a.splits, digest="abd")  # dataset digest is part of it
    assert c.split_digest("calibration", 3) != a.split_digest("calibration", 3)


def test_digits_read_from_the_bundled_file_equal_scikit_learns_loader():
    """tasks/data/digits.py parses scikit-learn's digits.csv.gz without importing sklearn: same values, same
    dtypes as sklearn.datasets.load_digits (images (1797, 8, 8) float64, labels int)."""
    import subprocess
    import sys

    from sklearn.datasets import load_digits as sk

    from tasks.data.digits import digits_arrays

    raw, target = digits_arrays()
    b = sk()
    assert raw.shape == (1797, 8, 8) and raw.dtype == b.images.dtype and np.array_equal(raw, b.images)
    assert target.dtype == b.target.dtype and np.array_equal(target, b.target)
    probe = "import sys; from tasks.data.digits import digits_arrays; digits_arrays(); print('sklearn' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "False", out.stderr[-1000:]


def test_redraw_calibration_is_another_seeded_draw_of_the_same_split():
    d = load_digits(0)
    assert redraw_calibration(d, 0) is d  # the data seed's order: every earlier sweep's images
    r, again, other = redraw_calibration(d, 1), redraw_calibration(d, 1), redraw_calibration(d, 2)
    cal, rc = d["calibration"], r["calibration"]
    # the same 320 images, another order; row i's pixels are still those of dataset item indices[i]
    assert sorted(rc.indices.tolist()) == sorted(cal.indices.tolist()) and not np.array_equal(rc.indices, cal.indices)
    pos = {int(j): i for i, j in enumerate(cal.indices)}
    assert torch.equal(rc.images, cal.images[torch.tensor([pos[int(j)] for j in rc.indices])])
    assert rc.labels is None and np.array_equal(again["calibration"].indices, rc.indices)  # seeded
    assert not np.array_equal(other["calibration"].indices[:64], rc.indices[:64])
    # 64 images: mostly other items than the first 64 of the data seed's order (expected overlap 64 * 64/320 = 12.8)
    assert len(set(rc.indices[:64].tolist()) & set(cal.indices[:64].tolist())) < 32
    for s in ("selection", "evaluation"):  # what is measured, and the dataset digest, untouched
        assert r[s] is d[s]
    # train: another order too (ce's labeled set is its first n), pixels and labels still follow the indices
    tr, rt = d["train"], r["train"]
    assert sorted(rt.indices.tolist()) == sorted(tr.indices.tolist()) and not np.array_equal(rt.indices[:64], tr.indices[:64])
    tpos = torch.tensor([{int(j): i for i, j in enumerate(tr.indices)}[int(j)] for j in rt.indices])
    assert torch.equal(rt.images, tr.images[tpos]) and torch.equal(rt.labels, tr.labels[tpos])
    assert r.digest == d.digest
    assert r.split_digest("calibration", 64) != d.split_digest("calibration", 64)  # store key, masks: its own
    assert r.split_digest("selection") == d.split_digest("selection")


def test_redraw_calibration_keeps_a_tables_images_lazy(tmp_path):
    from torchvision import transforms as T

    from tasks.data.synthetic import write_image_table
    from tasks.data.tables import LazyImages

    path = write_image_table(tmp_path / "t.parquet", num_classes=3, per_class=6, size=8, seed=0)
    d = load_dataset("image_table", seed=0, path=str(path), transform=T.ToTensor(), transform_id="t",
                     sizes={"train": 2, "calibration": 8, "selection": 4, "evaluation": 4})
    r = redraw_calibration(d, 5)
    assert isinstance(r["calibration"].images, LazyImages)
    pos = {int(j): i for i, j in enumerate(d["calibration"].indices)}
    order = torch.tensor([pos[int(j)] for j in r["calibration"].indices])
    assert not torch.equal(order, torch.arange(8))
    assert torch.equal(r["calibration"].images[:], d["calibration"].images[:][order])
