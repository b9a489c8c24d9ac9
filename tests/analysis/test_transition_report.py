"""Transition sections of the report from a tiny MLflow sweep (diagnostics artifact + trials)."""
from __future__ import annotations

import base64
import io
import json
import re

import matplotlib.image as mpimg
import numpy as np
import pytest
from mlflow import MlflowClient

from analysis import write_report
from analysis.cts import CTSSettings, compute_cts, j_rr
from analysis.rr import curves_from_frame, load_diagnostics
from tasks.pruning.allocation_math import erk_sparsities, greedy_allocate
from tests import transition_fixture as tf

MODEL = "resnet_digits"


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    root = tmp_path_factory.mktemp("trans")
    return tf.build_store(root, MODEL)


def test_diagnostics_round_trip(sweep):
    diags = load_diagnostics(sweep["uri"], sweep["parent"])
    assert list(diags) == [MODEL]
    c = curves_from_frame(diags[MODEL])
    assert c.layers == list(tf.LAYERS) and c.grid == list(tf.GRID)
    assert c.sizes == {"conv1.weight": 72, "layer1.conv.weight": 1152, "fc.weight": 160}
    assert c.shapes["fc.weight"] == (10, 16)
    np.testing.assert_array_equal(c.r[1], tf.R["layer1.conv.weight"])
    assert load_diagnostics(sweep["uri"], None) == {}


def test_report_has_every_section(sweep, tmp_path, monkeypatch):
    run_dir = tmp_path / "run"
    tf.write_sweep_json(run_dir, sweep["uri"])
    paths = write_report(run_dir)
    md = paths["md"].read_text()
    page = paths["html"].read_text()
    for heading in ("Calibration transition score (calibration data only)", "Per-layer relative repairability",
                    "Allocation: RR vs ERK at", "Repairability bands: magnitude", "Seed statistics per healer"):
        assert heading in md, heading
        assert heading in page, heading
    assert md.count("**How to read this.**") == 4  # cts, rr, alloc, bands figures
    imgs = re.findall(r'<img src="data:image/png;base64,([A-Za-z0-9+/=]+)"', page)
    assert len(imgs) == 6  # top-1 vs sparsity + paired healers figure (2 healers x 2 seeds) + four transition figures
    for b64 in imgs:
        px = mpimg.imread(io.BytesIO(base64.b64decode(b64)), format="png")
        assert len(np.unique(px.reshape(-1, px.shape[-1]), axis=0)) > 10  # not blank
    for stem in ("healers", "cts", "rr", "alloc", "bands_magnitude"):
        assert (run_dir / f"fig_{MODEL}_{stem}.png").is_file()

    bands = json.loads(paths["bands"].read_text())
    m = bands["models"][MODEL]
    # CTS equals a direct computation with the same allocation rules (math tested in test_cts.py)
    c = curves_from_frame(tf.diagnostics_frame(MODEL))
    cost = {ly: c.r[i].tolist() for i, ly in enumerate(c.layers)}
    st = CTSSettings()
    ref = compute_cts(c.r, c.grid, c.layers, lambda x: greedy_allocate(cost, c.sizes, c.grid, x),
                      lambda x: erk_sparsities(c.shapes, x),
                      CTSSettings(targets=tuple(x for x in st.targets if x <= 0.975)))
    assert m["cts"]["CTS_smooth"] == pytest.approx(ref["CTS_smooth"])
    assert m["cts"]["core"] == ref["core"] and ref["core"] is not None
    by = {b["healer"]: b for b in m["bands"]}
    assert by["starfish"]["intervals"] == [{"label": "recoverable", "lo": 0.5, "hi": 0.7},
                                           {"label": "transition", "lo": 0.8, "hi": 0.9},
                                           {"label": "collapse", "lo": 0.95, "hi": 0.95}]
    assert [iv["label"] for iv in by["none"]["intervals"]] == ["recoverable", "transition", "collapse"]
    assert set(by["starfish"]["agreement"]) == {"core_iou", "core_coverage", "band_iou", "band_coverage"}
    p = by["starfish"]["points"][1]
    assert p["healed_mean"] == pytest.approx(0.85) and p["healed_std"] == pytest.approx(2 ** 0.5 * 0.01)
    assert set(p["run_ids"]) == {sweep["ids"]["starfish-0.7-0"], sweep["ids"]["starfish-0.7-1"]}
    assert f"<code>{sweep['ids']['starfish-0.7-0']}</code>" in page  # row links (sqlite: ids, no URL)
    assert "85.00 ± 1.41" in md


def test_report_without_diagnostics(tmp_path):
    sweep = tf.build_store(tmp_path, diagnostics=False)  # a sweep that logged no RR diagnostics artifact
    run_dir = tmp_path / "run"
    tf.write_sweep_json(run_dir, sweep["uri"])
    md = write_report(run_dir)["md"].read_text()
    assert "there is no calibration transition score" in md and "Repairability bands: magnitude" in md
    assert "IoU with CTS core n/a (no CTS interval), with CTS band n/a (no CTS interval)" in md
    assert "IoU with CTS core 0.00" not in md
    assert "| magnitude | starfish | 64 | up to 70 % | 80–90 % | from 95 % | grid step 5–20 pp | n=2, max std 1.4 pp " \
           "| 95 % | n/a (no CTS) |" in md  # CTS column: n/a, not a band; 95 %: its class is within the seeds' noise


