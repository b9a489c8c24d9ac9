"""Store integrity without shortcuts (issue 16.1-16.3): bit rot with the mtime restored, a manifest claiming rows
no shard holds, a truncated manifest; `store verify` and ensure_targets (the sweep's dense stage) agree; the
reader refuses to stream fewer rows than its calibration size."""
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from tasks.store import StoreError, TargetStore, content_key, ensure_targets
from tasks.store.reader import TargetReader
from tests.store_helpers import SHAPES, Runner, fake_targets

K1, K2 = content_key({"integrity": 1}), content_key({"integrity": 2})
REPO = Path(__file__).resolve().parents[2]


def ensure(st, key, n, runner, shard_size=4):
    return ensure_targets(st, key, n, shard_size, runner, meta={"model": "fake"}, dtype="float16",
                          calibration_rows=list(range(n)))


def bits_equal(a, b):
    return a.shape == b.shape and torch.equal(a.view(torch.int16), b.view(torch.int16))


def cli(*args, cwd=REPO):
    env = dict(os.environ, PYTHONPATH=str(REPO))
    exe = Path(sys.executable).with_name("healsweep")
    return subprocess.run([str(exe), *args], capture_output=True, text=True, cwd=cwd, env=env, timeout=120)


def rot(path: Path, at: int) -> None:
    """Flip one byte in the middle of a file and restore its mtime: what bit rot looks like."""
    st = path.stat()
    data = bytearray(path.read_bytes())
    data[at] ^= 0x40
    path.write_bytes(bytes(data))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert path.stat().st_size == st.st_size and path.stat().st_mtime_ns == st.st_mtime_ns


