"""Healers beyond STARFISH (tasks.healing): hand-checked objectives, what each one reads, composition, checks."""
import math

import pytest
import torch

from tasks.healing import HEALERS, LOGITS, HealConfig, block_tap, resolve_healer
from tasks.healing.chain import ChainHealer
from tasks.healing.losses import ce_loss, cosine_align_loss, kl_logit_loss, weighted_sum

CFG = dict(lr=1e-2, epochs=3, batch_size=8, seed=2)


def _chain(*names, settings=None):
    steps = [{"name": n, "settings": (settings or {}).get(n, {})} for n in names]
    return resolve_healer("+".join(names), {"chain": steps}), {"chain": steps}


# --- objectives, by hand --------------------------------------------------------------------------------

# Example 0: dense logits [0, 0] -> q = [1/2, 1/2]; pruned [log 3, 0] -> p = [3/4, 1/4].
#   KL(q || p) = 1/2 log((1/2)/(3/4)) + 1/2 log((1/2)/(1/4)) = 1/2 log(4/3)
#   (the other direction, KL(p || q) = 3/4 log(3/2) + 1/4 log(1/2), is a different number)
# Example 1: identical logits -> 0.  batchmean -> 1/4 log(4/3).
PRUNED = torch.tensor([[math.log(3.0), 0.0], [1.0, 2.0]])
DENSE = torch.tensor([[0.0, 0.0], [1.0, 2.0]])


def test_kl_hand_value_direction_and_invariances():
    assert kl_logit_loss(PRUNED, DENSE).item() == pytest.approx(0.25 * math.log(4 / 3), abs=1e-7)
    reverse = 0.5 * (0.75 * math.log(1.5) + 0.25 * math.log(0.5))
    assert abs(kl_logit_loss(PRUNED, DENSE).item() - reverse) > 1e-3
    assert kl_logit_loss(PRUNED + 5.0, DENSE - 2.0).item() == pytest.approx(0.25 * math.log(4 / 3), abs=1e-6)
    assert kl_logit_loss(PRUNED, DENSE.half()).item() == pytest.approx(0.25 * math.log(4 / 3), abs=1e-6)
    assert kl_logit_loss(DENSE, DENSE).item() == pytest.approx(0.0, abs=1e-7)
    with pytest.raises(ValueError, match=r"\(B, K\)"):
        kl_logit_loss(PRUNED, DENSE[:1])


def test_ce_and_weighted_sum_hand_values():
    # softmax([log 3, 0]) = [3/4, 1/4]; labels 0 then 1: -log(3/4), and example 1: -log softmax([1, 2])[1]
    ex1 = -math.log(math.exp(2) / (math.exp(1) + math.exp(2)))
    assert ce_loss(PRUNED, torch.tensor([0, 1])).item() == pytest.approx((-math.log(0.75) + ex1) / 2, abs=1e-6)
    assert weighted_sum([(0.5, torch.tensor(2.0)), (0.5, torch.tensor(4.0))]).item() == 3.0
    assert weighted_sum([(0.0, torch.tensor(float("nan"))), (1.0, torch.tensor(2.0))]).item() == 2.0
    with pytest.raises(ValueError, match="nonzero weight"):
        weighted_sum([(0.0, torch.tensor(1.0))])


# --- what each healer optimises, checked at lr = 0 against the full calibration set ----------------------

def _full_set(case):
    with torch.no_grad(), block_tap(case.ctx.blocks) as cap:
        logits = case.model(case.ctx.images)
        names = [n for n, _ in case.ctx.blocks]
        cos = cosine_align_loss([cap[n] for n in names], [case.targets[n] for n in names], "token").item()
    return cos, kl_logit_loss(logits, case.targets[LOGITS]).item()


