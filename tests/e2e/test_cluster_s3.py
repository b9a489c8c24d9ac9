"""One S3 URI, no shared file system: the target store, masks, RR diagnostics and SnapViT rankings on an S3
endpoint with enforced auth, credentials only in the driver's environment, on a two-node Ray cluster whose nodes
were started without them (workers get the credentials through the job's runtime_env). The reference models'
weights ship with the code every node runs: no model cache, no training, no upload."""
from __future__ import annotations

import json
import re

import pytest

from orchestrator.spec import parse_spec
from tests.cluster_fixtures import add_node, make_cluster

pytestmark = pytest.mark.e2e


@pytest.fixture
def cpu0_head_cluster(monkeypatch):
    """A head with CPU: 0 (as on Kubernetes): every task and trial must run on a worker node."""
    yield from make_cluster(monkeypatch, 0)


def _objects(fs, path: str) -> dict[str, float]:
    import pyarrow.fs as pafs

    return {i.path[len(path) + 1:]: i.mtime for i in fs.get_file_info(pafs.FileSelector(path, recursive=True))
            if i.type == pafs.FileType.File}


def test_one_s3_uri_and_no_shared_file_system_on_a_two_node_cluster(tmp_path, aws_env, cpu0_head_cluster,
                                                                     monkeypatch, capfd):
    """Credentials only in the driver; the worker node has no access to the driver's --cache or run directory;
    the head has no CPU, so models, dense shards, masks and trials run on the worker. The sweep completes; a rerun
    computes 0 dense images and 0 masks; everything a worker needs is under the bucket prefix or in the code (the
    shipped weights: nothing under models/, nothing downloaded); the masks' provenance names the worker node."""
    import pyarrow.fs as pafs
    from mlflow import MlflowClient
    from safetensors import safe_open

    from orchestrator.sweep.run import run_sweep

    worker = add_node(cpu0_head_cluster, num_cpus=2)
    driver_cache = tmp_path / "driver" / "cache"  # the driver's --cache: stays empty
    driver_cache.mkdir(parents=True)
    monkeypatch.chdir(tmp_path / "driver")  # the driver's cwd: nothing the worker node is started from
    uri = f"s3://{aws_env['bucket']}/one?endpoint_override={aws_env['host']}&scheme=http"
    spec = parse_spec({"name": "s3", "models": ["vit_digits"], "sparsities": [0.9], "calib_sizes": [64],
                       "pruners": ["magnitude"], "healers": ["starfish"], "store": {"uri": uri, "shard_size": 16},
                       "search": {"trials_per_cell": 2, "lr": [1e-3, 3e-3], "epochs": [1, 1], "reevaluate": 0}})
    monkeypatch.setenv("RAY_ADDRESS", cpu0_head_cluster.address)  # what --address auto follows
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)

    def run(out):  # the driver: this process, the only one with the credentials
        res = run_sweep(spec, tmp_path / "driver" / out, tmp_path / "driver" / "store", driver_cache,
                        address="auto", progress=False, report=False)
        client = MlflowClient(res.tracking_uri)
        return res, client.get_run(res.parent_run_id).data

    first, data = run("a")
    port = cpu0_head_cluster.address.rsplit(":", 1)[1]
    assert re.search(rf"joined Ray cluster \S*:{port} .*2 nodes", capfd.readouterr().err)
    assert (first.trials_finished, first.trials_failed, first.dense_forward_images) == (2, 0, 64)
    assert data.metrics["masks_computed"] == 1 and "models_trained" not in data.metrics
    fs, path = pafs.FileSystem.from_uri(uri)
    objs = _objects(fs, path)
    assert not [k for k in objs if k.startswith("models/")], objs  # shipped weights: nothing uploaded
    assert sum(k.split("/")[-1].startswith("shard-") and k.endswith(".arrow") for k in objs) == 4  # 64 rows / 16
    masks = [k for k in objs if k.startswith("masks/") and k.endswith(".safetensors")]
    assert len(masks) == 1 and not (tmp_path / "driver" / "store").exists()  # nothing on the driver's disk
    assert not any(driver_cache.iterdir())
    # masks were computed by a Ray task on the worker node: provenance in the mask file and the parent run
    raw = fs.open_input_stream(f"{path}/{masks[0]}").read()
    (tmp_path / "m.safetensors").write_bytes(raw)
    with safe_open(str(tmp_path / "m.safetensors"), framework="pt") as f:
        prov = json.loads(f.metadata()["meta"])["provenance"]
    assert prov["node_id"] == worker.node_id != cpu0_head_cluster.head_node.node_id
    assert (data.tags["mask_placement_0"], data.tags["mask_nodes_0"]) == ("tasks", worker.node_id)

    # Ray Tune's storage is under the URI too (a node without the run directory must write its checkpoints);
    # this worker shares the driver's disk, so the healed weights are in the run directory, as recorded
    # (checkpoints there: tests/e2e/test_cluster_hidden_rundir.py; these 1-epoch trials write none)
    assert [k for k in objs if k.startswith("tune/")] and not (tmp_path / "driver" / "a" / "tune").exists()
    lines = [json.loads(x) for x in (tmp_path / "driver" / "a" / "trials.jsonl").read_text().splitlines()]
    assert [r["weights"] for r in lines if r["kind"] == "trial"] == ["saved", "saved"]
    assert not [k for k in objs if k.startswith("healed/")]

    second, data2 = run("b")
    assert (second.trials_finished, second.trials_failed, second.dense_forward_images) == (2, 0, 0)
    assert data2.metrics["masks_computed"] == 0
    again = _objects(fs, path)
    assert {k: again[k] for k in masks} == {k: objs[k] for k in masks}  # nothing rewritten
    used = masks[0].replace("masks/", "masks/.last_use/").removesuffix(".safetensors")
    assert used not in objs and used in again  # the reuse is recorded for `healsweep store gc --older-than`


