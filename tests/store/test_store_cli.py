"""healsweep store ls / verify / gc: output and exit codes; the disk budget policy; spec fields."""
import json
import os
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from orchestrator.cli import main
from tasks.store import TargetStore, content_key, ensure_targets
from tests.store_helpers import Runner
from tests.faults.helpers import trial_line

K1, K2 = content_key("one"), content_key("two")
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def store_dir(tmp_path):
    st = TargetStore(tmp_path / "home" / "targets")
    for k, n in ((K1, 10), (K2, 6)):
        ensure_targets(st, k, n, 4, Runner(st, k), meta={"model": f"m{n}"}, dtype="float16")
    return tmp_path / "home", st


def test_ls_lists_keys_rows_models(store_dir, capsys):
    home, st = store_dir
    st.open(K1).close()  # records last use
    assert main(["store", "ls", "--store", str(home)]) == 0
    out = capsys.readouterr().out.splitlines()
    row1 = next(line for line in out if line.startswith(K1)).split()
    row2 = next(line for line in out if line.startswith(K2)).split()
    assert row1[1:4] == ["m10", "10", "3"] and row2[1:4] == ["m6", "6", "2"] and row2[-1] == "never"
    assert float(row1[4]) == pytest.approx(st.key_bytes(K1) / 1e6, abs=0.01)
    assert out[-1].startswith("2 keys")


def test_verify_exit_codes(store_dir, capsys):
    home, st = store_dir
    assert main(["store", "verify", "--store", str(home)]) == 0
    p = st.key_dir(K2) / "shard-00000.arrow"
    data = p.read_bytes()
    p.write_bytes(data[:100] + bytes([data[100] ^ 1]) + data[101:])  # same size: only the checksum tells
    assert main(["store", "verify", K1, "--store", str(home)]) == 0
    capsys.readouterr()
    assert main(["store", "verify", "--store", str(home)]) == 1
    out = capsys.readouterr().out
    assert f"{K2} shard-00000.arrow (rows 0-4): fails its sha256 check" in out and "1 damaged" in out
    assert main(["store", "verify", "../etc", "--store", str(home)]) == 2
    assert main(["store", "verify", content_key("absent"), "--store", str(home)]) == 2
    assert main(["store", "ls", "--store", str(home / "nope")]) == 2


def test_ls_and_verify_name_a_key_without_its_manifest(store_dir, capsys):
    """A dense stage killed midway leaves shards and no manifest: `store ls` said "1 keys" and `store verify` checked
    nothing of it. Both now name it unfinished (not damaged); the next ensure_targets completes it without
    recomputing the shards already there."""
    home, st = store_dir
    (st.key_dir(K2) / "manifest.json").unlink()
    size = st.key_bytes(K2)
    assert main(["store", "ls", "--store", str(home)]) == 0
    out = capsys.readouterr().out.splitlines()
    row = next(line for line in out if line.startswith(K2)).split()
    assert row[1:4] == ["UNFINISHED", "?", "2"] and float(row[4]) == pytest.approx(size / 1e6, abs=0.01)
    assert "1 keys, " in "\n".join(out) and any(line.startswith("1 unfinished (no manifest: ") for line in out)
    assert main(["store", "verify", "--store", str(home)]) == 0
    out = capsys.readouterr().out
    assert f"{K2}: unfinished (no manifest: " in out and "1 keys checked, 0 damaged, 1 unfinished" in out
    runner = Runner(st, K2)
    ensure_targets(st, K2, 6, 4, runner, meta={"model": "m6"}, dtype="float16")
    assert runner.calls == [] and st.keys() == [K1, K2]  # both shards were whole: only the manifest was written


def test_a_key_directory_linked_out_of_the_root_is_not_listed(store_dir, tmp_path, capsys):
    """keys() skips such a name as not ours; the unfinished listing must too (it ended `store ls` with exit 2)."""
    home, st = store_dir
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    (st.key_dir(K1).parent / content_key("linked")).symlink_to(outside, target_is_directory=True)
    assert main(["store", "ls", "--store", str(home)]) == 0
    out = capsys.readouterr().out
    assert content_key("linked") not in out and "unfinished" not in out
    assert main(["store", "verify", "--store", str(home)]) == 0
    assert content_key("linked") not in capsys.readouterr().out


def test_gc_older_than_and_keep_referenced(store_dir, tmp_path, capsys):
    home, st = store_dir
    st.open(K1).close()
    old = time.time() - 10 * 86400
    (st.key_dir(K2) / "last_use").write_text("2000-01-01T00:00:00+00:00")
    os.utime(st.key_dir(K2) / "manifest.json", (old, old))
    assert main(["store", "gc", "--older-than", "5", "--dry-run", "--store", str(home)]) == 0
    assert "0 of 2 keys" in capsys.readouterr().out  # its shards were written just now: a sweep may be extending it
    for f in st.key_dir(K2).iterdir():  # an old key: every file of it
        os.utime(f, (old, old))
    assert main(["store", "gc", "--older-than", "5", "--dry-run", "--store", str(home)]) == 0
    assert st.keys() == [K1, K2] and f"would delete {K2}" in capsys.readouterr().out
    assert main(["store", "gc", "--older-than", "5", "--store", str(home)]) == 0
    assert st.keys() == [K1]
    run = tmp_path / "run"
    run.mkdir()
    (run / "targets.json").write_text(json.dumps({"keys": {"m": K2}}))
    assert main(["store", "gc", "--keep-referenced", str(run), "--store", str(home)]) == 0
    assert st.keys() == []
    assert main(["store", "gc", "--keep-referenced", str(tmp_path), "--store", str(home)]) == 2  # no targets.json
    capsys.readouterr()
    assert main(["store", "gc", "--keep-referenced", str(run), "--healed", "--store", str(home)]) == 2
    assert "--healed: a local store has no healed weights" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["store", "gc", "--store", str(home)])  # one of the two modes is required


