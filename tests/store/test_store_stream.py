"""The accelerator stream (tasks/store/stream.py) yields what the CPU stream yields: same rows, same order, same
bits, for every shuffle, window, prefix, drop_last and batch size (batches spanning windows included)."""
import numpy as np
import pytest
import torch

from tasks.store import TargetStore
from tasks.store.stream import PinnedRing, StreamMaps, gathered_batches, ring_batches
from tests.store.test_store import KEY, make_blocks, write_all


def _pairs(reader, batch, threads=1, **kw):
    wins = reader.windows(shuffle=kw.get("shuffle", False), seed=kw.get("seed", 0), epoch=kw.get("epoch", 0),
                          window=kw.get("window", 1))
    old = list(reader._produce(batch, kw.get("drop_last", False), wins))
    new = list(gathered_batches(reader, batch, kw.get("drop_last", False), wins, threads=threads))
    return old, new


@pytest.mark.timeout(60)
@pytest.mark.parametrize("dtype,name", [(torch.float16, "float16"), (torch.bfloat16, "bfloat16")])
@pytest.mark.parametrize("num_rows,batch,window,shuffle,drop_last", [
    (23, 4, 1, True, False), (23, 5, 3, True, False), (23, 7, 2, True, True), (17, 4, 1, False, False),
    (23, 32, 1, True, False), (9, 1, 2, True, False)])
@pytest.mark.parametrize("threads", [1, 3])
def test_gathered_stream_equals_cpu_stream(tmp_path, dtype, name, num_rows, batch, window, shuffle, drop_last,
                                           threads):
    st = TargetStore(tmp_path / "s")
    blocks = make_blocks(23, dtype)  # specials, NaN payloads and subnormals: the copy must keep every bit
    write_all(st, KEY, blocks, shard_size=4, dtype=name)  # 6 shards, the last one short
    with st.open(KEY, num_rows=num_rows) as r:
        for epoch in (0, 1):
            old, new = _pairs(r, batch, threads, shuffle=shuffle, seed=3, epoch=epoch, window=window,
                              drop_last=drop_last)
            assert len(old) == len(new) > 0
            for (ro, to), (rn, tn) in zip(old, new):
                assert np.array_equal(ro, rn)
                assert to.keys() == tn.keys()
                for k in to:
                    assert tn[k].dtype == dtype and tn[k].shape == to[k].shape
                    assert torch.equal(to[k].view(torch.int16), tn[k].view(torch.int16))
                    assert torch.equal(tn[k].view(torch.int16), blocks[k][torch.from_numpy(rn)].view(torch.int16))


@pytest.mark.timeout(60)
def test_gathered_stream_refuses_a_short_shard(tmp_path):
    """A shard holding fewer rows than its manifest says is an error in this path too, never a short batch."""
    import json

    from tasks.store import StoreError

    st = TargetStore(tmp_path / "s")
    blocks = make_blocks(8, torch.float16)
    write_all(st, KEY, blocks, shard_size=4)
    with st.open(KEY) as r:
        r._infos[1] = json.loads(json.dumps({**r._infos[1], "row_stop": r._infos[1]["row_stop"] + 1}))
        with pytest.raises(StoreError, match="holds 4 rows"):
            list(gathered_batches(r, 3, False, r.windows()))


@pytest.mark.timeout(60)
def test_ring_and_kept_maps_give_every_epoch_its_own_bits(tmp_path):
    """Buffers from a ring of 2 sets, reused batch after batch, and shard maps kept across three epochs (as the
    GPU path runs them): each batch, copied out before the next is gathered (what the device copy does), holds its
    own rows' bits, every epoch in its own order; closing the maps closes every shard file."""
    st = TargetStore(tmp_path / "s")
    blocks = make_blocks(23, torch.float16)
    write_all(st, KEY, blocks, shard_size=4)
    with st.open(KEY) as r:
        ring, maps = PinnedRing(r._widths, 5, depth=2, pin=False), StreamMaps(r)
        orders = []
        for epoch in range(3):
            got = [(rows, {k: v.clone() for k, v in tgt.items()})  # the copy, before the ring moves on
                   for rows, tgt in gathered_batches(r, 5, False, r.windows(shuffle=True, seed=1, epoch=epoch),
                                                     maps=maps, buffers=ring, threads=2)]
            assert len(maps._open) == 6  # every shard mapped once, kept
            rows = np.concatenate([g[0] for g in got])
            assert sorted(rows.tolist()) == list(range(23))
            orders.append(rows.tolist())
            for rw, tgt in got:
                for k, v in tgt.items():
                    assert torch.equal(v.view(torch.int16), blocks[k][torch.from_numpy(rw)].view(torch.int16))
        assert orders[0] != orders[1] != orders[2]
        files = [f for f, _ in maps._open.values()]
        maps.close()
        assert maps._open == {} and all(f.closed for f in files)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("num_rows,batch,window,drop_last", [(23, 5, 1, False), (23, 4, 3, False), (23, 7, 2, True),
                                                             (9, 1, 2, False), (23, 32, 1, False)])