def test_zero_lr_epoch_losses_are_the_full_set_objectives(heal_case):
    """At lr = 0 an epoch's loss is the objective on all 32 rows: kl = batchmean KL, starfish_kl = 0.5 cos +
    0.5 KL (weights settable), ce = CE on the labeled set; the weights stay bit-identical."""
    zero = dict(lr=0.0, lr_min=0.0, epochs=1, batch_size=8)
    case = heal_case("timm_vit", "qkv_out_mlp", sparsity=0.5)
    cos, kl = _full_set(case)
    assert cos > 1e-3 and kl > 1e-4
    got = {}
    for name, settings in (("kl", {}), ("starfish_kl", {}), ("starfish_kl", {"w_align": 0.2, "w_kl": 3.0}),
                           ("ce", {})):
        got[name, str(settings)] = HEALERS.get(name).heal(case.ctx, HealConfig(**zero, settings=settings)).epoch_losses[0]
    sd = case.model.state_dict()
    assert all(torch.equal(sd[k], case.before[k]) for k in sd)
    assert got["kl", "{}"] == pytest.approx(kl, rel=1e-5)
    assert got["starfish_kl", "{}"] == pytest.approx(0.5 * cos + 0.5 * kl, rel=1e-5)
    assert got["starfish_kl", str({"w_align": 0.2, "w_kl": 3.0})] == pytest.approx(0.2 * cos + 3.0 * kl, rel=1e-5)
    images, labels = case.ctx.labeled
    with torch.no_grad():
        assert got["ce", "{}"] == pytest.approx(ce_loss(case.model(images), labels).item(), rel=1e-5)


@pytest.mark.parametrize("name", ["mse", "kl", "ce", "starfish_kl"])
def test_gradient_healers_reduce_their_objective(heal_case, name):
    case = heal_case("timm_vit", "qkv_out_mlp", sparsity=0.8)
    res = HEALERS.get(name).heal(case.ctx, HealConfig(**CFG))
    assert res.steps == 3 * 4 and len(res.epoch_losses) == 3  # 32 rows (and 32 labeled items) / batch 8
    assert res.epoch_losses[-1] < 0.9 * res.epoch_losses[0], res.epoch_losses
    case.assert_invariants()


def test_starfish_kl_with_zero_kl_weight_is_starfish(heal_case):
    a, b = heal_case("timm_vit", "qk_mlp"), heal_case("timm_vit", "qk_mlp")
    ra = HEALERS.get("starfish").heal(a.ctx, HealConfig(**CFG))
    rb = HEALERS.get("starfish_kl").heal(b.ctx, HealConfig(**CFG, settings={"w_align": 1.0, "w_kl": 0.0}))
    assert ra.epoch_losses == rb.epoch_losses
    assert all(torch.equal(v, b.model.state_dict()[k]) for k, v in a.model.state_dict().items())


@pytest.mark.parametrize("name,hooks", [("kl", False), ("ce", False), ("mse", True), ("starfish_kl", True)])
def test_block_hooks_only_where_the_objective_reads_blocks(heal_case, name, hooks):
    case = heal_case("timm_vit", "qkv_out_mlp")
    healer = HEALERS.get(name)
    seen = []
    orig = type(healer).objective

    def spy(self, blocks, logits, targets, block_names, settings):
        seen.append((len(blocks), sum(len(m._forward_hooks) for _, m in case.ctx.blocks)))
        return orig(self, blocks, logits, targets, block_names, settings)

    pm = pytest.MonkeyPatch()
    pm.setattr(type(healer), "objective", spy)
    try:
        healer.heal(case.ctx, HealConfig(lr=1e-3, epochs=1, batch_size=8))
    finally:
        pm.undo()
    n_blocks = len(case.ctx.blocks)
    assert seen == [(n_blocks, n_blocks) if hooks else (0, 0)] * 4


def test_ce_iterates_its_own_seeded_labeled_batches(heal_case):
    case = heal_case("resnet", "conv")
    ce = HEALERS.get("ce")
    images, labels = case.ctx.labeled
    case.ctx.labeled = (images[:20], labels[:20])  # 20 items, batch 8 -> 3 steps per epoch
    cfg = HealConfig(lr=1e-3, epochs=2, batch_size=8, seed=4)
    batches = [list(ce.stream(case.ctx, cfg, e)) for e in range(2)]
    assert [len(x) for x, _ in batches[0]] == [8, 8, 4]
    for epoch in batches:
        got = torch.cat([t["labels"] for _, t in epoch])
        assert sorted(got.tolist()) == sorted(labels[:20].tolist())
    assert not torch.equal(torch.cat([x for x, _ in batches[0]]), torch.cat([x for x, _ in batches[1]]))
    assert ce.heal(case.ctx, cfg).steps == 6
    case.ctx.labeled = None
    with pytest.raises(ValueError, match="labeled set"):
        ce.heal(case.ctx, cfg)


