"""A real-source trial end to end in one process (timm checkpoint + image folder -> store -> mask -> run_trial),
its healed weights saved in the run directory, ``healsweep export`` through MLflow, and a reload through timm
that gives the healed model's logits and accuracy exactly."""
from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tasks.healing import dense_targets
from tasks.models import get_adapter, load_model, parse_ref
from tasks.pruning import MaskStore, make_masks
from tasks.store import TargetStore
from tasks.trial import TrialParams, run_trial
from tests.orchestrator.run_cli import HEALSWEEP, env, healsweep
from tests.models.test_sources import N_CLASSES, SIZES, TINY, _images, _tiny_checkpoint


@pytest.fixture(scope="module")
def trial(tmp_path_factory):
    root = tmp_path_factory.mktemp("export")
    for img, _, rel in _images():
        (root / "folder" / rel).parent.mkdir(parents=True, exist_ok=True)
        img.save(root / "folder" / rel)
    _, ckpt = _tiny_checkpoint(root)
    ref = parse_ref({"name": "tiny", "source": "checkpoint", "arch": "deit_tiny_patch16_224", "path": str(ckpt),
                     "num_classes": N_CLASSES, "model_args": TINY})
    load_kw = {"source": ref.to_dict(), "dataset": {"name": "imagefolder", "root": str(root / "folder"), "sizes": SIZES}}
    lm = load_model("tiny", root / "cache", **load_kw)
    adapter = get_adapter(lm.model)
    n = SIZES["calibration"]
    targets = dense_targets(lm.model, adapter.blocks(lm.model), lm.dataset["calibration"].images[:n])
    store = TargetStore(root / "targets")
    info = store.write_shard("a" * 32, 0, 0, targets)
    store.finalize("a" * 32, meta={}, block_shapes=info["block_shapes"], dtype="float16", num_rows=n, shard_infos=[info])
    entries = adapter.scope(lm.model, "qk_mlp")
    MaskStore(root / "masks").save("b" * 32, make_masks(lm.model, entries, "magnitude", 0.5, seed=0), {})
    p = TrialParams(model="tiny", scope="qk_mlp", healer="starfish", calib_size=n, lr=2e-3, epochs=2, seed=0,
                    store_key="a" * 32, mask_key="b" * 32, store_uri=str(root / "targets"),
                    mask_root=str(root / "masks"), cache_dir=str(root / "cache"), batch_size=4, load_kw=load_kw,
                    out_dir=str(root / "run"), trial_id="cell-0")
    final = run_trial(p, lambda r: None)
    return root, lm, final


def test_trial_records_split_digests_and_saves_healed_weights(trial):
    root, lm, final = trial
    assert final["calib_digest"] == lm.dataset.split_digest("calibration", SIZES["calibration"])
    assert final["eval_digest"] == lm.dataset.split_digest("evaluation") != final["selection_digest"]
    assert final["model_digest"] == lm.digest and final["mask_violations"] == 0
    healed = load_file(str(root / "run" / "trials" / "cell-0" / "healed.safetensors"))
    assert sorted(healed) == sorted({f"blocks.{i}.{p}" for i in range(2)
                                     for p in ("attn.qkv.weight", "mlp.fc1.weight", "mlp.fc2.weight")})