def test_diagnostics_logged_but_gone_are_not_called_never_logged(tmp_path):
    """An artifact deleted (or a run directory copied without it): the report said "No RR diagnostics were logged",
    false while the parent run's diagnostics_key tag says they were."""
    sweep = tf.build_store(tmp_path)
    for f in (tmp_path / "art").rglob(f"{MODEL}.parquet"):
        f.unlink()
    run_dir = tmp_path / "run"
    tf.write_sweep_json(run_dir, sweep["uri"])
    md = write_report(run_dir)["md"].read_text()
    assert (f"RR diagnostics were logged for this model (parent-run tag diagnostics_key.{MODEL}) but "
            f"diagnostics/{MODEL}.parquet is missing from the parent run's artifacts") in md
    assert "No RR diagnostics were logged" not in md


def test_grids_get_their_own_band_figures_and_tables(tmp_path):
    """A healer comparison grid's cells were drawn in the main grid's figure and table, unlabelled."""
    from mlflow.entities import Param

    sweep = tf.build_store(tmp_path)
    client = MlflowClient(sweep["uri"])
    for cell, rid in sweep["ids"].items():
        client.log_batch(rid, params=[Param("grid", "healers" if cell.startswith("none-") else "main")])
    run_dir = tmp_path / "run"
    tf.write_sweep_json(run_dir, sweep["uri"])
    md = write_report(run_dir)["md"].read_text()
    for heading in ("Repairability bands: magnitude", "Repairability bands: magnitude (grid healers)",
                    "Seed statistics per healer", "Seed statistics per healer (grid healers)"):
        assert f"\n{heading}\n" in md or f"#### {heading}\n" in md or f"### {heading}\n" in md, heading
    assert (run_dir / f"fig_{MODEL}_bands_magnitude.png").is_file()
    assert (run_dir / f"fig_{MODEL}_bands_healers_magnitude.png").is_file()
    main_table = md.split("Seed statistics per healer\n")[1].split("Seed statistics per healer (grid healers)")[0]
    assert "| starfish |" in main_table and "| none |" not in main_table


def test_json_clean():
    from analysis.transition_report import json_clean

    got = json_clean({"a": float("nan"), "b": (np.float32(0.5), np.int64(3)), "c": [float("inf"), "x"]})
    assert got == {"a": None, "b": [0.5, 3], "c": [None, "x"]}
    assert type(got["b"][1]) is int


def test_rr_targets_capped_at_reachable(monkeypatch):
    from analysis.rr import _reachable, allocations

    c = curves_from_frame(tf.diagnostics_frame(MODEL))
    assert _reachable(c, 0.99) == pytest.approx(0.975) and _reachable(c, 0.9) == 0.9
    al = allocations(c, 0.99)
    assert set(al["RR"].values()) == {0.975}  # every layer at the top of the grid
    assert al["ERK"] == pytest.approx({ly: 0.975 for ly in tf.LAYERS}, abs=1e-6)  # ERK floor 0.025


def test_jrr_table_includes_lamp_logged_by_the_sweep(sweep, tmp_path, monkeypatch):
    """J_RR of RR, ERK and the LAMP allocation the sweep logged as diagnostics/<model>.lamp.json."""
    lamp = {"0.9500": {"conv1.weight": 0.90, "layer1.conv.weight": 0.95, "fc.weight": 0.975}}
    src = tmp_path / f"{MODEL}.lamp.json"
    src.write_text(json.dumps(lamp))
    MlflowClient(sweep["uri"]).log_artifact(sweep["parent"], str(src), "diagnostics")
    run_dir = tmp_path / "run"
    tf.write_sweep_json(run_dir, sweep["uri"])
    md = write_report(run_dir)["md"].read_text()
    assert "### J_RR of the allocations" in md
    # R at the LAMP sparsities: conv1 0.70 @0.90, layer1 0.70 @0.95, fc 0.70 @0.975 -> mean 0.700
    row = next(line for line in md.splitlines() if line.startswith("| 95% |"))
    assert row.endswith("| 0.700 |")
    c = curves_from_frame(tf.diagnostics_frame(MODEL))
    cost = {ly: c.r[i].tolist() for i, ly in enumerate(c.layers)}
    rr = j_rr(c.r, c.grid, c.layers, greedy_allocate(cost, c.sizes, c.grid, 0.95))
    assert row.startswith(f"| 95% | {rr:.3f} |")
    # 97.5 % is the candidate grid's end: every allocation is forced there, so J_RR is not reported
    assert not any(line.startswith("| 97.5% |") for line in md.splitlines())
    assert "not reported at or above 97.5%" in md
    assert next(line for line in md.splitlines() if line.startswith("| 90% |")).endswith("| – |")  # not logged
