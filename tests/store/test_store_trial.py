"""The store inside a real trial: damaged shards are recomputed and the trial equals a clean run; the
recompute target mode (over the disk budget) streams the same targets computed on the fly."""
import os
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from tasks.healing import dense_targets, recompute_batches
from tasks.models import get_adapter, load_model
from tasks.pruning import MaskStore, make_masks
from tasks.store import TargetStore, content_key, ensure_targets
from tasks.trial import TrialParams, run_trial

REPO = Path(__file__).resolve().parents[2]
MODEL, CALIB, SHARD = "vit_digits", 48, 16
KEY = content_key({"test": "store-trial"})


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    cache = Path(os.environ.get("HEALSWEEP_TEST_CACHE", REPO / ".healsweep" / "models"))
    root = tmp_path_factory.mktemp("trial")
    lm = load_model(MODEL, cache, progress=False)
    adapter = get_adapter(lm.model)
    blocks = adapter.blocks(lm.model)
    images = lm.dataset["calibration"].images
    masks = make_masks(lm.model, adapter.scope(lm.model, adapter.default_scope), "magnitude", 0.5, seed=0)
    MaskStore(root / "masks").save("0" * 32, masks, {"test": True})
    st = TargetStore(root / "targets")

    def run_shards(plan):
        for i, a, b in plan:
            yield st.write_shard(KEY, i, a, dense_targets(lm.model, blocks, images[a:b]))
    params = TrialParams(model=MODEL, scope=adapter.default_scope, healer="starfish", calib_size=CALIB, lr=1e-3,
                         epochs=2, seed=3, store_key=KEY, mask_key="0" * 32, store_uri=str(root / "targets"),
                         mask_root=str(root / "masks"), cache_dir=str(cache), batch_size=16,
                         healer_settings={"granularity": "auto"})
    return st, run_shards, params, lm, blocks


def build(st, run_shards):
    return ensure_targets(st, KEY, CALIB, SHARD, run_shards, meta={"model": MODEL}, dtype="float16")


def trial(params, **kw):
    out = []
    final = run_trial(replace(params, **kw), out.append)
    return {k: v for k, v in final.items() if not k.endswith("_seconds")}, out


def test_damaged_shards_recomputed_and_trial_equals_clean_run(setup):
    st, run_shards, params, _, _ = setup
    assert build(st, run_shards).computed_rows == CALIB
    clean, clean_epochs = trial(params)
    assert clean["mask_violations"] == 0 and np.isfinite(clean["train_loss"])
    assert clean["seeded_mask"] == 0.0  # a mask given by key, no pruner
    path = st.key_dir(KEY) / "shard-00001.arrow"
    good = path.read_bytes()
    for damaged in (good[:-100], good[:500] + bytes([good[500] ^ 0x40]) + good[501:]):
        path.write_bytes(damaged)
        res = build(st, run_shards)
        assert res.computed_shards == [(1, 16, 32)] and len(res.events) == 1
        assert path.read_bytes() == good  # dense forward is deterministic here: the same bytes again
        again, epochs = trial(params)
        assert again == clean and [e["train_loss"] for e in epochs] == [e["train_loss"] for e in clean_epochs]


def test_recompute_mode_streams_the_same_targets(setup):
    st, run_shards, params, lm, blocks = setup
    build(st, run_shards)
    images = lm.dataset["calibration"].images[:CALIB]
    with st.open(KEY, num_rows=CALIB) as rd:
        seen = []
        for rows, tgt in recompute_batches(lm.model, blocks, images, 16, seed=3, epoch=1):
            ref = rd.read_rows(rows)
            for k in ref:  # same rows, same dense model: targets agree to float16 rounding
                torch.testing.assert_close(tgt[k], ref[k], rtol=2e-3, atol=2e-3)
            seen.append(rows)
    assert sorted(np.concatenate(seen).tolist()) == list(range(CALIB))
    rec, _ = trial(params, target_mode="recompute", store_uri="/nonexistent")  # never touches the store
    assert rec["mask_violations"] == 0 and rec["changed_outside_scope"] == 0 and np.isfinite(rec["train_loss"])
    assert rec["pruned_acc"] == trial(params)[0]["pruned_acc"]


def test_selection_accuracy_only_after_the_last_epoch_changes_no_result(setup):
    """epoch_selection=False (FIFO sweeps) skips the per-epoch selection evaluation: the final metrics,
    selection_acc included (it picks each cell's winner), are exactly those of the per-epoch run."""
    st, run_shards, params, lm, _ = setup
    build(st, run_shards)
    every, every_epochs = trial(params, epochs=3)
    last, last_epochs = trial(params, epochs=3, epoch_selection=False)
    assert last == every
    assert [("selection_acc" in e) for e in every_epochs] == [True] * 3  # epochs 1, 2 and the final report
    assert [("selection_acc" in e) for e in last_epochs] == [False, False, True]
    assert [e["train_loss"] for e in last_epochs[:2]] == [e["train_loss"] for e in every_epochs[:2]]
    sel = lm.dataset["selection"]
    assert 0 < last["selection_acc"] <= 1 and last["selection_acc"] * len(sel) == pytest.approx(
        round(last["selection_acc"] * len(sel)))