def test_none_changes_nothing_and_reports_no_epochs(heal_case):
    case = heal_case("resnet", "conv")
    seen = []
    res = HEALERS.get("none").heal(case.ctx, HealConfig(**CFG), on_epoch=lambda e, m: seen.append(e))
    assert (res.epoch_losses, res.steps, seen) == ([], 0, [])
    assert HEALERS.get("none").epochs(HealConfig(**CFG)) == 0 and not HEALERS.get("none").trains
    assert all(torch.equal(v, case.before[k]) for k, v in case.model.state_dict().items())


# --- composition ----------------------------------------------------------------------------------------

def test_none_then_starfish_is_starfish(heal_case):
    a, b = heal_case("timm_vit", "qk_mlp"), heal_case("timm_vit", "qk_mlp")
    chain, settings = _chain("none", "starfish")
    assert chain.name == "none+starfish" and chain.trains
    ra = HEALERS.get("starfish").heal(a.ctx, HealConfig(**CFG))
    rb = chain.heal(b.ctx, HealConfig(**CFG, settings=settings))
    assert (ra.epoch_losses, ra.steps) == (rb.epoch_losses, rb.steps)
    assert all(torch.equal(v, b.model.state_dict()[k]) for k, v in a.model.state_dict().items())


def test_chain_runs_in_order_with_continuing_epochs_and_part_settings(heal_case):
    a, b = heal_case("timm_vit", "qk_mlp"), heal_case("timm_vit", "qk_mlp")
    cfg = HealConfig(**CFG)
    ref = HEALERS.get("mse").heal(a.ctx, cfg).epoch_losses
    ref += HEALERS.get("starfish").heal(a.ctx, HealConfig(**CFG, settings={"granularity": "example"})).epoch_losses
    chain, settings = _chain("mse", "starfish", settings={"starfish": {"granularity": "example"}})
    seen = []
    res = chain.heal(b.ctx, HealConfig(**CFG, settings=settings), on_epoch=lambda e, m: seen.append((e, m["train_loss"])))
    assert res.epoch_losses == ref and res.steps == 2 * 3 * 4
    assert seen == list(zip(range(1, 7), ref)) and chain.epochs(cfg) == 6
    assert all(torch.equal(v, b.model.state_dict()[k]) for k, v in a.model.state_dict().items())
    b.assert_invariants(allowed=chain.may_change(b.model, b.entries, settings))  # qk_train='qkv': V rows


def test_chain_errors_name_the_position(heal_case):
    with pytest.raises(ValueError, match=r"chain\[1\]: unknown healer 'nope'"):
        ChainHealer([{"name": "none"}, {"name": "nope"}])
    with pytest.raises(ValueError, match="at least 2"):
        ChainHealer([{"name": "none"}])
    chain, settings = _chain("none", "starfish", settings={"starfish": {"granularity": "channel"}})
    with pytest.raises(ValueError, match=r"chain\[1\] \('starfish'\): .*granularity"):
        chain.check(settings)
    with pytest.raises(ValueError, match="does not match"):
        resolve_healer("starfish+none", settings)
    with pytest.raises(KeyError, match="unknown healer"):
        resolve_healer("corpx+starfish", {})
    assert not _chain("none", "none")[0].trains


# --- settings and data checks ---------------------------------------------------------------------------

