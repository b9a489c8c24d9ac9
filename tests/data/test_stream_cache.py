"""Streamed datasets' machine cache (tasks/data/stream_cache.py): the first process on a machine streams a split's
items and writes them to one Arrow file; later loads (other processes, or this one after its memo is cleared)
memory-map it and get the same rows, labels, pixels and digest as a load with the cache off. Checked on a local
``save_to_disk`` dataset read as a stream (the ``hf`` source's streamed code path, offline)."""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
import torch

from tasks.data import SPLITS, load_dataset
from tasks.data import images as image_datasets
from tasks.data import hub
from tasks.data.stream_cache import CACHE_ENV
from tasks.data.synthetic import write_hf_dataset

SIZES = {"train": 2, "calibration": 6, "selection": 4, "evaluation": 6}  # 18 of the 20 streamed items
pytestmark = pytest.mark.timeout(120)


def _load(path: Path, sizes=SIZES, **settings):
    from torchvision import transforms as T

    image_datasets._MEMO.clear()  # a fresh process's view: nothing memoised
    return load_dataset("hf", seed=0, transform=T.Compose([T.Resize(8), T.ToTensor()]), transform_id="test:r8",
                        path=str(path), streaming=True, buffer_size=4, sizes=sizes, **settings)


def _source(d) -> str:
    return d["calibration"].images.table.source  # StreamTable: 'stream' or 'cache'


def _same(a, b) -> None:
    assert a.digest == b.digest and a.num_classes == b.num_classes
    for s in SPLITS:
        assert np.array_equal(a[s].indices, b[s].indices)
        assert torch.equal(a[s].images[:], b[s].images[:])
        assert (a[s].labels is None and b[s].labels is None) or torch.equal(a[s].labels, b[s].labels)


@pytest.fixture()
def data(tmp_path, monkeypatch):
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    return write_hf_dataset(tmp_path / "hf", num_classes=4, per_class=5, size=12, seed=3)


def _off(path: Path, monkeypatch, **kw):
    with monkeypatch.context() as m:
        m.setenv(CACHE_ENV, "off")
        d = _load(path, **kw)
    assert _source(d) == "stream"
    return d


def test_the_second_load_reads_the_cache_and_equals_a_load_without_it(data, tmp_path, monkeypatch):
    first = _load(data)
    files = sorted((tmp_path / "cache").glob("*.arrow"))
    assert _source(first) == "stream" and len(files) == 1  # one hub split ('train') -> one file
    assert pa.ipc.open_file(str(files[0])).read_all().num_rows == 18
    with monkeypatch.context() as m:  # the stream may be opened, not read: only the cache can serve this load
        m.setattr(hub, "_take", lambda *a: pytest.fail("streamed again"))
        second = _load(data)
    assert _source(second) == "cache"
    _same(first, second)
    _same(first, _off(data, monkeypatch))


def test_a_smaller_need_is_a_prefix_of_the_cache_and_a_larger_one_streams_again(data, tmp_path, monkeypatch):
    _load(data)
    small = {**SIZES, "evaluation": 2}  # 14 items: the first 14 of the same shuffled stream
    d = _load(data, sizes=small)
    assert _source(d) == "cache"
    _same(d, _off(data, monkeypatch, sizes=small))
    large = {**SIZES, "evaluation": 8}  # 20 items: more than the file holds
    d = _load(data, sizes=large)
    assert _source(d) == "stream"
    _same(d, _off(data, monkeypatch, sizes=large))
    (f,) = (tmp_path / "cache").glob("*.arrow")  # replaced by the larger one, nothing left behind
    assert pa.ipc.open_file(str(f)).read_all().num_rows == 20
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == [f.name, f.name + ".lock"]
    assert _source(_load(data, sizes=large)) == "cache"


def test_data_rewritten_in_place_is_not_served_from_the_old_copy(data, monkeypatch):
    before = _load(data)
    shutil.rmtree(data)
    write_hf_dataset(data, num_classes=4, per_class=5, size=12, seed=4)  # other pixels, same path
    after = _load(data)
    assert _source(after) == "stream"
    assert not torch.equal(after["calibration"].images[:], before["calibration"].images[:])
    _same(after, _off(data, monkeypatch))


