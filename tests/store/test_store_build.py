"""ensure_targets (verify/repair/resume/append), concurrent writers, pyarrow.fs roots, streaming reads."""
import subprocess
import sys
import textwrap
import threading

import numpy as np
import pyarrow.fs as pafs
import pytest
import torch

from tasks.store import StoreError, TargetStore, content_key, ensure_targets
from tests.store_helpers import SHAPES, Runner, fake_targets

KEY = content_key({"test": "build"})
META = {"model": "fake"}


def ensure(st, n, runner, shard_size=4, dtype="float16"):
    return ensure_targets(st, KEY, n, shard_size, runner, meta=META, dtype=dtype,
                          calibration_rows=list(range(100, 100 + 64)))


def bits_equal(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.int16), b.view(torch.int16))


def test_first_build_then_noop_manifest_fields(tmp_path):
    st = TargetStore(tmp_path)
    r = Runner(st, KEY)
    res = ensure(st, 10, r)
    assert r.calls == [(0, 0, 4), (1, 4, 8), (2, 8, 10)] and res.computed_rows == 10 and res.events == []
    m = st.manifest(KEY)
    assert m["num_rows"] == 10 and m["calibration_rows"] == list(range(100, 110))
    assert set(m["producer"]) >= {"healsweep", "torch", "pyarrow"} and m["row_bytes"] == 2 * (12 + 5)
    assert [s["bytes"] for s in m["shards"]] == [st.fs.size(f"{KEY}/{s['file']}") for s in m["shards"]]
    r2 = Runner(st, KEY)
    assert ensure(st, 10, r2).computed_shards == [] and r2.calls == []
    assert ensure(st, 6, r2).computed_shards == [] and r2.calls == []  # smaller size: a prefix, nothing new


def test_interrupted_build_resumes_only_missing_shards(tmp_path):
    st = TargetStore(tmp_path)
    full = fake_targets(14)
    # A crashed stage: shards 0 and 2 landed, shard 1 was killed mid-write (temp file left), 3 never started.
    for i, a, b in ((0, 0, 4), (2, 8, 12)):
        st.write_shard(KEY, i, a, {k: v[a:b] for k, v in full.items()})
    (st.key_dir(KEY) / ".tmp-deadbeef-shard-00001.arrow").write_bytes(b"partial")
    r = Runner(st, KEY)
    res = ensure(st, 14, r)
    assert r.calls == [(1, 4, 8), (3, 12, 14)] and res.computed_rows == 6
    assert not any(p.name.startswith(".tmp-") for p in st.key_dir(KEY).iterdir())
    with st.open(KEY, verify=True) as rd:
        for k, v in rd.load_all().items():
            assert bits_equal(v, full[k])


def test_nested_sizes_append_only_missing_rows(tmp_path):
    st = TargetStore(tmp_path)
    ensure(st, 10, Runner(st, KEY))  # shards [0,4) [4,8) [8,10)
    r = Runner(st, KEY)
    res = ensure(st, 17, r)
    assert r.calls == [(3, 10, 14), (4, 14, 17)] and res.computed_rows == 7  # the short shard stays as it is
    m = st.manifest(KEY)
    assert [(s["row_start"], s["row_stop"]) for s in m["shards"]] == [(0, 4), (4, 8), (8, 10), (10, 14), (14, 17)]
    assert m["num_rows"] == 17 and len(m["calibration_rows"]) == 17
    full = fake_targets(17)
    with st.open(KEY) as rd:
        for k, v in rd.load_all().items():
            assert bits_equal(v, full[k])
    with st.open(KEY, num_rows=9) as rd:  # a prefix equals the first n rows
        for k, v in rd.load_all().items():
            assert bits_equal(v, full[k][:9])


@pytest.mark.parametrize("damage", ["truncate", "flip"])
def test_damaged_shard_detected_and_recomputed(tmp_path, damage, caplog):
    st = TargetStore(tmp_path)
    ensure(st, 12, Runner(st, KEY))
    path = st.key_dir(KEY) / "shard-00001.arrow"
    data = path.read_bytes()
    path.write_bytes(data[:-8] if damage == "truncate" else data[:300] + bytes([data[300] ^ 0x10]) + data[301:])
    with pytest.raises(StoreError, match="shard-00001.arrow"):
        st.open(KEY)  # never used
    r = Runner(st, KEY)
    with caplog.at_level("WARNING", logger="healsweep.store"):
        res = ensure(st, 12, r)
    assert r.calls == [(1, 4, 8)]
    assert len(res.events) == 1 and "shard-00001.arrow" in res.events[0] and "recomputing" in res.events[0]
    assert "shard-00001.arrow" in caplog.text
    assert path.read_bytes() == data  # deterministic targets: bit-identical shard again
    assert st.verify(KEY) == []