def test_settings_checks():
    sk = HEALERS.get("starfish_kl")
    sk.check({"w_align": 0.25, "w_kl": 1, "granularity": "token"})
    for bad, msg in (({"w_kl": -1.0}, ">= 0"), ({"w_kl": "x"}, ">= 0"), ({"w_align": 0, "w_kl": 0.0}, "both 0"),
                     ({"granularity": "channel"}, "one of"), ({"temperature": 2}, "unknown setting")):
        with pytest.raises(ValueError, match=msg):
            sk.check(bad)
    HEALERS.get("ce").check({"split": "train"})
    with pytest.raises(ValueError, match="'split' must be one of"):
        HEALERS.get("ce").check({"split": "evaluation"})
    with pytest.raises(ValueError, match="unknown setting"):
        HEALERS.get("mse").check({"granularity": "token"})


class _Toy:
    def __init__(self, **splits):
        self.name, self.splits = "toy", splits

    def __getitem__(self, k):
        return self.splits[k]


def test_ce_check_data_names_dataset_and_split():
    from tasks.data import load_digits

    ce = HEALERS.get("ce")
    ce.check_data(load_digits(0), {})
    lab = load_digits(0)["selection"]
    with pytest.raises(ValueError, match="labeled 'train' split but dataset 'toy' has only calibration"):
        ce.check_data(_Toy(calibration=lab), {})
    unl = load_digits(0)["calibration"]  # labels None by contract
    with pytest.raises(ValueError, match="split 'train' of dataset 'toy' is unlabeled"):
        ce.check_data(_Toy(train=unl), {})
    chain, settings = _chain("none", "ce")
    with pytest.raises(ValueError, match=r"chain\[1\] \('ce'\)"):
        chain.check_data(_Toy(train=unl), settings)


# --- what each healer reads from the target store ---------------------------------------------------------

def test_each_healer_names_the_target_columns_it_reads():
    """A trial's store reader hands out only these (tasks/trial.py): block outputs for block objectives, the dense
    logits for logit distillation, nothing for ce (its labeled set) and the closed-form healers."""
    b = ["blocks.0", "blocks.1"]
    assert {n: HEALERS.get(n).reads_targets(b, {}) for n in HEALERS.names()} == {
        "starfish": b, "mse": b, "kl": [LOGITS], "starfish_kl": [*b, LOGITS],
        "ce": [], "corp": [], "crbn": [], "none": []}
    sk = HEALERS.get("starfish_kl")
    assert sk.reads_targets(b, {"w_kl": 0.0}) == b and sk.reads_targets(b, {"w_align": 0.0}) == [LOGITS]
    for names, want in ((("kl", "starfish"), [LOGITS, *b]), (("corp", "starfish"), b), (("starfish", "starfish_kl"),
                                                                                        [*b, LOGITS])):
        chain, settings = _chain(*names)
        assert chain.reads_targets(b, settings) == want


@pytest.mark.parametrize("name,settings", [("starfish", {}), ("mse", {}), ("kl", {}), ("ce", {}), ("starfish_kl", {}),
                                           ("starfish_kl", {"w_kl": 0.0}), ("starfish_kl", {"w_align": 0.0}),
                                           ("kl+starfish", None)])
def test_a_heal_fed_only_the_columns_it_names_equals_one_fed_every_column(heal_case, name, settings):
    """The columns ``reads_targets`` names are all a heal needs (a missing one would be a KeyError), and nothing
    else moves a number: the same losses and healed weights, bit for bit."""
    a, b = heal_case("timm_vit", "qkv_out_mlp", sparsity=0.8), heal_case("timm_vit", "qkv_out_mlp", sparsity=0.8)
    healer, settings = (HEALERS.get(name), settings) if settings is not None else _chain(*name.split("+"))
    cols = healer.reads_targets([n for n, _ in b.ctx.blocks], settings)
    every = b.ctx.batches
    b.ctx.batches = lambda e: ((rows, {k: t[k] for k in cols}) for rows, t in every(e))
    ra = healer.heal(a.ctx, HealConfig(**CFG, settings=settings))
    rb = healer.heal(b.ctx, HealConfig(**CFG, settings=settings))
    assert ra.epoch_losses == rb.epoch_losses and ra.steps == rb.steps > 0
    assert all(torch.equal(v, b.model.state_dict()[k]) for k, v in a.model.state_dict().items())