def test_a_warm_cache_makes_no_hub_call(tmp_path, monkeypatch):
    """A hub stream (here a local image folder opened by ``datasets.load_dataset``, as a hub id would be) is opened
    only when the cache lacks its items: a second load with the hub unreachable is served from the cache, equal to
    the first; with a cold cache the same outage is the one-line DatasetError naming the split."""
    import datasets

    from tasks.data.splits import DatasetError
    from tasks.data.synthetic import write_image_folder

    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    folder = write_image_folder(tmp_path / "folder", num_classes=4, per_class=5, size=12, seed=5)
    opened = []
    real = datasets.load_dataset

    def counting(*a, **k):
        opened.append(k.get("split"))
        return real(*a, **k)

    monkeypatch.setattr(datasets, "load_dataset", counting)
    first = _load(folder)
    assert _source(first) == "stream" and opened == ["train"]

    def offline(*a, **k):
        raise ConnectionError("hub unreachable")

    monkeypatch.setattr(datasets, "load_dataset", offline)
    second = _load(folder)
    assert _source(second) == "cache"
    _same(first, second)
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cold"))
    with pytest.raises(DatasetError, match="split 'train': hub unreachable"):
        _load(folder)


def test_a_damaged_cache_file_is_streamed_again(data, tmp_path, monkeypatch, capsys):
    first = _load(data)
    (f,) = (tmp_path / "cache").glob("*.arrow")
    torn = f.read_bytes()[: f.stat().st_size // 2]  # no footer
    f.unlink()  # not rewritten in place: `first` maps the old file (the cache itself only ever renames)
    f.write_bytes(torn)
    again = _load(data)
    assert _source(again) == "stream" and "is damaged" in capsys.readouterr().err
    _same(first, again)
    assert _source(_load(data)) == "cache"  # written whole again


def test_an_unwritable_cache_keeps_the_items_in_ram(data, tmp_path, monkeypatch, capsys):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    monkeypatch.setenv(CACHE_ENV, str(blocker / "cache"))  # mkdir under a file fails
    d = _load(data)
    assert _source(d) == "stream" and "keeping the stream's items in RAM" in capsys.readouterr().err
    _same(d, _off(data, monkeypatch))


_CHILD = """
import hashlib, json, sys
from torchvision import transforms as T
from tasks.data import load_dataset
d = load_dataset("hf", seed=0, transform=T.Compose([T.Resize(8), T.ToTensor()]), transform_id="test:r8",
                 path=sys.argv[1], streaming=True, buffer_size=4, sizes=json.loads(sys.argv[2]))
x = d["calibration"].images[:]
print(json.dumps({"source": d["calibration"].images.table.source, "digest": d.digest,
                  "pixels": hashlib.sha256(x.numpy().tobytes()).hexdigest()}))
"""


@pytest.mark.timeout(240)
def test_processes_started_together_stream_once(data, tmp_path):
    env = {**os.environ, CACHE_ENV: str(tmp_path / "cache"), "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    procs = [subprocess.Popen([sys.executable, "-c", _CHILD, str(data), json.dumps(SIZES)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(3)]
    outs = []
    for p in procs:
        out, err = p.communicate(timeout=220)
        assert p.returncode == 0, err[-2000:]
        outs.append(json.loads(out.strip().splitlines()[-1]))
    assert sorted(o["source"] for o in outs) == ["cache", "cache", "stream"]  # the machine lock: one streams
    assert len({(o["digest"], o["pixels"]) for o in outs}) == 1
    x = _load(data)["calibration"].images[:]
    assert outs[0]["pixels"] == hashlib.sha256(x.numpy().tobytes()).hexdigest()


_NO_FDS = """
import errno, os, resource, sys
from pathlib import Path
from tasks.data.stream_cache import open_cached
from tasks.errors import DatasetError
resource.setrlimit(resource.RLIMIT_NOFILE, (64, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
try:
    while True:
        os.open(os.devnull, os.O_RDONLY)  # every descriptor taken: the cache file cannot be opened (EMFILE)
except OSError as e:
    assert e.errno == errno.EMFILE
try:
    open_cached(Path(sys.argv[1]), 3)
except DatasetError as e:
    print(e)
"""


def test_a_cache_file_that_cannot_be_opened_is_kept_and_named(data, tmp_path):
    """Too many open files (or no permission) is not damage: the file was deleted as damaged and streamed again;
    now one line names it and it stays."""
    _load(data)
    (f,) = (tmp_path / "cache").glob("*.arrow")
    before = f.read_bytes()
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    r = subprocess.run([sys.executable, "-c", _NO_FDS, str(f)], env=env, capture_output=True, text=True, timeout=100)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.startswith(f"stream cache {str(f)!r} cannot be read: [Errno 24]") and "is damaged" not in r.stderr
    assert f.read_bytes() == before