def test_two_processes_one_key_one_valid_manifest(tmp_path):
    script = tmp_path / "writer.py"
    script.write_text(textwrap.dedent(f"""
        import sys, time
        sys.path.insert(0, {str(sys.path[0])!r})
        from tasks.store import TargetStore, ensure_targets
        from tests.store_helpers import Runner
        st = TargetStore(sys.argv[1])
        r = Runner(st, {KEY!r})
        def slow(plan):
            for info in r(plan):
                time.sleep(0.2)
                yield info
        res = ensure_targets(st, {KEY!r}, 20, 4, slow, meta={{}}, dtype="float16")
        print(len(res.computed_shards))
    """))
    import os
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    procs = [subprocess.Popen([sys.executable, str(script), str(tmp_path / "s")], stdout=subprocess.PIPE, text=True,
                              env=env) for _ in range(2)]
    counts = sorted(int(p.communicate(timeout=120)[0].strip()) for p in procs)
    assert [p.returncode for p in procs] == [0, 0]
    assert counts == [0, 5]  # the lock serialises them: the second finds the key complete
    st = TargetStore(tmp_path / "s")
    assert st.keys() == [KEY] and st.verify(KEY) == [] and st.manifest(KEY)["num_rows"] == 20
    with st.open(KEY) as rd:
        for k, v in rd.load_all().items():
            assert bits_equal(v, fake_targets(20)[k])


@pytest.mark.parametrize("how", ["uri", "subtree"])
def test_pyarrow_filesystem_roots(tmp_path, how):
    if how == "uri":
        st = TargetStore((tmp_path / "s").as_uri())
        assert st.fs.local
    else:
        (tmp_path / "s").mkdir()
        st = TargetStore("stores/a", filesystem=pafs.SubTreeFileSystem(str(tmp_path / "s"), pafs.LocalFileSystem()))
        assert not st.fs.local  # the generic (non-mmap, no-lock) code path
    r = Runner(st, KEY)
    ensure(st, 10, r)
    assert st.keys() == [KEY] and st.verify(KEY) == []
    full = fake_targets(10)
    with st.open(KEY) as rd:
        got = {k: torch.cat([b[k] for _, b in rd.iter_batches(3)]) for k in SHAPES}
        rows = np.array([9, 0, 5])
        rr = rd.read_rows(rows)
    for k in SHAPES:
        assert bits_equal(got[k], full[k]) and bits_equal(rr[k], full[k][torch.from_numpy(rows)])
    root = tmp_path / "s" if how == "uri" else tmp_path / "s" / "stores" / "a"
    assert (root / KEY / "manifest.json").is_file()
    shard = root / KEY / "shard-00001.arrow"  # one flipped byte, size unchanged: only the sha256 read catches it
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x40
    shard.write_bytes(bytes(data))
    assert [(s["file"], why) for s, why in st.verify(KEY)] == [("shard-00001.arrow", "fails its sha256 check")]
    with pytest.raises(StoreError):
        st.open("../" + KEY[3:])


def test_windowed_shuffle_and_prefetch(tmp_path):
    st = TargetStore(tmp_path)
    ensure(st, 23, Runner(st, KEY), shard_size=5)
    full = fake_targets(23)
    with st.open(KEY) as rd:
        o1 = rd.epoch_order(shuffle=True, seed=1, epoch=0, window=2)
        assert sorted(o1.tolist()) == list(range(23))
        assert np.array_equal(o1, rd.epoch_order(shuffle=True, seed=1, epoch=0, window=2))
        wins = rd.windows(shuffle=True, seed=1, epoch=0, window=2)
        assert [len(g) for g, _ in wins] == [2, 2, 1] and np.array_equal(np.concatenate([o for _, o in wins]), o1)
        for group, order in wins:  # each window: exactly the rows of its shards, interleaved
            assert sorted(order.tolist()) == sorted(r for s in group for r in range(5 * s, min(5 * s + 5, 23)))
        assert any(len(group) == 2 and (np.diff(order // 5) != 0).sum() > 1 for group, order in wins)
        for pf in (0, 1, 3):
            got = list(rd.iter_batches(4, shuffle=True, seed=1, epoch=0, window=2, prefetch=pf))
            assert np.array_equal(np.concatenate([i for i, _ in got]), o1) and [len(i) for i, _ in got] == [4] * 5 + [3]
            for idx, b in got:
                for k in SHAPES:
                    assert bits_equal(b[k], full[k][torch.from_numpy(idx)])
        # abandoning a prefetching iterator early stops its thread
        it = rd.iter_batches(2, shuffle=True, prefetch=1)
        next(it)
        it.close()
        assert not any(t.name == "healsweep-prefetch" and t.is_alive() for t in threading.enumerate())
        with pytest.raises(StoreError):
            next(rd.iter_batches(2, window=0))


def test_prefetch_thread_error_reaches_consumer(tmp_path):
    st = TargetStore(tmp_path)
    ensure(st, 8, Runner(st, KEY))
    rd = st.open(KEY)
    (st.key_dir(KEY) / "shard-00001.arrow").write_bytes(b"x" * 10)  # damaged after open
    with pytest.raises(StoreError, match="shard-00001.arrow"):
        list(rd.iter_batches(2, prefetch=2))
    rd.close()