def test_diagnostics_on_s3(tmp_path, aws_env):
    """RR diagnostics tables under <store.uri>/diagnostics (written once, reused: 0 layers the second time),
    computed by Ray tasks that load the shipped weights (no model cache anywhere)."""
    import ray

    from orchestrator.raytune.cluster import store_subdir
    from orchestrator.sweep.diagnostics import diagnostics_stage, load_table, read_table
    from orchestrator.spec.plan import expand_cells
    from orchestrator.sweep.stages import prepare_models

    uri = f"s3://{aws_env['bucket']}/diag?endpoint_override={aws_env['host']}&scheme=http"
    diag_uri = store_subdir(uri, "diagnostics")
    spec = parse_spec({"name": "d", "models": ["resnet_digits"], "sparsities": [0.5], "calib_sizes": [64],
                       "pruners": [{"name": "rr", "settings": {"grid": [0.25, 0.5], "diag_images": 16}}],
                       "healers": ["starfish"], "store": {"uri": uri}})
    models = prepare_models(spec, str(tmp_path / "cache"), progress=False)
    cells = expand_cells(spec, {m: i.scope for m, i in models.items()})
    ray.init(address="local", num_cpus=1, include_dashboard=False, log_to_driver=False)
    try:
        first = diagnostics_stage(cells, models, diag_uri, tmp_path / "cache", spec.data_seed)
        second = diagnostics_stage(cells, models, diag_uri, tmp_path / "cache", spec.data_seed)
    finally:
        ray.shutdown()
    (key,) = set(first.keys.values())
    n_layers = len(set(load_table(diag_uri, key)["layer"]))
    assert first.computed_layers == n_layers > 1 and second.computed_layers == 0
    assert len(load_table(diag_uri, key)["layer"]) == 2 * n_layers  # every layer x both grid points
    meta = read_table(diag_uri, key).schema.metadata
    assert len(json.loads(meta[b"healsweep.nodes"])) == 1  # the (one) node that computed it
    assert not (tmp_path / "cache").exists()  # the model cache is never written by a sweep