def test_bit_rot_with_mtime_restored_is_caught_by_open_verify_and_the_sweep(tmp_path):
    st = TargetStore(tmp_path / "targets")
    ensure(st, K1, 12, Runner(st, K1))
    st.open(K1).close()  # a verified open before: verified.json records every shard
    shard = st.key_dir(K1) / "shard-00001.arrow"
    assert "shard-00001.arrow" in json.loads((st.key_dir(K1) / "verified.json").read_text())
    rot(shard, shard.stat().st_size // 2)
    with pytest.raises(StoreError, match="shard-00001.arrow .*sha256"):
        st.open(K1)
    r = cli("store", "verify", str(tmp_path))
    assert r.returncode == 1 and "shard-00001.arrow (rows 4-8): fails its sha256 check" in r.stdout, r.stdout + r.stderr
    assert "shard-00001.arrow" not in json.loads((st.key_dir(K1) / "verified.json").read_text())
    runner = Runner(st, K1)
    res = ensure(st, K1, 12, runner)  # the next sweep's dense stage
    assert runner.calls == [(1, 4, 8)] and len(res.events) == 1 and "shard-00001.arrow" in res.events[0]
    assert [p.name.endswith("-shard-00001.arrow") for p in (st.root / ".quarantine").iterdir()] == [True]
    with st.open(K1) as rd:
        got = rd.load_all()
    want = fake_targets(12)
    assert all(bits_equal(got[k], want[k]) for k in SHAPES)
    assert cli("store", "verify", str(tmp_path)).returncode == 0


def test_manifest_claiming_more_rows_than_stored_fails_verify_and_is_recomputed(tmp_path):
    st = TargetStore(tmp_path)
    ensure(st, K1, 8, Runner(st, K1))
    mf = st.key_dir(K1) / "manifest.json"
    m = json.loads(mf.read_text())
    m.update(num_rows=10, calibration_rows=list(range(10)))  # claims 10 rows, its shards hold 8
    mf.write_text(json.dumps(m))
    with pytest.raises(StoreError, match="do not tile"):
        st.open(K1, num_rows=10)
    r = cli("store", "verify", "--store", str(tmp_path))
    assert r.returncode == 1 and f"{K1}: DAMAGED" in r.stdout and "do not tile [0, 10)" in r.stdout, r.stdout
    runner = Runner(st, K1)
    res = ensure(st, K1, 10, runner)
    assert runner.calls == [(2, 8, 10)] and len(res.events) == 1 and "quarantined" in res.events[0]
    assert st.manifest(K1)["num_rows"] == 10
    with st.open(K1, num_rows=10) as rd:
        assert bits_equal(rd.load_all()["logits"], fake_targets(10)["logits"])


def test_truncated_manifest_verify_reports_every_key_and_the_sweep_rebuilds(tmp_path):
    st = TargetStore(tmp_path)
    for k in (K1, K2):
        ensure(st, k, 8, Runner(st, k))
    first, second = sorted((K1, K2))
    mf = st.key_dir(first) / "manifest.json"
    mf.write_bytes(mf.read_bytes()[:40])
    r = cli("store", "verify", "--store", str(tmp_path))
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    assert f"{first}: DAMAGED" in r.stdout and f"{second}: ok" in r.stdout  # did not stop at the first bad key
    assert "2 keys checked" in r.stdout
    runner = Runner(st, first)
    res = ensure(st, first, 8, runner)
    assert runner.calls == [] and len(res.events) == 1 and "unreadable JSON" in res.events[0]  # shards were sound
    assert st.manifest(first)["num_rows"] == 8 and cli("store", "verify", str(tmp_path)).returncode == 0


def test_reader_refuses_an_epoch_shorter_than_its_calibration_size(tmp_path):
    st = TargetStore(tmp_path)
    ensure(st, K1, 8, Runner(st, K1))
    with st.open(K1) as rd:
        assert sum(len(r) for r, _ in rd.iter_batches(3, epoch=0)) == 8 and rd.rows_streamed == {0: 8}
        assert sum(len(r) for r, _ in rd.iter_batches(3, epoch=1, drop_last=True)) == 6
    m = st.manifest(K1)
    short = TargetReader(st, K1, dict(m, num_rows=10), m["shards"], 10)  # shards hold 8 of the 10 rows
    with pytest.raises(StoreError, match="streamed 8 rows, expected 10"):
        for _ in short.iter_batches(4, shuffle=True, seed=1):
            pass
    assert short.rows_streamed == {0: 8}
    np.testing.assert_array_equal(np.sort(short.epoch_order()), np.arange(8))


# --- masks: read and checked on every load, by the mask stage, doctor and `store verify` -------------------------

def _mask_ident(sparsity: float) -> dict:
    return {"kind": "mask/1", "model_digest": "d" * 16, "pruner": "magnitude", "settings": {}, "sparsity": sparsity,
            "scope": "conv", "seed": 0}


def test_a_mask_file_bit_flipped_or_swapped_is_refused_on_load(tmp_path, capsys):
    """A mask was used as long as its header parsed: 4 KiB flipped in its data, or another key's file copied over
    it (every 0.5 trial then pruned at 0.9), passed doctor and `store verify` and healed the wrong mask. Each file
    now carries its identity (its key is the content key of it) and its content digest, both checked on load."""
    from orchestrator.cli import main
    from tasks.store import MaskStore

    masks = MaskStore(tmp_path / "store" / "masks")
    g = torch.Generator().manual_seed(0)
    made = {}
    for s in (0.5, 0.9):
        key = content_key(_mask_ident(s))
        made[key] = {"layer.weight": torch.rand(64, 64, generator=g) > s}
        masks.save(key, made[key], {**_mask_ident(s), "provenance": {"seconds": 0.1}})
    k5, k9 = list(made)
    assert all(torch.equal(masks.load(k)["layer.weight"], made[k]["layer.weight"]) for k in made)
    assert masks.problem(k5) is None and masks.problem(k9) is None
    raw = bytearray(masks.path(k5).read_bytes())
    raw[-100] ^= 0x01  # a bit flip in the tensor data (a kept entry dropped or back; the header still parses)
    masks.path(k5).write_bytes(bytes(raw))
    assert masks.problem(k5) == "its content is not the digest written with it"
    with pytest.raises(StoreError, match=f"mask {k5} in .* is damaged \\(its content is not the digest"):
        masks.load(k5)
    masks.path(k5).write_bytes(masks.path(k9).read_bytes())  # another key's mask copied over it
    assert masks.problem(k5) == f"it holds the mask of key {k9}" and masks.problem(k9) is None
    assert main(["store", "verify", str(tmp_path / "store")]) == 1
    out = capsys.readouterr().out
    assert f"mask {k5}: DAMAGED (it holds the mask of key {k9})" in out and "2 masks checked, 1 damaged" in out
    masks.save(k5, made[k5], {"test": True})  # a mask saved without a sweep's identity: its digest alone
    assert masks.problem(k5) is None


def test_the_mask_stage_moves_a_damaged_mask_aside_and_computes_it_again(tmp_path):
    """A sweep reusing a damaged mask healed it as if intact; the mask stage now reads every mask it reuses, moves a
    damaged one to masks/.quarantine and computes it again (an event logged on the parent run)."""
    from orchestrator.spec import parse_spec
    from orchestrator.spec.plan import expand_cells
    from orchestrator.sweep.stages import mask_stage, prepare_models
    from tasks.store import MaskStore
    import yaml

    cache = REPO / ".healsweep" / "models"
    raw = yaml.safe_load((REPO / "configs" / "tiny.yaml").read_text())
    raw.update(models=["resnet_digits"], sparsities=[0.5, 0.9], calib_sizes=[64], pruners=["magnitude"])
    spec = parse_spec(raw)
    models = prepare_models(spec, cache, progress=False)
    cells = expand_cells(spec, {m: i.scope for m, i in models.items()})
    root = tmp_path / "masks"
    first = mask_stage(cells, models, root, cache, spec.data_seed)
    assert len(first.computed) == 2 and not first.events
    store = MaskStore(root)
    k5, k9 = (first[c.cell_id] for c in sorted(cells, key=lambda c: c.sparsity))
    want = store.load(k5)
    store.path(k5).write_bytes(store.path(k9).read_bytes())  # the 0.9 mask under the 0.5 key
    again = mask_stage(cells, models, root, cache, spec.data_seed)
    assert [r["key"] for r in again.computed] == [k5] and len(again.events) == 1
    assert again.events[0].startswith(f"mask {k5} damaged (it holds the mask of key {k9}): moved to ")
    assert (root / ".quarantine" / f"{k5}.safetensors").is_file()
    got = store.load(k5)
    assert all(torch.equal(got[k], want[k]) for k in want)
    assert not mask_stage(cells, models, root, cache, spec.data_seed).computed  # intact now: reused



_NO_WRITES = """
import contextlib, io, resource, signal, sys, tempfile
import torch  # noqa: F401 - imports first: some write a probe file in the temp dir
from orchestrator.cli import main
from tasks.store import TargetStore
tempfile.gettempdir()
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit is then EFBIG, an OSError
resource.setrlimit(resource.RLIMIT_FSIZE, (0, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
if sys.argv[1] == "open":
    with TargetStore(sys.argv[2]).open(sys.argv[3]) as rd:
        print(sorted(rd.load_all()))
else:
    sys.exit(main(sys.argv[1:]))
"""


def test_a_store_that_cannot_be_written_still_verifies_and_serves_reads(tmp_path):
    """A store on a read-only mount or bucket: ``verify`` wrote verified.json (a log nothing trusts) unguarded, so
    every verified open and ``store verify`` ended in the OS's error. Writes fail here for real (RLIMIT_FSIZE 0: EFBIG
    for root too); the reads and the checks go on, a bad shard is still found."""
    st = TargetStore(tmp_path / "targets")
    ensure(st, K1, 12, Runner(st, K1))
    (st.key_dir(K1) / "verified.json").unlink()
    env = dict(os.environ, PYTHONPATH=str(REPO))

    def child(*args):
        return subprocess.run([sys.executable, "-c", _NO_WRITES, *args], capture_output=True, text=True, env=env,
                              timeout=100)

    r = child("open", str(st.root), K1)
    assert r.returncode == 0 and r.stdout.strip() == str(sorted(SHAPES)), r.stderr[-2000:]
    assert "could not record the verified shards of" in r.stderr and not (st.key_dir(K1) / "verified.json").exists()
    r = child("store", "verify", str(tmp_path))
    assert r.returncode == 0, r.stdout + r.stderr[-2000:]
    rot(st.key_dir(K1) / "shard-00002.arrow", 100)
    r = child("store", "verify", str(tmp_path))
    assert r.returncode == 1 and "shard-00002.arrow (rows 8-12): fails its sha256 check" in r.stdout, r.stdout + r.stderr