def test_dense_and_pruned_accuracy_measured_once_per_process_and_per_mask(setup):
    """A Tune actor runs many trials: the dense accuracies (evaluation split; selection split, the search
    objective's ceiling) are measured once per model and the pruned accuracy once per mask (tasks/trial.py
    _remembered), and all equal a fresh measurement; another mask is measured anew."""
    import tasks.trial as trial_mod
    from tasks.evaluate import accuracy
    from tasks.pruning import apply_masks

    st, run_shards, params, lm, _ = setup
    build(st, run_shards)
    root = Path(params.mask_root)
    model = load_model(MODEL, params.cache_dir, progress=False).model
    sparse = make_masks(model, get_adapter(model).scope(model, params.scope), "magnitude", 0.9, seed=0)
    MaskStore(root).save("1" * 32, sparse, {"test": True})
    trial_mod._ACCURACIES.clear()
    first, _ = trial(params)
    assert len(trial_mod._ACCURACIES) == 3  # dense on evaluation and on selection, pruned at 0.5
    again, _ = trial(params, seed=4)
    assert len(trial_mod._ACCURACIES) == 3 and again["pruned_acc"] == first["pruned_acc"]
    other, _ = trial(params, mask_key="1" * 32)
    assert len(trial_mod._ACCURACIES) == 4 and other["dense_acc"] == first["dense_acc"]
    assert other["dense_selection_acc"] == again["dense_selection_acc"] == first["dense_selection_acc"]
    ev, sel = lm.dataset["evaluation"], lm.dataset["selection"]
    fresh = load_model(MODEL, params.cache_dir, progress=False).model
    assert first["dense_acc"] == accuracy(fresh, ev.images, ev.labels)
    assert first["dense_selection_acc"] == accuracy(fresh, sel.images, sel.labels)
    assert first["n_selection"] == len(sel) > 0  # the objective's binomial noise (search.converge)
    apply_masks(fresh, sparse)
    assert other["pruned_acc"] == accuracy(fresh, ev.images, ev.labels) < first["pruned_acc"]


def test_a_process_loads_each_model_once_and_a_warm_trial_equals_a_cold_one(setup):
    """A Tune actor runs many trials: the model is loaded and verified once per process (later trials heal a deep
    copy) and the dense held-out reference is computed once; a trial with both caches warm gives exactly the
    numbers and healed weights of the same trial with both cold, and no trial's healing reaches the cached model."""
    import torch

    import tasks.trial as trial_mod
    from tasks.healing.heldout import HELDOUT, heldout_align, heldout_reference, heldout_slice
    from tasks.models import load as load_mod

    st, run_shards, params, lm, _ = setup
    build(st, run_shards)
    for cache in (load_mod._KEPT, trial_mod._REFERENCES, trial_mod._ACCURACIES):
        cache.clear()
    cold, _ = trial(params)
    assert len(load_mod._KEPT) == 1 and len(trial_mod._REFERENCES) == 1
    (pristine,) = load_mod._KEPT.values()
    dense = load_model(MODEL, params.cache_dir, progress=False)
    for k, v in dense.model.state_dict().items():  # the cached model is still the checkpoint's, bit for bit
        assert torch.equal(pristine.model.state_dict()[k], v), k
    warm, _ = trial(params)
    assert warm == cold  # every metric: accuracies, train_loss, heldout_align, sparsity, digests
    assert len(load_mod._KEPT) == 1 and len(trial_mod._REFERENCES) == 1
    images = dense.dataset["calibration"].images
    rows = heldout_slice(len(images), CALIB)
    assert rows == slice(len(images) - HELDOUT, len(images))
    (ref,) = trial_mod._REFERENCES.values()
    expect = heldout_reference(dense.model, get_adapter(dense.model).blocks(dense.model), images[rows])
    assert all(torch.equal(a, b) for a, b in zip(ref, expect))
    a, b = trial_mod.fresh_model(params).model, trial_mod.fresh_model(params).model
    assert a is not b and a.state_dict().keys() == b.state_dict().keys()
    with torch.no_grad():
        next(a.parameters()).add_(1.0)  # a trial's copy changes: the next copy does not
    assert torch.equal(next(b.parameters()), next(trial_mod.fresh_model(params).model.parameters()))
    assert heldout_align(b, get_adapter(b).blocks(b), ref, images[rows], "token") == pytest.approx(0.0, abs=1e-6)


