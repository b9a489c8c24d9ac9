"""analysis/search_reach.py: searched cells where at most one search trial healed above chance, against hand-built
trials (10 classes, 360 evaluation images: chance limit 0.1 + 2 sqrt(0.09 / 360) = 0.1316)."""
from __future__ import annotations

import pandas as pd

from analysis.search_reach import lone_cells, lone_warning


def _t(cell, acc, stage="search", lr=1e-3, status="FINISHED"):
    return dict(cell_id=cell, healed_acc=acc, stage=stage, lr=lr, status=status, num_classes=10, n_eval=360)


def test_cells_whose_search_found_one_configuration_above_chance():
    rows = [_t("a", 0.92), _t("a", 0.083), _t("a", 0.13),  # 0.13 is within the limit: 1 of 3 above
            _t("a", 0.91, stage="reevaluate"), _t("a", 0.90, stage="reevaluate"),  # re-evaluations do not count
            _t("b", 0.92), _t("b", 0.50), _t("b", 0.083),  # 2 of 3 above
            _t("c", 0.90),  # one trial: nothing to compare
            _t("d", 0.083), _t("d", 0.95, status="FAILED"), _t("d", 0.09),  # 0 of 2 finished above
            _t("e", 0.7, lr=0.0), _t("e", 0.05, lr=0.0)]  # closed form: not searched
    lone = lone_cells(pd.DataFrame(rows))
    assert sorted(lone.index) == ["a", "d"]
    assert lone.loc["a"].tolist() == [1, 3] and lone.loc["d"].tolist() == [0, 2]
    gb = pd.DataFrame([dict(cell_id=c, healer="kl", pruner="magnitude", pattern="0.95", calib_size=128, seed=0,
                            healed_acc=a, lr=lr) for c, a, lr in (("a", 0.905, 1e-3), ("b", 0.9, 1e-3),
                                                                   ("d", 0.09, 1e-3), ("e", 0.7, 0.0))])
    w = lone_warning(pd.DataFrame(rows), gb)
    assert w.startswith("In 2 of 3 searched cells at most one search trial healed above chance: magnitude/kl 0.95 "
                        "n=128 seed 0 (0 of 2, quoted 9.0 %), magnitude/kl 0.95 n=128 seed 0 (1 of 3, quoted "
                        "90.5 %). Their numbers rest on at most one working configuration"), w
    assert lone_warning(pd.DataFrame(rows), gb[gb["cell_id"] == "b"]) == ""
    # search.converge stopped "a" at the dense model's accuracy: nothing left to find, not named
    w = lone_warning(pd.DataFrame(rows), gb.assign(search_stop=["recovered (1 trial)", "", "cap", ""]))
    assert w.startswith("In 1 of 3 searched cells at most one search trial healed above chance: magnitude/kl 0.95 "
                        "n=128 seed 0 (0 of 2, quoted 9.0 %). Their"), w
    # trials that logged no evaluation-set size have no chance limit: they count neither way
    unknown = [dict(_t("f", a), n_eval=float("nan")) for a in (0.9, 0.9)] + [_t("f", 0.95)]
    assert "f" not in lone_cells(pd.DataFrame(unknown)).index
    assert lone_warning(pd.DataFrame(rows).drop(columns="n_eval"), gb) == ""  # no chance limit: nothing claimed
