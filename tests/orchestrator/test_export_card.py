"""What an export's model card says (the export user's findings): which trial made the weights (sweep, grid, cell,
stage, seeds, mask), the sha256 of its files, the same bytes on every re-export, a closed-form healer without
training settings, the sparsity over the pruning scope and over the whole model, and how this run's accuracy
relates to the report's number for its cell. Real trials of the shipped ResNet reference model healed by CR+BN
(a search trial and a re-evaluation on another calibration draw), their MLflow runs as the sweep's logger writes
them, and the real console script."""
from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path

import pytest
import torch
from mlflow import MlflowClient
from mlflow.entities import Metric, Param
from safetensors.torch import load_file

from tasks.models import get_adapter, load_model
from tasks.pruning import MaskStore, make_masks
from tasks.trial import TrialParams, run_trial
from tests.orchestrator.run_cli import REPO, healsweep

MODEL, SWEEP, CELL, MASK = "resnet_digits", "5eed0f5eed0f", "cafe01", "b" * 32
FINAL = ("dense_acc", "pruned_acc", "healed_acc", "retention", "achieved_sparsity")


def _log(client: MlflowClient, exp: str, parent: str, p: TrialParams, final: dict, stage: str) -> str:
    """A trial's MLflow run with the tags and params orchestrator/tracking/logger.py writes (and its final
    metrics and digests, as on_trial_result logs them)."""
    tags = {"mlflow.parentRunId": parent, "sweep_id": SWEEP, "cell_id": CELL, "trial_id": p.trial_id,
            "store_key": p.store_key, "mask_key": p.mask_key, "target_mode": p.target_mode, "pattern": "0.5",
            "healsweep.role": "trial", "tune_trial_id": f"t{p.trial_id}", "stage": stage}
    run = client.create_run(exp, run_name=p.trial_id, tags=tags).info.run_id
    params = {"model": MODEL, "pruner": "magnitude", "scope": p.scope, "sparsity": "0.5", "calib_size": p.calib_size,
              "healer": "crbn", "granularity": "channel", "seed": p.seed, "lr": p.lr, "epochs": p.epochs,
              "batch_size": p.batch_size, "target_mode": p.target_mode, "grid": "main", "pruner_settings": "{}",
              "healer_settings": str(dict(p.healer_settings)), "optuna_trial": p.trial_id.rsplit("-", 1)[1],
              "mask_digest": final["mask_digest"]}
    if p.heal_seed is not None:
        params.update(heal_seed=p.heal_seed, calib_seed=p.load_kw["calib_seed"])
    client.log_batch(run, metrics=[Metric(k, float(final[k]), 0, 0) for k in FINAL],
                     params=[Param(k, str(v)) for k, v in params.items()])
    client.set_terminated(run, "FINISHED")
    return run


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    """-> (run directory, {stage: (run id, final result)}, the dense model)."""
    root = tmp_path_factory.mktemp("card")
    cache = Path(os.environ.get("HEALSWEEP_TEST_CACHE", REPO / ".healsweep" / "models"))
    lm = load_model(MODEL, cache, progress=False)
    adapter = get_adapter(lm.model)
    MaskStore(root / "masks").save(MASK, make_masks(lm.model, adapter.scope(lm.model, adapter.default_scope),
                                                    "magnitude", 0.5, seed=0), {})
    run_dir = root / "runs" / "default"
    run_dir.mkdir(parents=True)
    uri = f"sqlite:///{run_dir / 'mlflow.db'}"
    (run_dir / "sweep.json").write_text(json.dumps({"tracking_uri": uri, "sweep_id": SWEEP}))
    client = MlflowClient(uri)
    exp = client.create_experiment("healsweep")
    parent = client.create_run(exp, tags={"sweep_id": SWEEP, "healsweep.role": "sweep"}).info.run_id
    base = dict(model=MODEL, scope=adapter.default_scope, healer="crbn", calib_size=64, lr=0.0, epochs=0, seed=0,
                store_key="a" * 32, mask_key=MASK, store_uri=str(root / "targets"), mask_root=str(root / "masks"),
                cache_dir=str(cache), target_mode="recompute", healer_settings={"bn_batches": 2, "bn_batch_size": 8},
                out_dir=str(run_dir), sweep_id=SWEEP)
    runs = {}
    for stage, extra in (("search", dict(trial_id=f"{CELL}-0")),  # a closed-form cell: one search trial, then
                         ("reevaluate", dict(trial_id=f"{CELL}-1", heal_seed=1000, load_kw={"calib_seed": 1}))):
        p = TrialParams(**base, **extra)  # ... its configuration healed again on another calibration draw
        final = run_trial(p, lambda r: None)
        runs[stage] = (_log(client, exp, parent, p, final, stage), final)
    return run_dir, runs, lm.model


