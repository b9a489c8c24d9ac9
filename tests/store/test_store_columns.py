"""A reader of some of a key's columns (``TargetStore.open(..., blocks=)``; a trial opens only what its healer reads,
e.g. ``kl`` the logits): every path hands out exactly those columns, in file order, with the bits and row order of
a reader of all columns; unknown names and an empty selection are refused."""
import numpy as np
import pytest
import torch

from tasks.store import StoreError, TargetStore
from tasks.store.stream import PinnedRing, StreamMaps, gathered_batches, ring_batches
from tests.store.test_store import KEY, make_blocks, write_all

SHAPES3 = {"blocks.0": (3, 4), "blocks.1": (2, 6), "logits": (5,)}


@pytest.fixture
def store(tmp_path):
    st = TargetStore(tmp_path / "s")
    blocks = make_blocks(23, torch.float16, shapes=SHAPES3)
    write_all(st, KEY, blocks, shard_size=4)  # 6 shards, the last one short
    return st, blocks


def _bits(t):
    return t.view(torch.int16)


def _check(batches, blocks, want):
    """-> the rows of ``batches``, each batch's tensors checked: exactly ``want``, the stored bits of its rows."""
    rows = []
    for r, tgt in batches:
        assert list(tgt) == want
        for k, v in tgt.items():
            assert torch.equal(_bits(v), _bits(blocks[k][torch.from_numpy(np.asarray(r))]))
        rows.append(np.asarray(r))
    return np.concatenate(rows)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("select,want", [(["logits"], ["logits"]), (["logits", "blocks.0"], ["blocks.0", "logits"]),
                                         (["blocks.1"], ["blocks.1"])])
@pytest.mark.parametrize("prefetch", [0, 2])
def test_some_columns_every_path_same_rows_and_bits(store, select, want, prefetch):
    st, blocks = store
    with st.open(KEY, num_rows=21) as full, st.open(KEY, num_rows=21, blocks=select) as part:
        assert full.block_names == list(SHAPES3) and part.block_names == want
        assert list(part.block_shapes) == want and part.columns == list(SHAPES3)
        for epoch in (0, 1):
            kw = dict(shuffle=True, seed=4, epoch=epoch, window=2)
            ref = _check(full.iter_batches(5, prefetch=prefetch, **kw), blocks, list(SHAPES3))
            got = _check(part.iter_batches(5, prefetch=prefetch, **kw), blocks, want)
            assert np.array_equal(got, ref) and sorted(got.tolist()) == list(range(21))
            wins = part.windows(**kw)  # the accelerator producer, run on the CPU
            gathered = _check(gathered_batches(part, 5, False, wins, threads=2), blocks, want)
            assert np.array_equal(gathered, ref)
            ring, maps = PinnedRing(part._widths, 5, depth=2, pin=False), StreamMaps(part)
            ringed = [(rw, ring.typed(ring.current.clone(), n, part.dtype, part.block_shapes))
                      for rw, n in ring_batches(part, 5, False, part.windows(**kw), maps=maps, ring=ring, threads=2)]
            assert np.array_equal(_check(ringed, blocks, want), ref)
            maps.close()
        rows = np.array([20, 0, 7, 7, 13])
        assert _check([(rows, part.read_rows(rows))], blocks, want).tolist() == rows.tolist()
        assert list(part.load_all()) == want and list(part.read_shard(2)) == want


@pytest.mark.timeout(30)
def test_unknown_or_no_columns_refused_naming_what_the_key_holds(store):
    st, _ = store
    with pytest.raises(StoreError, match=r"cannot read blocks \['blocks\.9'\]; it holds blocks\.0, blocks\.1, logits"):
        st.open(KEY, blocks=["logits", "blocks.9"])
    with pytest.raises(StoreError, match=r"cannot read blocks \(none\)"):
        st.open(KEY, blocks=[])


@pytest.mark.timeout(30)
def test_a_shard_with_other_columns_is_refused_by_a_partial_reader_too(store, tmp_path):
    """The schema check covers the whole file, not only the selected columns."""
    st, _ = store
    other = TargetStore(tmp_path / "o")
    renamed = {"blocks.0": (3, 4), "blocks.7": (2, 6), "logits": (5,)}  # same widths, one other name
    write_all(other, KEY, make_blocks(23, torch.float16, shapes=renamed), shard_size=4)
    (st.key_dir(KEY) / "shard-00001.arrow").write_bytes((other.key_dir(KEY) / "shard-00001.arrow").read_bytes())
    with st.open(KEY, verify=False, blocks=["logits"]) as r:  # sizes agree; only the schema tells
        with pytest.raises(StoreError, match=r"has columns \['blocks\.0', 'blocks\.7', 'logits'\]"):
            list(r.iter_batches(4, prefetch=0))