def test_export_reloads_through_timm_with_identical_logits(trial, tmp_path):
    import timm
    from mlflow import MlflowClient

    from tasks.evaluate import accuracy, logits

    root, lm, final = trial
    run_dir = root / "run"
    uri = f"sqlite:///{run_dir / 'mlflow.db'}"
    (run_dir / "sweep.json").write_text(json.dumps({"tracking_uri": uri}))
    client = MlflowClient(uri)
    exp = client.create_experiment("healsweep")
    run = client.create_run(exp, tags={"healsweep.role": "trial", "trial_id": "cell-0"})
    for k, v in {"pruner": "magnitude", "sparsity": "0.5", "pruner_settings": "{}", "granularity": "token"}.items():
        client.log_param(run.info.run_id, k, v)
    client.set_terminated(run.info.run_id, "FINISHED")

    out = tmp_path / "export"
    r = healsweep("export", run.info.run_id, "--out", out, "--tracking-uri", uri, "--run-dir", run_dir)
    assert r.returncode == 0, r.stderr
    card = json.loads((out / "model_card.json").read_text())
    kwargs = {**TINY, "num_classes": N_CLASSES}
    assert card["reload"] == {"library": "timm", "arch": "deit_tiny_patch16_224", "pretrained": False, "kwargs": kwargs,
                              "code": f"import timm\nmodel = timm.create_model('deit_tiny_patch16_224', "
                                      f"pretrained=False, **{card['reload']['kwargs']!r})"}
    cfg = timm.data.resolve_data_config({}, model=lm.model)  # the trial's preprocessing: the model's data config
    assert card["preprocessing"]["transform"] == "timm:" + json.dumps(cfg, sort_keys=True, default=list)
    scope: dict = {}
    exec(card["preprocessing"]["code"], scope)  # the card's code builds the trial's transform
    assert repr(scope["transform"]) == repr(timm.data.create_transform(**cfg, is_training=False))
    assert card["pruner"] == "magnitude" and card["healer"] == "starfish" and card["sparsity"] == 0.5
    assert card["calib_digest"] == final["calib_digest"] and card["accuracy"]["healed_acc"] == final["healed_acc"]
    md = (out / "model_card.md").read_text()
    assert "timm.create_model('deit_tiny_patch16_224'" in md
    assert card["calib_seed"] == 0 and "(split seed 0)" in md  # the data seed's calibration order: no draw named
    # the granularity the trial used (what `auto` resolved to), beside the settings as written
    assert card["granularity"] == "token" and "- healer: starfish (granularity used: token), lr 0.002, 2 epochs" in md

    reloaded = timm.create_model(card["reload"]["arch"], pretrained=False, **card["reload"]["kwargs"]).eval()
    reloaded.load_state_dict(load_file(str(out / "model.safetensors")))
    healed = load_model("tiny", root / "cache", **json.loads(
        (run_dir / "trials" / "cell-0" / "trial.json").read_text())["params"]["load_kw"]).model
    healed.load_state_dict(load_file(str(run_dir / "trials" / "cell-0" / "healed.safetensors")), strict=False)
    ev = lm.dataset["evaluation"]
    x = ev.images[:]
    assert torch.equal(logits(reloaded, x), logits(healed, x))
    assert accuracy(reloaded, x, ev.labels) == final["healed_acc"]
    mask = load_file(str(out / "mask.safetensors"))
    sd = reloaded.state_dict()
    assert mask and all(torch.all(sd[k][v == 0] == 0) for k, v in mask.items())
    assert not torch.equal(sd["blocks.0.mlp.fc1.weight"], lm.model.state_dict()["blocks.0.mlp.fc1.weight"])

    r = healsweep("export", "0" * 32, "--out", out, "--run-dir", run_dir)
    assert r.returncode == 2 and r.stderr.strip() == f"healsweep: error: run '{'0' * 32}' not found in {uri}"


def test_final_result_digests_become_mlflow_params(tmp_path):
    from types import SimpleNamespace

    from mlflow import MlflowClient

    from orchestrator.tracking.writer import AsyncMlflowWriter
    from orchestrator.tracking.logger import MlflowTrialLogger

    uri = f"sqlite:///{tmp_path / 'm.db'}"
    client = MlflowClient(uri)
    parent = client.create_run(client.create_experiment("healsweep")).info.run_id
    writer = AsyncMlflowWriter(client)
    cb = MlflowTrialLogger(writer, "healsweep", "sw", parent, {"m": 0})
    run_id = client.create_run(cb.exp_id).info.run_id
    cb.keys["t1"], cb.runs["c-0"] = "c-0", run_id
    trial = SimpleNamespace(trial_id="t1", config={"model": "m"})
    cb.on_trial_result(0, [], trial, {"final": True, "epoch": 2, "healed_acc": 0.5, "calib_digest": "ab12",
                                      "eval_digest": "cd34", "selection_digest": "ef56", "model_digest": "0f0f"})
    writer.close()  # flushes every queued write
    r = client.get_run(run_id)
    assert {k: r.data.params[k] for k in ("calib_digest", "eval_digest", "selection_digest", "model_digest")} == {
        "calib_digest": "ab12", "eval_digest": "cd34", "selection_digest": "ef56", "model_digest": "0f0f"}
    assert r.data.metrics["healed_acc"] == 0.5 and "calib_digest" not in r.data.metrics