def _export(run: str, out: Path, *where: str):
    return healsweep("export", run, "--out", out, *where)


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.mark.timeout(600)
def test_a_reevaluations_card_names_its_trial_and_the_reports_number(sweep, tmp_path):
    """The card could not say which trial made the weights (no sweep, seeds, stage, grid, cell or mask digest), a
    closed-form healer's card claimed "lr 0, 0 epochs, batch 32", its sparsity did not say it was over the pruning
    scope, pruner_settings printed "{}", and its accuracy differed from the report's for its cell without a word."""
    run_dir, runs, dense = sweep
    run, final = runs["reevaluate"]
    out = tmp_path / "x"
    r = _export(run, out, "--runs", run_dir.parent)
    assert r.returncode == 0, r.stderr
    card = json.loads((out / "model_card.json").read_text())
    assert {k: card[k] for k in ("mlflow_run_id", "trial_id", "sweep_id", "grid", "cell_id", "stage", "seed",
                                 "heal_seed", "optuna_trial", "mask_key", "mask_digest", "calib_seed")} == {
        "mlflow_run_id": run, "trial_id": f"{CELL}-1", "sweep_id": SWEEP, "grid": "main", "cell_id": CELL,
        "stage": "reevaluate", "seed": 0, "heal_seed": 1000, "optuna_trial": 1, "mask_key": MASK,
        "mask_digest": final["mask_digest"], "calib_seed": 1}
    md = (out / "model_card.md").read_text()
    assert (f"- made by: MLflow run `{run}`, trial `{CELL}-1`, a re-evaluation of its cell's search winner on a fresh "
            f"healing seed (Optuna trial 1)\n- sweep `{SWEEP}`, grid `main`, cell `{CELL}`; seed 0 (the cell's: its "
            "mask), healing seed 1000 (batch order and initialisation of this re-evaluation)\n"
            f"- mask: key `{MASK}`, digest `{final['mask_digest']}`") in md
    # closed form: no training settings it did not use
    assert card["closed_form"] is True and (card["lr"], card["epochs"], card["batch_size"]) == (None, None, None)
    assert ("- healer: crbn (bn_batch_size=8, bn_batches=2) (granularity used: channel): closed form, no gradient "
            "training (no learning rate, epochs or batch size used)\n") in md
    assert not re.search(r"lr [0-9]|[0-9] epochs?\b|batch [0-9]", md)  # was "lr 0, 0 epochs, batch 32"
    # the sparsity over the pruning scope, and the whole model's zero weights (computed here from the export)
    sd, names = load_file(str(out / "model.safetensors")), [n for n, _ in dense.named_parameters()]
    zeros = sum(int((sd[n] == 0).sum()) for n in names) / sum(sd[n].numel() for n in names)
    assert card["zero_fraction"] == pytest.approx(zeros) and card["pruner_settings"] == {}
    assert (f"- pruner: magnitude, scope {card['scope']}: sparsity 0.5 over the pruning scope (achieved "
            f"{card['achieved_sparsity']:.4f}); zero weights in the whole model: {100 * zeros:.1f}% of its "
            "parameters\n") in md
    # this run's accuracy, and the report's for its cell (closed form on two draws: the mean over both runs)
    search, search_final = runs["search"]
    mean = (final["healed_acc"] + search_final["healed_acc"]) / 2
    assert card["report"] == {"healed_acc": pytest.approx(mean), "run_ids": sorted([run, search])}
    assert f"- accuracy of this run alone (evaluation split): dense {100 * final['dense_acc']:.2f}%" in md
    assert (f"- the report's healed number for cell `{CELL}`: {100 * mean:.2f}%, the mean over 2 runs (this run "
            f"among them): " + ", ".join(f"`{i}`" for i in sorted([run, search]))) in md