@pytest.mark.parametrize("threads", [1, 3])
def test_ring_batches_equal_the_cpu_stream(tmp_path, num_rows, batch, window, drop_last, threads):
    """The accelerator producer (ring_batches: numpy views of the ring's slots, made once) and the consumer's typed
    views of a slot's copy (PinnedRing.typed, full and short batches) give the CPU stream's rows, shapes and bits,
    with the ring reused across batches and epochs and the copy taken before the ring moves on (as the device copy)."""
    st = TargetStore(tmp_path / "s")
    blocks = make_blocks(23, torch.bfloat16)
    write_all(st, KEY, blocks, shard_size=4, dtype="bfloat16")
    with st.open(KEY, num_rows=num_rows) as r:
        ring, maps = PinnedRing(r._widths, batch, depth=2, pin=False), StreamMaps(r)
        for epoch in (0, 1):
            wins = lambda: r.windows(shuffle=True, seed=5, epoch=epoch, window=window)  # noqa: E731
            old = list(r._produce(batch, drop_last, wins()))
            new = [(rows, ring.typed(ring.current.clone(), n, r.dtype, r.block_shapes))
                   for rows, n in ring_batches(r, batch, drop_last, wins(), maps=maps, ring=ring, threads=threads)]
            assert len(old) == len(new) > 0
            for (ro, to), (rn, tn) in zip(old, new):
                assert np.array_equal(ro, rn) and to.keys() == tn.keys()
                for k in to:
                    assert tn[k].dtype == torch.bfloat16 and tn[k].shape == to[k].shape
                    assert torch.equal(to[k].view(torch.int16), tn[k].view(torch.int16))
        assert len(ring._arrays) <= 2 * 2  # numpy views made once per slot and batch size, not per batch
        maps.close()


def test_balanced_groups_split_blocks_by_bytes():
    from tasks.store.stream import balanced_groups

    w = {"a": 10, "b": 7, "c": 5, "d": 3, "e": 1}
    assert balanced_groups(w, 2) == [["a", "d"], ["b", "c", "e"]]  # 13 and 13: largest first, to the lightest
    assert balanced_groups(w, 1) == [["a", "b", "c", "d", "e"]]
    assert sorted(map(len, balanced_groups(w, 9))) == [1, 1, 1, 1, 1]  # never an empty group


def _slow(items, started, delay=0.0):
    import time
    for x in items:
        started.append(x)
        time.sleep(delay)
        yield x


@pytest.mark.timeout(30)
@pytest.mark.parametrize("arm_late", [False, True])
def test_prefetcher_fires_its_callback_once_after_producing_everything(arm_late):
    import time

    from tasks.store.stream import Prefetcher

    started, fired = [], []
    p = Prefetcher(_slow(range(3), started), depth=4)  # room for everything: the producer finishes unconsumed
    if arm_late:
        deadline = time.time() + 10
        while len(started) < 3 and time.time() < deadline:
            time.sleep(0.01)
        time.sleep(0.05)  # produced before it is armed: the callback runs in arm, at once
    p.arm(lambda: fired.append(len(started)))
    assert list(p) == [0, 1, 2] and fired == [3]
    assert not p._thread.is_alive()


@pytest.mark.timeout(30)
def test_prefetcher_reraises_in_the_consumer_and_closing_early_stops_the_thread():
    from tasks.store.stream import Prefetcher

    def boom():
        yield 1
        raise ValueError("shard 3 is damaged")

    with pytest.raises(ValueError, match="shard 3"):
        list(Prefetcher(boom(), depth=1))
    p, fired = Prefetcher(iter(range(100)), depth=1), []
    p.arm(lambda: fired.append(1))
    it = iter(p)
    assert next(it) == 0
    it.close()  # the consumer stops early
    assert not p._thread.is_alive() and fired == []  # stopped, and no next epoch started for a stopped stream


@pytest.mark.timeout(60)
def test_epoch_ahead_streams_each_epoch_as_a_fresh_stream_would_and_starts_the_next_early(tmp_path):
    """EpochAhead over the gathered stream (as the GPU path runs it, here into plain memory): every epoch holds the
    rows and bits a fresh stream of that epoch holds; epoch e + 1 is made before the consumer asks for it; a
    request for another stream closes the one started ahead; close ends every producer."""
    import time

    from tasks.store.stream import EpochAhead

    st = TargetStore(tmp_path / "s")
    blocks = make_blocks(23, torch.float16)
    write_all(st, KEY, blocks, shard_size=4)
    with st.open(KEY) as r:
        made = []

        def make(e, seed=1):
            made.append(e)
            return gathered_batches(r, 5, False, r.windows(shuffle=True, seed=seed, epoch=e), threads=2)

        ahead = EpochAhead()
        for epoch in range(4):
            got = list(ahead.stream("k", epoch, make, depth=2))
            want = list(make(epoch))
            made.pop()
            assert [g[0].tolist() for g in got] == [w[0].tolist() for w in want]
            for (_, tg), (_, tw) in zip(got, want):
                assert all(torch.equal(tg[k].view(torch.int16), tw[k].view(torch.int16)) for k in tw)
            assert made[-1] == epoch + 1 and ahead._ahead[:2] == ("k", epoch + 1)  # started before it was asked for
        assert made == [0, 1, 2, 3, 4]  # each epoch made once: 1-4 ahead of the consumer
        stale = ahead._ahead[2]
        list(ahead.stream("other", 0, lambda e: make(e, seed=2), depth=2))
        time.sleep(0.2)
        assert not stale._thread.is_alive()  # the unasked-for epoch 4 of stream "k": closed
        last = ahead._ahead[2]
        ahead.close()
        assert ahead._ahead is None and not last._thread.is_alive()


@pytest.mark.timeout(30)
def test_a_next_epoch_that_cannot_start_fails_when_asked_for_not_before():
    """Making epoch e + 1 ahead fails (say the reader went away): epoch e still ends normally; asking for e + 1
    makes it again, and that error reaches the consumer."""
    from tasks.store.stream import EpochAhead

    def make(e):
        if e == 1:
            raise RuntimeError("reader is closed")
        return iter([10 * e, 10 * e + 1])

    ahead = EpochAhead()
    assert list(ahead.stream("k", 0, make, depth=1)) == [0, 1] and ahead._ahead is None
    with pytest.raises(RuntimeError, match="reader is closed"):
        ahead.stream("k", 1, make, depth=1)
