"""Healer entries of a spec (single healers and chains), their validation, and the search's one-trial cells."""
from __future__ import annotations

import pytest

from orchestrator.spec.plan import expand_cells
from orchestrator.search import PerCellOptunaSearch
from orchestrator.spec import SpecError, parse_spec
from tests.orchestrator.test_spec import spec_with


def test_chain_entry_becomes_one_named_healer_with_steps():
    s = parse_spec(spec_with(healers=["none", {"chain": ["none", {"name": "starfish", "settings": {"granularity": "example"}}]},
                                      {"name": "starfish_kl", "settings": {"w_kl": 0.25}}]))
    assert [h.name for h in s.healers] == ["none", "none+starfish", "starfish_kl"]
    assert s.healers[1].settings == {"chain": [{"name": "none", "settings": {}},
                                               {"name": "starfish", "settings": {"granularity": "example"}}]}
    cells = expand_cells(s, {"vit_digits": "qkv_out_mlp"})
    assert {c.healer for c in cells} == {"none", "none+starfish", "starfish_kl"}
    assert len({c.cell_id for c in cells}) == len(cells) == 2 * 2 * 3  # sparsities x calib sizes x healers


@pytest.mark.parametrize("healers,path,msg", [
    ([{"chain": ["none", "nope"]}], "healers[0].chain[1].name", "unknown healer 'nope'"),
    (["starfish", {"chain": ["mse", {"name": "starfish", "settings": {"granularity": "x"}}]}],
     "healers[1].chain[1].settings", "must be one of"),
    ([{"chain": ["none"]}], "healers[0].chain", "at least 2"),
    ([{"chain": "none"}], "healers[0].chain", "non-empty list"),
    ([{"chain": ["none", {"chain": ["mse", "kl"]}]}], "healers[0].chain[1]", "do not nest"),
    ([{"chain": ["none", "mse"], "name": "x"}], "healers[0].name", "unknown key"),
    (["mse", "kl", "mse"], "healers[2]", "listed twice"),
    ([{"name": "ce", "settings": {"split": "selection"}}], "healers[0].settings", "'split' must be one of"),
    ([{"name": "starfish_kl", "settings": {"w_align": 0, "w_kl": 0}}], "healers[0].settings", "both 0"),
    (["nope"], "healers[0].name", "unknown healer"),
])
def test_bad_healer_entries_name_the_position(healers, path, msg):
    with pytest.raises(SpecError, match=msg) as e:
        parse_spec(spec_with(healers=healers))
    assert e.value.path == path and "\n" not in str(e.value)


def test_ce_without_labeled_train_split_is_rejected(monkeypatch):
    """digits has a labeled train split; a dataset whose train split is unlabeled is rejected, naming both sides."""
    from dataclasses import replace

    import orchestrator.spec.parse as parse
    from tasks.data import load_dataset

    def unlabeled_train(name, seed=0, settings=None):  # the real digits data, its train split's labels removed
        d = load_dataset(name, seed)
        return replace(d, splits={**d.splits, "train": replace(d["train"], labels=None)})

    monkeypatch.setattr(parse, "dataset_layout", unlabeled_train)
    with pytest.raises(SpecError, match=r"healer 'none\+ce' with dataset 'digits': chain\[1\] \('ce'\): .*unlabeled") as e:
        parse_spec(spec_with(healers=["starfish", {"chain": ["none", "ce"]}]))
    assert e.value.path == "healers[1]"
    parse_spec(spec_with(healers=["starfish", "kl"]))  # healers that read no labels are fine


def test_healers_without_training_get_one_trial_and_no_search(tmp_path):
    cells = [{"cell_id": "a", "healer": "none", "healer_settings": {}},
             {"cell_id": "b", "healer": "starfish", "healer_settings": {}},
             {"cell_id": "c", "healer": "none+starfish",
              "healer_settings": {"chain": [{"name": "none"}, {"name": "starfish"}]}}]
    s = PerCellOptunaSearch(cells, 3, (1e-4, 1e-2), (1, 5), 0, tmp_path / "j")
    assert s.total == 1 + 3 + 3
    got = []
    for i in range(7):  # each trial told before the next ask (a cell's TPE asks wait for its earlier tells)
        got.append(s.suggest(f"t{i}"))
        if i < 6:
            s.on_trial_complete(f"t{i}", {"selection_acc": 0.5, "final": True})  # the journal numbers the one
    assert s.suggest("t7") == PerCellOptunaSearch.FINISHED                    # fixed trial: never rerun
    assert [g["cell_id"] for g in got] == ["a", "b", "c", "b", "c", "b", "c"]
    assert (got[0]["lr"], got[0]["epochs"], got[0]["trial_id"]) == (0.0, 0, "a-0")
    assert all(1e-4 <= g["lr"] <= 1e-2 and 1 <= g["epochs"] <= 5 for g in got[1:])
    assert len(s.study("a").trials) == 1 and len(s.study("b").trials) == 3
    resumed = PerCellOptunaSearch(cells, 3, (1e-4, 1e-2), (1, 5), 0, tmp_path / "j")
    assert resumed.already_done == 6 and [f"{q.cell_id}-{q.number}" for q in resumed.design.queue] == ["c-2"]  # asked, not told