def test_mask_store_on_s3_round_trip(aws_env):
    import torch

    from orchestrator.raytune.cluster import store_subdir
    from tasks.pruning import MaskStore
    from tasks.store import StoreError

    uri = store_subdir(f"s3://{aws_env['bucket']}/rt?endpoint_override={aws_env['host']}&scheme=http", "masks")
    ms, key = MaskStore(uri), "a" * 32
    m = {"blocks.0.w": torch.tensor([[True, False], [False, True]])}
    assert not ms.has(key)
    ms.save(key, m, {"k": 1})
    assert ms.has(key) and torch.equal(MaskStore(uri).load(key)["blocks.0.w"], m["blocks.0.w"])
    with pytest.raises(StoreError):
        ms.load("b" * 32)
    with pytest.raises(StoreError):
        ms.has("../x")


def test_snapvit_rankings_on_s3_are_reused(tmp_path, aws_env, monkeypatch):
    """The mask stage with a remote store: the SnapViT ranking is written to <store.uri>/rankings and read back
    from there (not recomputed) when the masks must be made again on a node with an empty process cache."""
    import pyarrow.fs as pafs

    import tasks.pruning.snapvit as snapvit_pruner
    import tasks.pruning.snapvit_math as snapvit
    from orchestrator.raytune.cluster import store_subdir
    from orchestrator.spec.plan import expand_cells
    from orchestrator.sweep.stages import mask_stage, prepare_models, store_paths

    uri = f"s3://{aws_env['bucket']}/rank?endpoint_override={aws_env['host']}&scheme=http"
    calls = []
    real = snapvit.compute_ranking
    monkeypatch.setattr(snapvit, "compute_ranking", lambda *a, **k: calls.append(1) or real(*a, **k))
    spec = parse_spec({"name": "r", "models": ["vit_digits"], "sparsities": [0.25, 0.5], "calib_sizes": [32],
                       "pruners": [{"name": "snapvit", "settings": {"iterations": 2, "fitness_images": 16}}],
                       "healers": ["starfish"], "store": {"uri": uri}})
    paths = store_paths(uri, tmp_path / "store", tmp_path / "cache")
    models = prepare_models(spec, paths["cache"], progress=False)
    cells = expand_cells(spec, {m: i.scope for m, i in models.items()})

    def masks(root):
        return mask_stage(cells, models, root, paths["cache"], spec.data_seed, ranking_dir=paths["rankings"])

    first = masks(paths["masks"])
    snapvit_pruner.clear_memory_cache()  # another process: only the bucket remembers the ranking
    second = masks(store_subdir(uri, "masks-again"))
    assert len(first.computed) == len(second.computed) == 2 and calls == [1]
    fs, path = pafs.FileSystem.from_uri(paths["rankings"])
    assert [i.extension for i in fs.get_file_info(pafs.FileSelector(path))] == ["safetensors"]
    assert dict(first) == dict(second)  # same keys: the same masks from the stored ranking


def test_models_stage_on_a_worker_loads_the_shipped_weights(tmp_path, aws_env, cpu0_head_cluster):
    """On a cluster the models stage is one Ray task per model on a worker (the head has no CPU): it loads the
    shipped weights (verified), the same digest as in the driver; nothing is trained, uploaded or written to the
    driver's --cache or the bucket."""
    import pyarrow.fs as pafs

    from orchestrator.raytune import cluster
    from orchestrator.sweep.stages import prepare_models, store_paths
    from tasks.models.weights import SHIPPED

    add_node(cpu0_head_cluster, num_cpus=1)
    uri = f"s3://{aws_env['bucket']}/cold?endpoint_override={aws_env['host']}&scheme=http"
    spec = parse_spec({"name": "c", "models": ["resnet_digits"], "sparsities": [0.5], "calib_sizes": [64],
                       "pruners": ["magnitude"], "healers": ["starfish"], "store": {"uri": uri}})
    paths = store_paths(uri, tmp_path / "store", tmp_path / "driver-cache")
    cluster.connect(cpu0_head_cluster.address, announce=lambda _: None)  # workers get the credentials
    info = prepare_models(spec, paths["cache"], progress=False, on_workers=True)["resnet_digits"]
    assert info.digest == SHIPPED["resnet_digits"].sha256[:16]
    assert info.dense_acc == pytest.approx(SHIPPED["resnet_digits"].eval_acc, abs=1e-6)
    fs, path = pafs.FileSystem.from_uri(uri)
    assert fs.get_file_info(path).type == pafs.FileType.NotFound  # nothing written under the store URI
    assert not (tmp_path / "driver-cache").exists()