def test_heal_seconds_is_the_healing_alone(setup, monkeypatch):
    """``heal_seconds`` times the healer, not the trial's evaluation passes (the final selection accuracy, the
    search objective, is measured after healing): the per-heal comparison with the authors' loop compares heals.
    Every accuracy pass made 2 s slower: the trial's time outside the heal holds both sleeps (selection +
    evaluation), the heal holds none (a margin of 1 s: a loaded machine moved a tiny heal by a few tenths)."""
    import time

    import tasks.trial as trial_mod

    st, run_shards, params, _, _ = setup
    build(st, run_shards)
    real, slow = trial_mod.accuracy, 2.0
    params = replace(params, epoch_selection=False)  # as a sweep runs (per-epoch selection only under ASHA)
    run_trial(params, lambda m: None)  # warm: model, accuracies, held-out reference cached in this process
    base = run_trial(params, lambda m: None)

    def slow_accuracy(*a, **kw):
        time.sleep(slow)
        return real(*a, **kw)

    monkeypatch.setattr(trial_mod, "accuracy", slow_accuracy)
    final = run_trial(params, lambda m: None)
    assert final["heal_seconds"] < base["heal_seconds"] + slow / 2  # no evaluation pass inside the heal
    assert final["trial_seconds"] - final["heal_seconds"] >= 2 * slow  # both passes are the trial's
    assert final["selection_acc"] == base["selection_acc"] == real(*_healed_selection(params))


def _healed_selection(params):
    """(healed model, selection images, labels) of ``params``'s trial, healed again (a trial is reproducible)."""
    from tasks.trial import heal_trial, setup_trial

    s = setup_trial(params)
    heal_trial(params, s, lambda m: None, None, None)
    sel = s.lm.dataset["selection"]
    return s.model, sel.images, sel.labels


@pytest.mark.parametrize("healer,settings,read", [("kl", {}, "logits"), ("starfish", {"granularity": "auto"}, "blocks"),
                                                  ("starfish_kl", {}, "all"), ("ce", {}, "all")])
def test_a_trial_reads_only_the_columns_its_healer_names(setup, healer, settings, read):
    """kl's trial streams the dense logits and no block output (DeiT-B at 224 px: 2 KB a row instead of 3.6 MB),
    starfish's the blocks and not the logits; a healer that reads none (ce) opens every column, as before."""
    from tasks.trial import setup_trial

    st, run_shards, params, _, _ = setup
    build(st, run_shards)
    cols = st.manifest(KEY)["block_names"]
    blocks = [c for c in cols if c != "logits"]
    p = replace(params, healer=healer, healer_settings=settings)
    s = setup_trial(p)
    try:
        assert s.reader.columns == cols and len(blocks) > 1
        assert s.reader.block_names == {"logits": ["logits"], "blocks": blocks, "all": cols}[read]
    finally:
        s.reader.close()
    final, epochs = trial(p)
    assert final["mask_violations"] == 0 and np.isfinite(final["train_loss"]) and len(epochs) == p.epochs
    if healer != "ce":  # ce streams its labeled set, not the store
        assert [e["rows_streamed"] for e in epochs[:-1]] == [CALIB] * (p.epochs - 1)


def test_a_trial_logs_whether_its_pruners_mask_depends_on_the_seed():
    """SnapViT's mask comes from a seeded search, magnitude's does not; a plugin says so by its class attribute."""
    from tasks.pruning import PRUNERS
    from tasks.trial import seeded_mask

    assert (seeded_mask("snapvit"), seeded_mask("magnitude"), seeded_mask("")) == (1.0, 0.0, 0.0)
    assert [n for n in PRUNERS.names() if seeded_mask(n)] == ["snapvit"]


def test_a_trial_refuses_targets_of_other_calibration_images(setup, tmp_path):
    """The manifest records the calibration digest the dense stage used; a trial whose images are another order
    (here: the store holds the targets of calib_seed 2's draw, the trial loads the data seed's order) fails with
    a one-line StoreError instead of aligning each image to another image's targets; with the draw it heals."""
    from tasks.store import StoreError

    _, _, params, _, _ = setup
    cache = Path(params.cache_dir)
    drawn = load_model(MODEL, cache, progress=False, calib_seed=2)
    blocks = get_adapter(drawn.model).blocks(drawn.model)
    images = drawn.dataset["calibration"].images
    st = TargetStore(tmp_path / "targets")

    def run_shards(plan):
        for i, a, b in plan:
            yield st.write_shard(KEY, i, a, dense_targets(drawn.model, blocks, images[a:b]))
    ensure_targets(st, KEY, CALIB, SHARD, run_shards, dtype="float16",
                   meta={"model": MODEL, "calibration": drawn.dataset.split_digest("calibration")})
    mine = replace(params, store_uri=str(tmp_path / "targets"), epochs=1)
    with pytest.raises(StoreError, match=r"targets are of calibration images \w+, this trial's are \w+ .*calib_seed"):
        run_trial(mine, lambda r: None)
    final = run_trial(replace(mine, load_kw={"calib_seed": 2}), lambda r: None)
    assert final["mask_violations"] == 0 and final["calib_digest"] == drawn.dataset.split_digest("calibration", CALIB)