def test_gc_collects_the_masks_beside_the_targets_by_the_same_rule(store_dir, tmp_path, capsys):
    """`store gc` deleted target keys only: a sweep's masks (content-addressed, ~3 MB each for a ResNet-50) piled up
    under <store>/masks for ever. Their last use is the file's mtime, touched whenever a sweep reuses one."""
    import torch

    from orchestrator.rundir import records
    from tasks.store import MaskStore

    home, _ = store_dir
    masks = MaskStore(home / "masks")
    m1, m2, m3 = (content_key(f"mask{i}") for i in range(3))
    for k in (m1, m2, m3):
        masks.save(k, {"w": torch.ones(64, dtype=torch.bool)}, {"k": k})
    old = time.time() - 10 * 86400
    for k in (m2, m3):
        os.utime(masks.path(k), (old, old))
    masks.touch(m3)  # m3 reused by a sweep just now
    assert main(["store", "gc", "--older-than", "5", "--dry-run", "--store", str(home)]) == 0
    out = capsys.readouterr().out
    assert f"would delete mask {m2}" in out and "1 of 3 masks to delete" in out and masks.keys() == sorted([m1, m2, m3])
    assert main(["store", "gc", "--older-than", "5", "--store", str(home)]) == 0
    assert masks.keys() == sorted([m1, m3]) and "1 of 3 masks deleted" in capsys.readouterr().out
    run = tmp_path / "run"
    run.mkdir()
    (run / "targets.json").write_text(json.dumps({"keys": {"m": K1}}))
    assert main(["store", "gc", "--keep-referenced", str(run), "--store", str(home)]) == 0
    assert masks.keys() == sorted([m1, m3]) and "kept all 2: a --keep-referenced run has no trials.jsonl" in \
        capsys.readouterr().out  # the run names no masks it used: none is taken for unused
    for tid, key in (("c-0", m3), ("c-1", m3)):
        records.append(run / records.TRIALS_FILE, trial_line(tid, tags={"mask_key": key}))
    assert main(["store", "gc", "--keep-referenced", str(run), "--store", str(home)]) == 0
    assert masks.keys() == [m3] and "1 of 2 masks deleted" in capsys.readouterr().out


def test_spec_store_fields():
    import yaml

    from orchestrator.spec import SpecError
    from orchestrator.spec import parse_spec as load_spec

    base = yaml.safe_load((REPO / "configs" / "default.yaml").read_text())
    for bad, field in (({"on_budget": "maybe"}, "store.on_budget"), ({"budget_gb": -1}, "store.budget_gb"),
                       ({"uri": ""}, "store.uri")):
        d = {**base, "store": {**base["store"], **bad}}
        with pytest.raises(SpecError, match=field.replace(".", r"\.")):
            load_spec(d)
    s = load_spec({**base, "store": {**base["store"], "budget_gb": 1.5, "on_budget": "recompute"}})
    assert s.store.budget_gb == 1.5 and s.store.on_budget == "recompute" and s.store.uri is None


def test_budget_refuse_and_recompute(tmp_path):
    from orchestrator.sweep.dense import StoreBudgetError, budget_modes
    from orchestrator.sweep.dense_work import row_bytes

    cache = Path(os.environ.get("HEALSWEEP_TEST_CACHE", REPO / ".healsweep" / "models"))
    rb = row_bytes("vit_digits", cache, 0, "float16")
    models = {"vit_digits": SimpleNamespace(store_key=content_key("vit"))}

    def spec(budget, mode):
        return SimpleNamespace(data_seed=0, store=SimpleNamespace(budget_gb=budget, on_budget=mode, dtype="float16"),
                               load_kwargs=lambda m: {})  # the shipped weights
    rows = {"vit_digits": 100}
    assert budget_modes(spec(None, "refuse"), models, rows, tmp_path, cache) == {"vit_digits": "store"}
    assert budget_modes(spec(100 * rb / 1e9, "refuse"), models, rows, tmp_path, cache) == {"vit_digits": "store"}
    with pytest.raises(StoreBudgetError, match=r"^store\.budget_gb: dense targets of vit_digits need") as e:
        budget_modes(spec(99 * rb / 1e9, "refuse"), models, rows, tmp_path, cache)
    assert "\n" not in str(e.value)
    assert budget_modes(spec(99 * rb / 1e9, "recompute"), models, rows, tmp_path, cache) == {"vit_digits": "recompute"}
    # search.calib_draws: each other draw's key holds the same rows, priced with the model's own
    draws = {"vit_digits": [content_key("vit@1000"), content_key("vit@2000")]}
    assert budget_modes(spec(300 * rb / 1e9, "refuse"), models, rows, tmp_path, cache, draws) == {"vit_digits": "store"}
    with pytest.raises(StoreBudgetError, match=r"^store\.budget_gb: dense targets of vit_digits \(and its 2 other "
                                               r"calibration draws\) need"):
        budget_modes(spec(299 * rb / 1e9, "refuse"), models, rows, tmp_path, cache, draws)