def test_store_gc_collects_the_buckets_healed_weights_and_tune_storage_per_sweep(tmp_path, aws_env):
    """``healsweep store gc`` on an S3 store (orchestrator/commands/store_bucket.py): tune/<name>-<sweep id>-s<n>/
    by age, or of the sweeps the --keep-referenced runs are not; healed/<sweep id>/ only of those, and only with
    --healed (healed weights are results); nothing written in the last hour by reference (a sweep may be running
    there); a directory that names no sweep stays."""
    from datetime import datetime, timedelta, timezone

    import pyarrow.fs as pafs

    from orchestrator.commands.store_bucket import Rule, gc_bucket
    from tests.orchestrator.run_cli import healsweep

    uri = f"s3://{aws_env['bucket']}/gc?endpoint_override={aws_env['host']}&scheme=http"
    fs, base = pafs.FileSystem.from_uri(uri)
    ours, other = "0123456789ab", "ba9876543210"
    for rel in (f"healed/{ours}/t-1/healed.safetensors", f"healed/{other}/t-1/healed.safetensors",
                f"healed/{other}/t-2/pair.json", f"tune/tiny-{ours}-s0/experiment_state.json",
                f"tune/tiny-{other}-s0/experiment_state.json", f"tune/tiny-{other}-s1/t/checkpoint_0/state.pt",
                "tune/notes/readme.txt", "healed/not-a-sweep/x"):
        with fs.open_output_stream(f"{base}/{rel}") as f:
            f.write(b"x" * 1000)
    run = tmp_path / "run"
    run.mkdir()
    (run / "targets.json").write_text(json.dumps({"store": uri, "keys": {}}))

    def left() -> set[str]:
        return set(_objects(fs, base))

    before = left()
    bad = healsweep("store", "gc", "--store", uri, "--keep-referenced", run)  # targets.json, but no sweep.json
    assert bad.returncode == 2 and "has no readable sweep.json" in bad.stderr and left() == before, bad.stderr
    assert healsweep("store", "gc", "--store", uri, "--older-than", "0", "--healed").returncode == 2
    (run / "sweep.json").write_text(json.dumps({"sweep_id": ours}))
    r = healsweep("store", "gc", "--store", uri, "--older-than", "1")  # all written just now: nothing is old
    assert r.returncode == 0 and left() == before, r.stdout + r.stderr
    assert "healed: kept the weights of 2 sweep(s)" in r.stdout and "tune: 0 of 3 sweep directories deleted" in r.stdout
    r = healsweep("store", "gc", "--store", uri, "--keep-referenced", run, "--healed")
    assert r.returncode == 0 and left() == before, r.stdout + r.stderr  # the other sweep may be running: kept
    assert "tune: kept 2 sweep directories written in the last hour" in r.stdout, r.stdout
    assert "healed: kept 1 sweep directories written in the last hour" in r.stdout, r.stdout
    later = datetime.now(timezone.utc) + timedelta(minutes=1)  # the same rule once the hour has passed
    gc_bucket(uri, Rule(frozenset({ours}), later, healed=False), dry_run=True)
    assert left() == before
    gc_bucket(uri, Rule(frozenset({ours}), later, healed=False), dry_run=False)
    assert left() == before - {f"tune/tiny-{other}-s0/experiment_state.json", f"tune/tiny-{other}-s1/t/checkpoint_0/state.pt"}
    gc_bucket(uri, Rule(frozenset({ours}), later, healed=True), dry_run=False)
    assert left() == {f"healed/{ours}/t-1/healed.safetensors", f"tune/tiny-{ours}-s0/experiment_state.json",
                      "tune/notes/readme.txt", "healed/not-a-sweep/x"}
    r = healsweep("store", "gc", "--store", uri, "--older-than", "0")  # Tune's storage by age; healed weights kept
    assert r.returncode == 0 and left() == {f"healed/{ours}/t-1/healed.safetensors", "tune/notes/readme.txt",
                                            "healed/not-a-sweep/x"}, r.stdout + r.stderr
    assert f"deleted tune/tiny-{ours}-s0 (1 files)" in r.stdout and "tune: 1 of 1 sweep directories deleted" in r.stdout