@pytest.mark.timeout(600)
def test_a_reexport_is_byte_identical_and_the_card_gives_each_files_sha256(sweep, tmp_path):
    """Two exports of one run differed in bytes (safetensors writes its metadata in hash-map order), and the card
    gave no sum of its files."""
    run_dir, runs, _ = sweep
    run, _ = runs["search"]
    outs = [tmp_path / "a", tmp_path / "b"]
    for out in outs:
        r = _export(run, out, "--run-dir", run_dir)
        assert r.returncode == 0, r.stderr
    names = ["mask.safetensors", "model.safetensors", "model_card.json", "model_card.md"]
    assert sorted(p.name for p in outs[0].iterdir()) == names
    assert [(outs[0] / n).read_bytes() == (outs[1] / n).read_bytes() for n in names] == [True] * 4
    card = json.loads((outs[0] / "model_card.json").read_text())
    assert card["files"] == {n: _sha(outs[0] / n) for n in ("model.safetensors", "mask.safetensors", "model_card.md")}
    md = (outs[0] / "model_card.md").read_text()
    assert (f"- files (sha256): `mask.safetensors` {_sha(outs[0] / 'mask.safetensors')}, `model.safetensors` "
            f"{_sha(outs[0] / 'model.safetensors')}\n") in md
    assert "the mean over 2 runs (this run among them)" in md  # the search trial of a closed-form cell on 2 draws
    from tasks.model_card import card_markdown  # a gradient healer's card: the settings it trained with

    grad = {**card, "closed_form": False, "lr": 1e-3, "epochs": 4, "batch_size": 32, "steps": 64,
            "healer_settings": {}, "granularity": None, "healer": "starfish"}
    assert "- healer: starfish, lr 0.001, 64 steps (4 epochs), batch 32\n" in card_markdown(grad)
    assert "- healer: starfish, lr 0.001, 4 epochs, batch 32\n" in card_markdown({**grad, "steps": None})


@pytest.mark.timeout(120)
def test_a_safetensors_header_is_written_in_one_order():
    """safetensors writes its metadata in hash-map order, drawn anew for every map: the same tensors and metadata
    gave files that differed in bytes, in one process too."""
    import tempfile

    from tasks.export import _save_tensors

    tensors = {"b.weight": torch.arange(6.0).reshape(2, 3), "a.bias": torch.zeros(3)}
    meta = {"format": "pt", "healsweep": "{}", "zeta": "1", "alpha": "2", "mid": "3"}
    with tempfile.TemporaryDirectory() as d:
        blobs = set()
        for i in range(12):
            _save_tensors(Path(d) / f"{i}.safetensors", tensors, meta)
            blobs.add((Path(d) / f"{i}.safetensors").read_bytes())
        assert len(blobs) == 1
        back = load_file(str(Path(d) / "0.safetensors"))
        assert all(torch.equal(back[k], v) for k, v in tensors.items())


@pytest.mark.timeout(600)
def test_a_trial_id_is_taken_for_its_run_id(sweep, tmp_path):
    """A trial id given where a run id is expected was a plain "not found": one sweep's trial id is its run."""
    run_dir, runs, _ = sweep
    out = tmp_path / "x"
    r = _export(f"{CELL}-1", out, "--runs", run_dir.parent)
    assert r.returncode == 0, r.stderr
    assert json.loads((out / "model_card.json").read_text())["mlflow_run_id"] == runs["reevaluate"][0]


@pytest.mark.timeout(300)
def test_a_mask_other_than_the_one_the_trial_healed_is_refused(sweep, tmp_path):
    """The card's mask digest is the exported mask's; a trial.json that logged another (the store's file under the
    key replaced since) is one error, not a card naming a mask the weights were not healed under."""
    import shutil

    from tasks.export import export_trial

    run_dir, runs, _ = sweep
    d = tmp_path / "run" / "trials" / f"{CELL}-0"
    shutil.copytree(run_dir / "trials" / f"{CELL}-0", d)
    rec = json.loads((d / "trial.json").read_text())
    logged, rec["final"]["mask_digest"] = rec["final"]["mask_digest"], "0" * 16
    (d / "trial.json").write_text(json.dumps(rec))
    with pytest.raises(ValueError, match=f"the mask {MASK} in .* \\(digest {logged}\\) is not the one the trial "
                                         f"healed \\(digest {'0' * 16}\\)"):
        export_trial(d, tmp_path / "out")
    assert not (tmp_path / "out" / "model_card.json").exists()