def test_damaged_healed_files_are_named_not_a_traceback(trial, tmp_path):
    """What ``healsweep doctor`` checks of a trial's saved files (framing, not values): a whole copy passes; a
    truncated, overlong, header-garbled or deleted weights file, and a missing or damaged trial.json, each get their
    reason; the export of one says it in one error (a truncated file ended it in safetensors' own traceback)."""
    import shutil

    from tasks.export import load_trial
    from tasks.saved_trial import HEALED, TRIAL_JSON, healed_problem, weights_seen

    root, _, _ = trial
    src = root / "run" / "trials" / "cell-0"
    size = (src / HEALED).stat().st_size
    n = int.from_bytes((src / HEALED).read_bytes()[:8], "little")

    def damaged(name: str, edit) -> Path:
        d = tmp_path / "run" / "trials" / name
        shutil.copytree(src, d)
        edit(d)
        return d

    def cut(d, k):  # keep the first k bytes of the weights
        (d / HEALED).write_bytes((src / HEALED).read_bytes()[:k])

    whole = damaged("whole-0", lambda d: None)
    assert healed_problem(whole) is None and load_trial(whole)[3]["healed_acc"] == trial[2]["healed_acc"]
    cases = {
        "cut-0": (lambda d: cut(d, size - 1), f"{HEALED} truncated ({size - 1} bytes, its header says {size})"),
        "head-0": (lambda d: cut(d, 8 + n // 2), f"{HEALED} truncated ({8 + n // 2} bytes, header not whole)"),
        "tiny-0": (lambda d: cut(d, 5), f"{HEALED} truncated (5 bytes, header not whole)"),
        "long-0": (lambda d: (d / HEALED).write_bytes((src / HEALED).read_bytes() + b"\0"),
                   f"{HEALED} overlong ({size + 1} bytes, its header says {size})"),
        "garbled-0": (lambda d: (d / HEALED).write_bytes(b"\x07\0\0\0\0\0\0\0{garbl" + b"\0" * 10),
                      f"{HEALED} header unreadable (JSONDecodeError)"),
        "noweights-0": (lambda d: (d / HEALED).unlink(), f"{HEALED} missing"),
        "nojson-0": (lambda d: (d / TRIAL_JSON).unlink(), f"{TRIAL_JSON} missing"),
        "badjson-0": (lambda d: (d / TRIAL_JSON).write_text('{"params": '), f"{TRIAL_JSON} unreadable (JSONDecodeError)"),
    }
    for name, (edit, why) in cases.items():
        assert healed_problem(damaged(name, edit)) == why, name
    assert healed_problem(tmp_path / "run" / "trials" / "gone-0") == "its directory is missing"
    # what a trial's record line says of them (orchestrator/tracking/recorder.py): only whole ones are "saved"
    assert [weights_seen(tmp_path / "run", t) for t in ("whole-0", "cut-0", "nojson-0", "gone-0", "../x")] == \
        ["saved", "elsewhere", "elsewhere", "elsewhere", "elsewhere"]
    with pytest.raises(ValueError, match=rf"cut-0: {HEALED} truncated .*healsweep doctor {tmp_path / 'run'} --repair "
                                         "--rerun-lost-weights heals that trial again"):
        load_trial(tmp_path / "run" / "trials" / "cut-0")
    with pytest.raises(FileNotFoundError, match=f"deleted since it was recorded: then healsweep doctor {tmp_path / 'run'} --repair "
                                                   "--rerun-lost-weights heals it again"):
        load_trial(tmp_path / "run" / "trials" / "noweights-0")
    masks = tmp_path / "masks"  # the mask a store gc collected: named, and how it comes back (was a bare errno)
    shutil.copytree(root / "masks", masks)
    whole_json = json.loads((whole / TRIAL_JSON).read_text())
    whole_json["params"]["mask_root"] = str(masks)
    (whole / TRIAL_JSON).write_text(json.dumps(whole_json))
    (masks / f"{'b' * 32}.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match=f"whole-0: its mask {'b' * 32} is gone from {masks} \\(healsweep "
                                                "store gc collects masks no kept run refers to\\); a sweep of the same"):
        load_trial(whole)


def test_trial_dir_accepts_trial_keys_only(tmp_path):
    from tasks.saved_trial import trial_dir

    (tmp_path / "trials").mkdir()
    (tmp_path / "trials" / "evil").symlink_to(tmp_path.parent)  # planted under trials/, points outside
    assert trial_dir(tmp_path, "0a1b2c3d4e5f-3") == (tmp_path / "trials" / "0a1b2c3d4e5f-3").resolve()
    for bad in ("../../etc", "..", ".", "/etc", "a/../../b", "a/b", "", "-x", "x" * 200, "a\nb", None):
        with pytest.raises(ValueError, match="not a trial key"):
            trial_dir(tmp_path, bad)
    with pytest.raises(ValueError, match="resolves outside"):
        trial_dir(tmp_path, "evil")


def test_export_refuses_a_crafted_trial_id_tag(tmp_path):
    """The MLflow tag trial_id becomes a path under trials/: a tag that escapes is one line, exit 2, nothing
    written (the directory it points at looks like a trial)."""
    from mlflow import MlflowClient

    run_dir = tmp_path / "a" / "run"
    (run_dir / "trials").mkdir(parents=True)
    (tmp_path / "etc").mkdir()
    (tmp_path / "etc" / "healed.safetensors").write_bytes(b"")
    uri = f"sqlite:///{run_dir / 'mlflow.db'}"
    (run_dir / "sweep.json").write_text(json.dumps({"tracking_uri": uri, "sweep_id": "s1"}))
    client = MlflowClient(uri)
    run = client.create_run(client.create_experiment("healsweep"),
                            tags={"healsweep.role": "trial", "trial_id": "../../etc", "sweep_id": "s1"})
    client.set_terminated(run.info.run_id, "FINISHED")
    out = tmp_path / "out"
    r = healsweep("export", run.info.run_id, "--out", out, "--runs", tmp_path / "a")
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip().splitlines() == ["healsweep: error: trial_id '../../etc': not a trial key (expected "
                                             "<cell id>-<number>, matching ^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$)"]
    assert not out.exists()
    (tmp_path / "card.md").write_text("mine")  # an --out that is a file: one line (was FileExistsError's traceback)
    r = healsweep("export", run.info.run_id, "--out", tmp_path / "card.md", "--runs", tmp_path / "a")
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [
        f"healsweep: error: --out: {tmp_path / 'card.md'} is a file, not a directory"]
    r = healsweep("export", run.info.run_id, "--out", tmp_path / "card.md" / "sub", "--runs", tmp_path / "a")
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [  # under a file: was NotADirectoryError's traceback
        f"healsweep: error: --out: {tmp_path / 'card.md' / 'sub'} is under {tmp_path / 'card.md'}, which is a file, "
        "not a directory"]
    assert (tmp_path / "card.md").read_text() == "mine"


def test_export_finds_the_run_directory_by_sweep_id_and_refuses_to_guess(tmp_path):
    """Two run directories on one tracking URI: the run's sweep_id tag picks its directory; two copies of one
    sweep are ambiguous (one line, exit 2) until --run-dir chooses."""
    from mlflow import MlflowClient

    uri = f"sqlite:///{tmp_path / 'shared.db'}"
    for name, sweep in (("a", "s1"), ("b", "s2"), ("c", "s2")):
        (tmp_path / "runs" / name / "trials").mkdir(parents=True)
        (tmp_path / "runs" / name / "sweep.json").write_text(json.dumps({"tracking_uri": uri, "sweep_id": sweep}))
    client = MlflowClient(uri)
    exp = client.create_experiment("healsweep")
    ids = {}
    for sweep in ("s1", "s2"):
        run = client.create_run(exp, tags={"healsweep.role": "trial", "trial_id": "c0ffee-0", "sweep_id": sweep})
        client.set_terminated(run.info.run_id, "FINISHED")
        ids[sweep] = run.info.run_id
    (tmp_path / "runs" / "d").mkdir()
    (tmp_path / "runs" / "d" / "sweep.json").write_text('{"tracking_uri": ')  # torn: skipped, not the end
    r = healsweep("export", ids["s1"], "--out", "x", cwd=tmp_path)  # found in runs/a: no healed weights there
    assert r.returncode == 2 and r.stderr.strip().startswith(
        f"healsweep: error: {(tmp_path / 'runs' / 'a' / 'trials' / 'c0ffee-0').resolve()}: no healed.safetensors")
    r = healsweep("export", ids["s2"], "--out", "x", cwd=tmp_path)
    assert r.returncode == 2 and r.stderr.strip() == (
        f"healsweep: error: run '{ids['s2']}': sweep s2 is in 2 run directories (runs/b, runs/c); choose one with "
        f"--run-dir DIR")
    assert not (tmp_path / "x").exists()
    other = f"sqlite:///{tmp_path / 'other.db'}"  # --tracking-uri is the only store searched (was: then runs/*'s)
    MlflowClient(other).create_experiment("healsweep")
    r = healsweep("export", ids["s1"], "--out", "x", "--tracking-uri", other, cwd=tmp_path)
    assert r.returncode == 2 and r.stderr.strip() == (
        f"healsweep: error: run '{ids['s1']}' not found in {other}; check the run id and --tracking-uri")
    r = healsweep("export", "0" * 32, "--out", "x", cwd=tmp_path)  # the skipped directory is named
    assert r.returncode == 2 and r.stderr.strip() == (
        f"healsweep: error: run '{'0' * 32}' not found in the 3 run directories under runs/ (skipped: runs/d: "
        "unreadable sweep.json (JSONDecodeError)); give --run-dir DIR (or --runs DIR)")


def test_export_keeps_an_earlier_export_of_another_run(trial, tmp_path):
    """--out holding another run's export: one line, nothing replaced, until --force; the same run re-exports."""
    from mlflow import MlflowClient

    root, _, _ = trial
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    if not (root / "run" / "sweep.json").is_file():  # written by the reload test when it ran first in this process
        (root / "run" / "sweep.json").write_text(json.dumps({"tracking_uri": uri}))
    client = MlflowClient(uri)
    exp = client.create_experiment("healsweep")
    ids = []
    for _ in range(2):
        run = client.create_run(exp, tags={"healsweep.role": "trial", "trial_id": "cell-0"})
        client.set_terminated(run.info.run_id, "FINISHED")
        ids.append(run.info.run_id)
    out = tmp_path / "export"

    def export(run_id, *extra):
        return healsweep("export", run_id, "--out", out, "--tracking-uri", uri, "--run-dir", root / "run", *extra)

    assert export(ids[0]).returncode == 0
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    r = export(ids[1])
    assert r.returncode == 2 and r.stderr.strip() == (
        f"healsweep: error: --out: {out} already holds the export of run '{ids[0]}'; choose another --out or pass "
        "--force to replace it")
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert export(ids[0]).returncode == 0  # its own export: replaced in place
    assert export(ids[1], "--force").returncode == 0
    assert json.loads((out / "model_card.json").read_text())["mlflow_run_id"] == ids[1]
    (out / "model_card.json").unlink()  # files without a card: named, kept
    r = export(ids[0])
    assert r.returncode == 2 and r.stderr.strip() == (
        f"healsweep: error: --out: {out} already holds model.safetensors, mask.safetensors, model_card.md; choose "
        "another --out or pass --force to replace it")
    # two exports started together to one --out: both passed the check, and one silently replaced the other
    both = tmp_path / "both"
    procs = [subprocess.Popen([str(HEALSWEEP), "export", i, "--out", str(both), "--tracking-uri", uri, "--run-dir",
                               str(root / "run")], env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for i in ids]
    codes = sorted((p.wait(timeout=300), p.communicate()[1]) for p in procs)
    held = json.loads((both / "model_card.json").read_text())["mlflow_run_id"]
    assert [c for c, _ in codes] == [0, 2] and f"{both} already holds the export of run '{held}'" in codes[1][1]


def test_a_trial_that_does_not_see_the_run_directory_keeps_its_weights_in_the_store(trial, tmp_path):
    """Where a trial's healed weights go (tasks/trial.py ``keep_healed``): the run directory when this process sees
    the sweep's sweep.json there, else (with a remote store's ``healed/``) the store, whole, under the sweep and
    trial ids with both files' sums; ``fetch`` brings back the same bytes and refuses a damaged or mixed copy
    without touching the destination.
    Here the store root is a local directory (tests/e2e/test_cluster_hidden_rundir.py: S3 and a node without it)."""
    import dataclasses
    import shutil

    from orchestrator.tracking.recorder import stored_weights
    from tasks.saved_trial import HEALED, TRIAL_JSON, sees_run_dir
    from tasks.store.healed import PAIR, HealedStore
    from tasks.errors import RunDirUnseen
    from tasks.trial import keep_healed, run_trial, weights_home

    root, _, _ = trial
    src = root / "run" / "trials" / "cell-0"
    run = tmp_path / "run"
    run.mkdir()
    sid = "0123456789ab"
    p = TrialParams(model="m", scope="s", healer="starfish", calib_size=8, lr=1e-3, epochs=1, seed=0, store_key="k",
                    mask_key="k", store_uri="", mask_root="", cache_dir="", out_dir=str(run), trial_id="c-1",
                    sweep_id=sid, healed_root=str(tmp_path / "healed"))
    assert not sees_run_dir(run, sid) and weights_home(p) == "store"  # no sweep.json: another machine's directory
    (run / "sweep.json").mkdir()  # unreadable, not missing (as a stale NFS handle): asked 3 times, then unseen
    t0 = time.monotonic()
    assert not sees_run_dir(run, sid) and time.monotonic() - t0 >= 0.4
    (run / "sweep.json").rmdir()
    for text, seen in (('{"sweep_id": "0123456789ab"}', True), ('{"sweep_id": "ffffffffffff"}', False),
                       ('{"sweep_id": ', False), ('["0123456789ab"]', False)):
        (run / "sweep.json").write_text(text)
        assert sees_run_dir(run, sid) is seen and weights_home(p) == ("run_dir" if seen else "store"), text
    # a local store: the run directory or nothing; the trial refuses to start (a fault of the node: trial_faults)
    local = dataclasses.replace(p, healed_root="")
    with pytest.raises(RunDirUnseen, match=f"this node does not see the run directory {run} .no sweep.json of sweep "
                                           f"{sid} there. and the store is not remote"):
        run_trial(local, lambda m: pytest.fail("no epoch may run"))  # before loading anything (model "m": none)
    assert weights_home(dataclasses.replace(local, sweep_id="")) == "run_dir"  # a trial outside a sweep

    copy = lambda d: shutil.copytree(src, d, dirs_exist_ok=True)  # noqa: E731 - what save_healed writes
    assert keep_healed(p, copy) == "store" and not (run / "trials").exists()
    store = HealedStore(str(tmp_path / "healed"))
    assert store.has(sid, "c-1") and not store.has(sid, "c-2")
    assert sorted(f.name for f in (tmp_path / "healed" / sid / "c-1").iterdir()) == sorted([HEALED, TRIAL_JSON, PAIR])
    assert stored_weights({"healed": str(tmp_path / "healed")}, sid)("c-1") is True
    assert stored_weights({"targets": "x"}, sid) is None  # no remote store: the record says saved or elsewhere
    dest = run / "trials" / "c-1"
    assert store.fetch(sid, "c-1", dest) is None
    assert all((dest / n).read_bytes() == (src / n).read_bytes() for n in (HEALED, TRIAL_JSON))
    assert store.fetch(sid, "c-2", run / "trials" / "c-2").startswith("not in ")
    other, kept = run / "trials" / "c-9", tmp_path / "healed" / sid / "c-1" / TRIAL_JSON
    # two attempts of the trial: one's trial.json beside the other's weights and sums (whole files, framing sound)
    text = kept.read_text()
    kept.write_text(text.replace('"final": {', '"final": {"attempt": 2, ', 1))
    assert store.fetch(sid, "c-1", other) == (f"the copy in {tmp_path / 'healed'} is damaged: {TRIAL_JSON} not the "
                                              f"file(s) {PAIR} names (two attempts of the trial wrote them)")
    kept.write_text(text)
    blob = (tmp_path / "healed" / sid / "c-1" / HEALED)
    blob.write_bytes(blob.read_bytes()[:-3])
    assert store.fetch(sid, "c-1", other) == (f"the copy in {tmp_path / 'healed'} is damaged: {HEALED} truncated "
                                              f"({blob.stat().st_size} bytes, its header says {blob.stat().st_size + 3})")
    assert not other.exists() and sorted(p.name for p in (run / "trials").iterdir()) == ["c-1"]  # no leftovers
    (run / "sweep.json").write_text('{"sweep_id": "0123456789ab"}')
    assert keep_healed(dataclasses.replace(p, trial_id="c-3"), copy) == "run_dir" and (run / "trials" / "c-3").is_dir()
    for bad in (("../x", "c-1"), (sid, ".."), (sid, "a/b")):
        with pytest.raises(ValueError, match="not a plain key"):
            store.has(*bad)