def test_store_ls_verify_and_gc_see_the_masks_in_the_bucket(tmp_path, aws_env, capsys):
    """Masks on a remote store (``<store.uri>/masks``) are listed, verified and collected like local ones: the
    mask stage's reuse is recorded in ``masks/.last_use/<key>`` (an object cannot change its time; a record older
    than the object, left by a gc that raced a reuse, loses to it); by reference, a mask used in the last hour
    stays (a sweep of another run directory may be using it, as for tune/ and healed/)."""
    import time
    from datetime import datetime, timedelta, timezone

    import pyarrow.fs as pafs
    import torch

    from orchestrator.cli import main
    from orchestrator.raytune.cluster import store_subdir
    from orchestrator.rundir import records
    from tasks.store import MaskStore
    from tests.faults.helpers import trial_line

    uri = f"s3://{aws_env['bucket']}/ms?endpoint_override={aws_env['host']}&scheme=http"
    masks = MaskStore(store_subdir(uri, "masks"))
    m1, m2, m3, bad = "1" * 32, "2" * 32, "3" * 32, "4" * 32
    for k in (m1, m2, m3):
        masks.save(k, {"w": torch.ones(64, dtype=torch.bool)}, {"k": k})
    fs, base = pafs.FileSystem.from_uri(uri)
    with fs.open_output_stream(f"{base}/masks/{bad}.safetensors") as f:
        f.write(b"not a safetensors file")
    with fs.open_output_stream(f"{base}/tune/tiny-0123456789ab-s0/experiment_state.json") as f:
        f.write(b"x" * 3000)
    with fs.open_output_stream(f"{base}/masks/.last_use/{m2}") as f:  # older than the object: the object's time
        f.write((datetime.now(timezone.utc) - timedelta(days=10)).isoformat().encode())
    assert masks.keys() == [m1, m2, m3, bad] and masks.last_use(m2) > datetime.now(timezone.utc) - timedelta(minutes=5)

    def cli(*argv) -> tuple[int, str]:
        code = main([*map(str, argv)])
        return code, capsys.readouterr().out

    code, out = cli("store", "ls", "--store", uri)
    section = out.split("\nmasks: ", 1)[1].split("\n\n", 1)[0]
    assert code == 0 and all(f"{k}.safetensors" in section for k in (m1, m2, m3, bad)), out
    assert "masks: 5 entries" in section and re.search(r"\n  tiny-0123456789ab-s0/ +0\.00 MB\ntune: 1 entry", out), out
    code, out = cli("store", "verify", "--store", uri)
    assert code == 1 and "4 masks checked, 1 damaged" in out and f"mask {bad}: DAMAGED" in out, out
    assert "the next sweep that uses it deletes it" in out
    fs.delete_file(f"{base}/masks/{bad}.safetensors")

    run = tmp_path / "run"  # a run that used none of these masks
    run.mkdir()
    (run / "targets.json").write_text(json.dumps({"store": uri, "keys": {}}))
    (run / "sweep.json").write_text(json.dumps({"sweep_id": "0123456789ab"}))
    records.append(run / records.TRIALS_FILE, trial_line("c-0", tags={"mask_key": "5" * 32}))
    code, out = cli("store", "gc", "--store", uri, "--keep-referenced", run)
    assert code == 0 and "masks: kept 3 used in the last hour" in out and masks.keys() == [m1, m2, m3], out
    time.sleep(6)
    masks.touch(m3)  # m3 reused by a sweep just now
    code, out = cli("store", "gc", "--store", uri, "--older-than", 4 / 86400)  # 4 s
    assert code == 0 and "2 of 3 masks deleted" in out and masks.keys() == [m3], out
    assert masks.last_use(m2) is None and fs.get_file_info(f"{base}/masks/.last_use/{m2}").type == pafs.FileType.NotFound
    assert cli("store", "verify", "--store", uri)[0] == 0


