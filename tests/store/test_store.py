"""Tests for tasks.store: bit-exact round trips, sharding, prefix reads, shuffling, resume, safety."""
import math
import os

import numpy as np
import pyarrow as pa
import pyarrow.ipc as ipc
import pytest
import torch

from tasks.store import KEY_RE, StoreError, TargetStore, canonical_json, content_key

SHAPES = {"blocks.0": (3, 4), "logits": (5,)}
KEY = content_key({"test": "store"})
FP16_SPECIAL = [0x7C00, 0xFC00, 0x8000, 0x0000, 0x0001, 0x8001, 0x03FF, 0x7C01, 0x7E00, 0x7FFF, 0xFD55, 0x7BFF]
BF16_SPECIAL = [0x7F80, 0xFF80, 0x8000, 0x0000, 0x0001, 0x8001, 0x007F, 0x7F81, 0x7FC0, 0x7FFF, 0xFFAA, 0x7F7F]


def make_blocks(n, dtype, seed=0, shapes=SHAPES):
    """Random 16-bit patterns (every NaN payload, subnormal, inf, -0.0 is fair game) + explicit specials."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, shape in shapes.items():
        bits = torch.randint(-32768, 32768, (n, *shape), generator=g, dtype=torch.int32).to(torch.int16)
        special = FP16_SPECIAL if dtype == torch.float16 else BF16_SPECIAL
        sp = torch.tensor(special, dtype=torch.int32).to(torch.int16)  # wraps 0x8000.. to negative int16
        flat = bits.view(-1)
        flat[: min(len(sp), flat.numel())] = sp[: flat.numel()]
        out[name] = bits.view(dtype)
    return out


def write_all(st, key, blocks, shard_size, dtype="float16", finalize=True):
    n = next(iter(blocks.values())).shape[0]
    infos = [st.write_shard(key, i, a, {k: v[a:b] for k, v in blocks.items()})
             for i, a, b in st.shard_plan(n, shard_size)]
    if finalize:
        st.finalize(key, meta={"what": "test"}, block_shapes={k: list(v.shape[1:]) for k, v in blocks.items()},
                    dtype=dtype, num_rows=n, shard_infos=infos)
    return infos


def assert_bits_equal(a, b):
    assert a.dtype == b.dtype and a.shape == b.shape
    assert torch.equal(a.view(torch.int16), b.view(torch.int16))


@pytest.mark.parametrize("dtype,name", [(torch.float16, "float16"), (torch.bfloat16, "bfloat16")])
def test_round_trip_bit_exact(tmp_path, dtype, name):
    st = TargetStore(tmp_path / "s")
    blocks = make_blocks(11, dtype)
    assert blocks["logits"].isnan().any() and blocks["logits"].isinf().any()
    write_all(st, KEY, blocks, shard_size=4, dtype=name)
    with st.open(KEY) as r:
        assert r.dtype == dtype and r.num_rows == 11 and r.block_names == list(SHAPES)
        assert r.block_shapes == SHAPES
        for k, v in r.load_all().items():
            assert_bits_equal(v, blocks[k])
        rows = np.array([10, 0, 4, 4, 7])
        for k, v in r.read_rows(rows).items():
            assert_bits_equal(v, blocks[k][torch.from_numpy(rows)])
        got = [b for _, b in r.iter_batches(3)]
        for k in SHAPES:
            assert_bits_equal(torch.cat([b[k] for b in got]), blocks[k])


def test_special_values_survive_as_values(tmp_path):
    st = TargetStore(tmp_path)
    t = torch.tensor([[float("inf"), -0.0, 6e-8, float("-inf"), 1.0]], dtype=torch.float16).repeat(2, 1)
    write_all(st, KEY, {"x": t}, shard_size=1)
    out = st.open(KEY).read_rows(np.array([1]))["x"][0]
    assert out[0] == float("inf") and out[3] == float("-inf") and out[2] > 0
    assert out[1] == 0 and torch.signbit(out[1])


def test_wrong_dtype_and_inconsistent_blocks_rejected(tmp_path):
    st = TargetStore(tmp_path)
    with pytest.raises(StoreError):
        st.write_shard(KEY, 0, 0, {"x": torch.zeros(2, 3)})  # float32
    with pytest.raises(StoreError):
        st.write_shard(KEY, 0, 0, {"x": torch.zeros(2, 3).half(), "y": torch.zeros(3, 3).half()})
    with pytest.raises(StoreError):
        st.write_shard(KEY, 0, 0, {"x": torch.zeros(2).half(), "y": torch.zeros(2).bfloat16()})
    with pytest.raises(StoreError):
        st.write_shard(KEY, 0, 0, {})


def test_shard_plan_and_short_last_shard(tmp_path):
    st = TargetStore(tmp_path)
    assert st.shard_plan(10, 4) == [(0, 0, 4), (1, 4, 8), (2, 8, 10)]
    assert st.shard_plan(8, 4) == [(0, 0, 4), (1, 4, 8)]
    blocks = make_blocks(10, torch.float16)
    write_all(st, KEY, blocks, shard_size=4)
    m = st.manifest(KEY)
    assert [(s["row_start"], s["row_stop"]) for s in m["shards"]] == [(0, 4), (4, 8), (8, 10)]
    assert m["format"] == "healsweep-targets/1" and m["meta"] == {"what": "test"} and m["num_rows"] == 10
    r = st.open(KEY)
    batches = list(r.iter_batches(3))
    assert [len(i) for i, _ in batches] == [3, 3, 3, 1]
    assert np.concatenate([i for i, _ in batches]).tolist() == list(range(10))
    assert all(i.dtype == np.int64 for i, _ in batches)
    assert [len(i) for i, _ in r.iter_batches(3, drop_last=True)] == [3, 3, 3]


def test_record_batches_at_most_256_rows(tmp_path):
    st = TargetStore(tmp_path)
    info = st.write_shard(KEY, 0, 0, {"x": torch.zeros(600, 2, dtype=torch.float16)})
    path = st.key_dir(KEY) / info["file"]
    assert info["bytes"] == os.path.getsize(path) and info["row_stop"] == 600
    with pa.memory_map(str(path)) as f:
        rd = ipc.open_file(f)
        sizes = [rd.get_batch(i).num_rows for i in range(rd.num_record_batches)]
        assert rd.schema.field("x").type == pa.list_(pa.uint16(), 2)
    assert sum(sizes) == 600 and max(sizes) <= 256 and len(sizes) == 3


def test_prefix_open_reads_only_covering_shards(tmp_path):
    st = TargetStore(tmp_path)
    blocks = make_blocks(10, torch.float16)
    infos = write_all(st, KEY, blocks, shard_size=4)
    # Truncate the last shard: a prefix inside shards 0..1 must not touch it, the full open must notice.
    last = st.key_dir(KEY) / infos[2]["file"]
    last.write_bytes(last.read_bytes()[:100])
    with st.open(KEY, num_rows=5) as r:
        assert r.num_rows == 5
        for k, v in r.load_all().items():
            assert_bits_equal(v, blocks[k][:5])
        assert sorted(np.concatenate([i for i, _ in r.iter_batches(2, shuffle=True)]).tolist()) == list(range(5))
        for bad in (np.array([5]), np.array([-1]), np.array([0.0, 1.0]), np.array([True, False])):
            with pytest.raises(StoreError):
                r.read_rows(bad)
        assert all(v.shape[0] == 0 for v in r.read_rows(np.array([], dtype=np.int64)).values())
    with pytest.raises(StoreError, match="shard-00002.arrow"):
        st.open(KEY)
    with pytest.raises(StoreError):
        st.open(KEY, num_rows=11)


def test_shuffle_properties(tmp_path):
    st = TargetStore(tmp_path)
    blocks = make_blocks(23, torch.float16)
    write_all(st, KEY, blocks, shard_size=5)
    r = st.open(KEY)

    def order(seed, epoch, bs=4, **kw):
        return np.concatenate([i for i, _ in r.iter_batches(bs, shuffle=True, seed=seed, epoch=epoch, **kw)])

    o = order(0, 0)
    assert sorted(o.tolist()) == list(range(23))  # every row exactly once
    assert np.array_equal(o, order(0, 0)) and np.array_equal(o, order(0, 0, bs=7))  # deterministic
    assert not np.array_equal(o, order(0, 1)) and not np.array_equal(o, order(1, 0))
    assert not np.array_equal(o, np.arange(23))
    # Shard-grouped: consecutive runs of the order each stay within one shard.
    shard_ids = o // 5
    assert (np.diff(shard_ids) != 0).sum() == 4
    for idx, b in r.iter_batches(4, shuffle=True, seed=3, epoch=2):
        ref = r.read_rows(idx)
        for k in SHAPES:
            assert_bits_equal(b[k], ref[k])
            assert_bits_equal(b[k], blocks[k][torch.from_numpy(idx)])
    full = [len(i) for i, _ in r.iter_batches(4, shuffle=True, drop_last=True)]
    assert full == [4] * 5


def test_missing_shards_resume(tmp_path):
    st = TargetStore(tmp_path)
    blocks = make_blocks(14, torch.float16)
    plan = st.shard_plan(14, 4)
    assert st.missing_shards(KEY, 14, 4) == plan
    for i, a, b in (plan[0], plan[2]):
        st.write_shard(KEY, i, a, {k: v[a:b] for k, v in blocks.items()})
    assert st.missing_shards(KEY, 14, 4) == [plan[1], plan[3]]
    assert st.manifest(KEY) is None and KEY not in st.keys()
    # A different shard size makes the existing shards' ranges stale.
    assert st.missing_shards(KEY, 14, 5) == st.shard_plan(14, 5)
    # A shard whose sidecar never landed is recomputed.
    (st.key_dir(KEY) / "shard-00002.json").unlink()
    assert st.missing_shards(KEY, 14, 4) == [plan[1], plan[2], plan[3]]



def test_check_shard_says_missing_or_the_sizes(tmp_path):
    st = TargetStore(tmp_path)
    info = st.write_shard(KEY, 0, 0, {k: v[:4] for k, v in make_blocks(4, torch.float16).items()})
    assert st.check_shard(KEY, info) is None
    f = st.key_dir(KEY) / info["file"]
    f.write_bytes(f.read_bytes()[:-1])
    assert st.check_shard(KEY, info) == f"truncated or grown ({info['bytes'] - 1} bytes on disk, {info['bytes']} recorded)"
    f.unlink()  # said "missing or truncated (None bytes on disk, ...)"
    assert st.check_shard(KEY, info) == f"missing ({info['bytes']} bytes recorded)"


def test_truncated_or_corrupt_shard(tmp_path):
    st = TargetStore(tmp_path)
    blocks = make_blocks(12, torch.float16)
    infos = write_all(st, KEY, blocks, shard_size=4)
    path = st.key_dir(KEY) / infos[1]["file"]
    data = path.read_bytes()
    path.write_bytes(data[:-8])
    with pytest.raises(StoreError, match="shard-00001.arrow"):
        st.open(KEY)
    assert st.missing_shards(KEY, 12, 4) == [(1, 4, 8)]
    # Same size, flipped bit: only the checksum can tell.
    path.write_bytes(data[:200] + bytes([data[200] ^ 1]) + data[201:])
    assert st.missing_shards(KEY, 12, 4) == []
    assert st.missing_shards(KEY, 12, 4, verify=True) == [(1, 4, 8)]
    with pytest.raises(StoreError, match="shard-00001.arrow"):
        st.open(KEY, verify=True)
    path.write_bytes(bytes(len(data)))  # right size, not Arrow at all
    with pytest.raises(StoreError, match="shard-00001.arrow"):
        st.open(KEY)
    path.unlink()
    with pytest.raises(StoreError, match="shard-00001.arrow"):
        st.open(KEY)


@pytest.mark.parametrize("bad", ["../" + "a" * 31, "../" + "a" * 29, "/etc/passwd", "A" * 32, "a" * 31, "a" * 33,
                                 "g" * 32, "a" * 31 + "\n", "", None])
def test_bad_keys_rejected(tmp_path, bad):
    st = TargetStore(tmp_path)
    for call in (lambda: st.key_dir(bad), lambda: st.manifest(bad), lambda: st.open(bad),
                 lambda: st.write_shard(bad, 0, 0, {"x": torch.zeros(1).half()})):
        with pytest.raises(StoreError):
            call()
    assert list(tmp_path.iterdir()) == []


def test_symlinked_key_dir_outside_root_rejected(tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    st = TargetStore(tmp_path / "root")
    key = content_key("evil")
    (st.root / key).symlink_to(outside, target_is_directory=True)
    (outside / "manifest.json").write_text("{}")
    with pytest.raises(StoreError):
        st.key_dir(key)
    with pytest.raises(StoreError):
        st.write_shard(key, 0, 0, {"x": torch.zeros(2).half()})
    assert list(outside.iterdir()) == [outside / "manifest.json"]
    assert st.keys() == []
    assert st.key_dir(KEY) == st.root / KEY  # a normal key is fine


def test_no_temp_files_remain(tmp_path, monkeypatch):
    st = TargetStore(tmp_path)
    write_all(st, KEY, make_blocks(9, torch.bfloat16), shard_size=4, dtype="bfloat16")
    names = sorted(p.name for p in st.key_dir(KEY).iterdir())
    assert names == ["manifest.json"] + [f"shard-0000{i}.{e}" for i in range(3) for e in ("arrow", "json")]
    with st.open(KEY):  # first open records the checksum pass and the last use
        pass
    names = sorted(p.name for p in st.key_dir(KEY).iterdir())
    assert names == ["last_use", "manifest.json"] + [f"shard-0000{i}.{e}" for i in range(3)
                                                     for e in ("arrow", "json")] + ["verified.json"]
    # A write that fails after the temp file exists must clean it up and publish nothing.
    key2 = content_key("fail")

    def boom(fd):
        raise OSError("disk on fire")
    monkeypatch.setattr(os, "fsync", boom)
    with pytest.raises(OSError):
        st.write_shard(key2, 0, 0, {"x": torch.zeros(3).half()})
    assert list(st.key_dir(key2).iterdir()) == []
    assert st.keys() == [KEY]


@pytest.mark.parametrize("ranges,num_rows", [
    ([(0, 4), (5, 8)], 8),      # gap
    ([(0, 4), (3, 8)], 8),      # overlap
    ([(0, 4), (4, 8)], 10),     # short of num_rows
    ([(0, 4), (4, 8)], 6),      # beyond num_rows
    ([(1, 4), (4, 8)], 8),      # not starting at 0
])
def test_finalize_rejects_bad_tiling(tmp_path, ranges, num_rows):
    st = TargetStore(tmp_path)
    infos = [st.write_shard(KEY, i, a, {"x": torch.zeros(b - a, 2).half()}) for i, (a, b) in enumerate(ranges)]
    with pytest.raises(StoreError, match="tile"):
        st.finalize(KEY, meta={}, block_shapes={"x": [2]}, dtype="float16", num_rows=num_rows, shard_infos=infos)
    assert st.manifest(KEY) is None


def test_finalize_rejects_schema_mismatch(tmp_path):
    st = TargetStore(tmp_path)
    infos = write_all(st, KEY, make_blocks(6, torch.float16), shard_size=3, finalize=False)
    kw = dict(meta={}, num_rows=6, shard_infos=infos)
    shapes = {k: list(v) for k, v in SHAPES.items()}
    for bad in (dict(block_shapes=shapes, dtype="bfloat16"), dict(block_shapes=shapes, dtype="float32"),
                dict(block_shapes={"blocks.0": [4, 3], "logits": [5]}, dtype="float16"),
                dict(block_shapes={"logits": [5]}, dtype="float16")):
        with pytest.raises(StoreError):
            st.finalize(KEY, **bad, **kw)
    assert st.manifest(KEY) is None
    m = st.finalize(KEY, block_shapes=shapes, dtype="float16", **kw)
    assert m["block_names"] == list(SHAPES) and st.keys() == [KEY]


def test_closed_reader_raises(tmp_path):
    st = TargetStore(tmp_path)
    write_all(st, KEY, make_blocks(4, torch.float16), shard_size=4)
    r = st.open(KEY)
    r.close()
    with pytest.raises(StoreError):
        r.read_rows(np.array([0]))
    with pytest.raises(StoreError):
        next(r.iter_batches(2))
    with pytest.raises(StoreError):
        st.open(content_key("never written"))


def test_content_key_and_canonical_json():
    a = {"model": "deit_tiny", "blocks": ["b0", "b1"], "cfg": {"lr": 1e-3, "n": 5}}
    b = {"cfg": {"n": 5, "lr": 1e-3}, "blocks": ["b0", "b1"], "model": "deit_tiny"}
    assert canonical_json(a) == canonical_json(b)
    assert content_key(a) == content_key(b)
    assert KEY_RE.match(content_key(a))
    assert content_key(a) != content_key({**a, "cfg": {"lr": 1e-3, "n": 6}})
    assert content_key(a) != content_key({**a, "blocks": ["b1", "b0"]})
    assert canonical_json({"t": (1, 2)}) == canonical_json({"t": [1, 2]}) == '{"t":[1,2]}'
    assert canonical_json({"s": "é"}) == '{"s":"\\u00e9"}'
    for bad in (float("nan"), {"x": [1.0, math.nan]}, {"x": math.inf}):
        with pytest.raises(ValueError):
            canonical_json(bad)