def test_store_gc_on_a_bucket_keeps_the_target_keys_a_sweep_is_using_or_writing(tmp_path, aws_env, capsys):
    """No locks on a bucket: ``gc --keep-referenced`` deleted every target key the given runs do not name, one a
    sweep of another run directory was reading included (its trials then failed: "key has no manifest"), and
    ``gc --older-than`` deleted a key being written (shards, no manifest, no last use: no age on S3, where
    directories have no mtime; the writer died in CopyObject). A key used or written in the last hour stays;
    one idle past the cutoff still goes."""
    import time

    from orchestrator.cli import main
    from tasks.store import TargetStore, content_key, ensure_targets
    from tests.store_helpers import Runner, fake_targets

    uri = f"s3://{aws_env['bucket']}/busy?endpoint_override={aws_env['host']}&scheme=http"
    st = TargetStore(uri)
    done, writing = content_key({"busy": 1}), content_key({"busy": 2})
    ensure_targets(st, done, 8, 4, Runner(st, done), meta={"model": "fake"}, dtype="float16",
                   calibration_rows=list(range(8)))
    st.write_shard(writing, 0, 0, {k: v[:4] for k, v in fake_targets(4).items()})  # a sweep's dense stage, mid-way

    def cli(*argv) -> tuple[int, str]:
        code = main([*map(str, argv)])
        return code, capsys.readouterr().out

    run = tmp_path / "run"  # a run that uses neither key
    run.mkdir()
    (run / "targets.json").write_text(json.dumps({"store": uri, "keys": {}}))
    (run / "sweep.json").write_text(json.dumps({"sweep_id": "0123456789ab"}))
    code, out = cli("store", "gc", "--store", uri, "--keep-referenced", run)
    assert code == 0 and "kept 2 keys used or written in the last hour" in out and "0 of 2 keys deleted" in out, out
    code, out = cli("store", "gc", "--store", uri, "--older-than", 30)
    assert code == 0 and "0 of 2 keys deleted" in out, out
    time.sleep(6)
    code, out = cli("store", "gc", "--store", uri, "--older-than", 4 / 86400)  # 4 s: both idle past it now
    assert code == 0 and "2 of 2 keys deleted" in out, out


def test_read_only_credentials_list_and_verify_and_a_sweep_refuses_them_in_one_line(aws_env, monkeypatch, capsys):
    """``store ls``/``verify`` made the store's root first (a PutObject): read-only credentials got exit 2 for a
    read. A sweep's check only HEADed the bucket, so read-only credentials passed it and the dense stage died in a
    traceback after Ray started; now one line before any work, and the probe leaves nothing behind."""
    import pyarrow.fs as pafs

    from orchestrator.cli import main
    from orchestrator.raytune.cluster import ClusterError, check_store_uri
    from tasks.store import TargetStore, content_key, ensure_targets
    from tests.store_helpers import Runner

    uri = f"s3://{aws_env['bucket']}/ro?endpoint_override={aws_env['host']}&scheme=http"
    st, key = TargetStore(uri), content_key({"ro": 1})
    ensure_targets(st, key, 8, 4, Runner(st, key), meta={"model": "fake"}, dtype="float16",
                   calibration_rows=list(range(8)))
    check_store_uri(uri)  # read-write: passes
    fs, base = pafs.FileSystem.from_uri(uri)
    assert not [i for i in fs.get_file_info(pafs.FileSelector(base)) if "probe" in i.path]
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", aws_env["ro_key"])
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", aws_env["ro_secret"])
    assert main(["store", "ls", "--store", uri]) == 0 and key in capsys.readouterr().out
    assert main(["store", "verify", "--store", uri]) == 0
    with pytest.raises(ClusterError, match=r"cannot write there: the endpoint refused the credentials"):
        check_store_uri(uri)
