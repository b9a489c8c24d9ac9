"""analysis/: MLflow read-back, best-per-cell selection and the HTML/Markdown report.

A real SQLite MLflow store is built following the orchestrator's logging contract (parent sweep run,
one child run per trial with tags, string params and per-epoch + final metrics).
"""

from __future__ import annotations

import base64
import io
import json
import re
import time

import matplotlib.image as mpimg
import numpy as np
import pandas as pd
import pytest
from mlflow import MlflowClient
from mlflow.entities import Metric, Param

from analysis import best_per_cell, load_trials, write_report, write_report_from
from analysis.report import model_figure, run_url

SWEEP, OTHER = "sw-0001", "sw-0002"
SWEEP_NAME = "demo <sweep> & co"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
RESNET_DENSE, DEIT_DENSE = 0.80123, 0.72
RESNET_DIGEST = "0123456789abcdef"


def _trial(client, exp_id, parent_id, sweep, cell, trial, model, pattern, calib, *, lr=6e-4,
           epochs=3, sel=None, healed=None, pruned=None, dense=None, heal_s=10.0, achieved=None,
           retention=None, status="FINISHED", failure=None, digest=None):
    tags = {"mlflow.parentRunId": parent_id, "sweep_id": sweep, "cell_id": cell,
            "trial_id": trial, "store_key": f"k-{cell}", "healsweep.role": "trial",
            "pattern": pattern}
    if failure:
        tags["failure_reason"] = failure
    run = client.create_run(exp_id, tags=tags, run_name=f"{cell}-{trial}")
    rid = run.info.run_id
    sparsity = 0.5 if pattern == "2:4" else float(pattern)
    params = dict(model=model, pruner="magnitude", scope="conv", sparsity=str(sparsity),
                  calib_size=str(calib), healer="starfish", granularity="example", seed="0",
                  lr=repr(lr), epochs=str(epochs), batch_size="32")
    if digest:  # the weights' sha256 (16 hex), logged by a finished trial
        params["model_digest"] = digest
    ts = int(time.time() * 1000)
    metrics = []
    if status == "FINISHED":
        for ep in range(1, epochs + 1):  # per-epoch curves; the last selection_acc is the final one
            metrics.append(Metric("train_loss", 0.5 / ep, ts + ep, ep))
            metrics.append(Metric("selection_acc", sel - 0.01 * (epochs - ep), ts + ep, ep))
        final = dict(dense_acc=dense, pruned_acc=pruned, healed_acc=healed,
                     retention=retention if retention is not None else healed / dense,
                     heal_seconds=heal_s, dense_forward_images=float(calib), mask_violations=0.0,
                     achieved_sparsity=achieved if achieved is not None else sparsity)
        metrics += [Metric(k, float(v), ts + epochs + 1, epochs) for k, v in final.items()]
    client.log_batch(rid, metrics=metrics,
                     params=[Param(k, v) for k, v in params.items()], tags=[])
    client.set_terminated(rid, status)
    return rid


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    root = tmp_path_factory.mktemp("sweep")
    uri = f"sqlite:///{root / 'mlflow.db'}"
    client = MlflowClient(uri)
    exp_id = client.create_experiment("healsweep", artifact_location=(root / "art").as_uri())
    parent = client.create_run(exp_id, tags={"sweep_id": SWEEP, "healsweep.role": "sweep"},
                               run_name=SWEEP_NAME).info.run_id
    R = dict(client=client, exp_id=exp_id, parent_id=parent, sweep=SWEEP)
    rn = dict(model="resnet18", dense=RESNET_DENSE, digest=RESNET_DIGEST)
    ids = {}
    # c1: best by selection (t1) is NOT best by healed (t0); one failed run.
    ids["c1/t0"] = _trial(**R, **rn, cell="c1", trial="t0", pattern="0.5", calib=64, lr=1e-3,
                          epochs=4, sel=0.70, healed=0.66, pruned=0.10351, achieved=0.49812)
    ids["c1/t1"] = _trial(**R, **rn, cell="c1", trial="t1", pattern="0.5", calib=64,
                          lr=3.16227766e-4, epochs=7, sel=0.72, healed=0.64, pruned=0.10351,
                          achieved=0.49812, retention=0.7988, heal_s=20.0)
    ids["c1/t2"] = _trial(**R, **rn, cell="c1", trial="t2", pattern="0.5", calib=64,
                          status="FAILED", failure="CUDA OOM")
    ids["c2/t0"] = _trial(**R, **rn, cell="c2", trial="t0", pattern="0.5", calib=128, sel=0.75,
                          healed=0.70, pruned=0.10351)
    ids["c2/t1"] = _trial(**R, **rn, cell="c2", trial="t1", pattern="0.5", calib=128, sel=0.74,
                          healed=0.72, pruned=0.10351)
    # c3: tie on selection_acc -> the trial with fewer epochs wins (wall-clock heal_seconds does not count)
    ids["c3/t0"] = _trial(**R, **rn, cell="c3", trial="t0", pattern="0.8", calib=64, sel=0.5, epochs=5,
                          healed=0.45, pruned=0.02, heal_s=12.0)
    ids["c3/t1"] = _trial(**R, **rn, cell="c3", trial="t1", pattern="0.8", calib=64, sel=0.5, epochs=3,
                          healed=0.40, pruned=0.02, heal_s=30.0)
    ids["c4/t0"] = _trial(**R, **rn, cell="c4", trial="t0", pattern="2:4", calib=64, sel=0.6,
                          healed=0.62, pruned=0.3)
    ids["c4/t1"] = _trial(**R, **rn, cell="c4", trial="t1", pattern="2:4", calib=64, sel=0.65,
                          healed=0.61, pruned=0.3)
    ids["c5/t0"] = _trial(**R, **rn, cell="c5", trial="t0", pattern="0.8", calib=128,
                          status="FAILED", failure="timeout")
    dt = dict(model="deit_tiny", dense=DEIT_DENSE)
    for cell, pat, sels in (("d1", "0.5", (0.6, 0.65)), ("d2", "0.9", (0.2, 0.1))):
        for i, s in enumerate(sels):
            ids[f"{cell}/t{i}"] = _trial(**R, **dt, cell=cell, trial=f"t{i}", pattern=pat,
                                         calib=64, sel=s, healed=s - 0.05, pruned=0.05)
    ids["v1/t0"] = _trial(**R, model="vgg11", dense=0.7, cell="v1", trial="t0", pattern="0.5",
                          calib=64, status="FAILED", failure="boom")
    # another sweep in the same experiment: must be ignored
    other_parent = client.create_run(exp_id, tags={"sweep_id": OTHER, "healsweep.role": "sweep"},
                                     run_name="other").info.run_id
    _trial(client, exp_id, other_parent, OTHER, cell="c1", trial="t0", model="resnet18",
           pattern="0.5", calib=64, dense=RESNET_DENSE, sel=0.99, healed=0.99, pruned=0.1)
    return dict(uri=uri, root=root, ids=ids, exp_id=exp_id)


def test_load_trials_types_and_sweep_filter(store):
    df = load_trials(store["uri"], SWEEP)
    assert len(df) == 15  # the other sweep's trial and both parent runs are excluded
    assert set(df["run_id"]) == set(store["ids"].values())
    assert (df["status"] == "FAILED").sum() == 3
    for c in ("run_id", "status", "cell_id", "trial_id", "pattern", "model", "pruner", "scope",
              "healer", "granularity"):
        assert pd.api.types.is_string_dtype(df[c]), c
    for c in ("sparsity", "lr", "dense_acc", "healed_acc", "selection_acc", "heal_seconds",
              "retention", "achieved_sparsity", "mask_violations"):
        assert df[c].dtype == np.float64, c
    for c in ("calib_size", "epochs", "batch_size", "seed"):
        assert pd.api.types.is_integer_dtype(df[c]), c
    row = df.set_index("run_id").loc[store["ids"]["c1/t1"]]
    assert (row["pattern"], row["calib_size"], row["epochs"]) == ("0.5", 64, 7)
    assert row["lr"] == pytest.approx(3.16227766e-4)
    assert row["selection_acc"] == pytest.approx(0.72)  # final = last per-epoch value
    failed = df.set_index("run_id").loc[store["ids"]["c1/t2"]]
    assert np.isnan(failed["healed_acc"]) and failed["failure_reason"] == "CUDA OOM"


def test_load_trials_empty(store):
    for df in (load_trials(store["uri"], "no-such-sweep"),
               load_trials(store["uri"], SWEEP, experiment="nope")):
        assert df.empty and {"run_id", "cell_id", "healed_acc", "calib_size"} <= set(df.columns)
        assert best_per_cell(df).empty


def test_best_per_cell_tie_break_is_deterministic():
    # equal selection_acc and epochs: the lower Optuna trial number wins, compared as a number (2 < 10, though
    # "c-10" < "c-2" as text), whatever the row order or the run ids and wall-clock times
    rows = [dict(run_id=f"r{i}", status="FINISHED", cell_id="c", trial_id=f"c-{n}", optuna_trial=n,
                 selection_acc=0.9, epochs=4, heal_seconds=float(h))
            for i, (n, h) in enumerate([(10, 1.0), (2, 9.0), (3, 5.0)])]
    rows.append(dict(run_id="r9", status="FINISHED", cell_id="c", trial_id="c-0", optuna_trial=0,
                     selection_acc=0.9, epochs=6, heal_seconds=0.5))
    for order in ([0, 1, 2, 3], [3, 2, 1, 0], [1, 3, 0, 2]):
        df = pd.DataFrame([rows[i] for i in order]).astype({"epochs": "Int64", "optuna_trial": "Int64"})
        best = best_per_cell(df)
        assert list(best["trial_id"]) == ["c-2"] and int(best["n_trials"].iloc[0]) == 4


def test_best_per_cell_selects_on_selection_split(store):
    ids = store["ids"]
    best = best_per_cell(load_trials(store["uri"], SWEEP)).set_index("cell_id")
    assert set(best.index) == {"c1", "c2", "c3", "c4", "d1", "d2"}  # c5, v1: no finished run
    assert best.loc["c1", "run_id"] == ids["c1/t1"]  # not t0, which has the higher healed_acc
    assert best.loc["c2", "run_id"] == ids["c2/t0"]
    assert best.loc["c3", "run_id"] == ids["c3/t1"]  # tie -> fewer epochs, though slower
    assert best.loc["c4", "run_id"] == ids["c4/t1"]
    assert best.loc["d2", "run_id"] == ids["d2/t0"]
    assert (best.loc["c1", "n_trials"], best.loc["c1", "n_failed"]) == (3, 1)
    assert (best.loc["c2", "n_trials"], best.loc["c2", "n_failed"]) == (2, 0)
    assert best.loc["c1", "healed_acc"] == pytest.approx(0.64)


def _md_rows(md: str, model: str) -> list[str]:
    section = md.split(f"### {model}: grid `main`\n", 1)[1].split("\n## ", 1)[0].split("\n### ", 1)[0]
    return [ln for ln in section.splitlines() if ln.startswith("| ") and "---" not in ln][1:]


def test_markdown_tables(store, tmp_path):
    paths = write_report_from(store["uri"], SWEEP, tmp_path)
    md = paths["md"].read_text()
    rid = store["ids"]["c1/t1"]
    rows = _md_rows(md, "resnet18")
    # hand-formatted: achieved 0.49812, dense .80123, pruned .10351, healed .64, retention .7988
    assert rows[0] == (f"| magnitude | 0.5 | 0.498 | 64 | 80.12 | 10.35 | 64.00 | 0.799 | "
                       f"3.16e-04 | 7 | 3 (1 failed) | starfish | `{rid}` |")
    # order: numeric patterns ascending (then calib size), N:M last
    assert [r.split(" | ")[1] + "/" + r.split(" | ")[3] for r in rows] == \
        ["0.5/64", "0.5/128", "0.8/64", "2:4/64"]
    assert "c5 (1 run)." in md  # cell without a finished trial is named, with why (c1's failed trial is not c5's)
    assert md.count("Most common failure (1 of 1 failed trials): timeout.") == 2  # first screen and details
    assert len(_md_rows(md, "deit_tiny")) == 2
    assert "No finished trials for this model (1 run, none FINISHED). Most common failure (1 of 1 failed trials): " \
        "boom." in md.split("## vgg11", 1)[1]
    assert "Trials: 15 (12 finished, 3 failed)" in md
    assert "Cells: 8" in md
    assert f"# Sweep report: {SWEEP_NAME}" in md  # name from the parent run
    assert md.split("\n## resnet18\n", 1)[1].lstrip().startswith(f"_Weights sha256 {RESNET_DIGEST}._")
    assert "Weights sha256" not in md.split("\n## deit_tiny\n", 1)[1].split("\n## ", 1)[0]  # none logged: no line
    for model in ("resnet18", "deit_tiny"):
        assert f"](fig_{model}.png)" in md
        assert (tmp_path / f"fig_{model}.png").read_bytes().startswith(PNG_MAGIC)
    assert not (tmp_path / "fig_vgg11.png").exists()


def test_html_self_contained_with_figures(store, tmp_path):
    page = write_report_from(store["uri"], SWEEP, tmp_path)["html"].read_text()
    assert "demo &lt;sweep&gt; &amp; co" in page and SWEEP_NAME not in page
    assert not re.search(r"""(src|href)=["']?(https?:)?//""", page)  # nothing fetched remotely
    imgs = re.findall(r'<img src="data:image/png;base64,([A-Za-z0-9+/=]+)" alt="[^"]*top-1 vs sparsity"', page)
    assert len(imgs) == 2  # resnet18 and deit_tiny; vgg11 has no finished trials
    for b64, model in zip(imgs, ("deit_tiny", "resnet18")):  # sections in model-name order
        png = base64.b64decode(b64)
        assert png == (tmp_path / f"fig_{model}.png").read_bytes()
        pixels = mpimg.imread(io.BytesIO(png), format="png")
        assert pixels.ndim == 3 and pixels.shape[0] > 100 and pixels.shape[1] > 100
        assert len(np.unique(pixels.reshape(-1, pixels.shape[-1]), axis=0)) > 10
    assert f"<code>{store['ids']['c1/t1']}</code>" in page
    assert ">3 (1 failed)</td>" in page


def test_figure_series_colours_markers_and_layout(store):
    from analysis.layout import layout_of, problems

    best = best_per_cell(load_trials(store["uri"], SWEEP))
    rb = best[best["model"] == "resnet18"]
    fig = model_figure(rb, "resnet18", colors={"starfish": (1.0, 0.0, 0.0, 1.0)})
    ax = fig.axes[0]
    healed = {ln.get_label(): ln for ln in ax.get_lines() if not ln.get_label().startswith("_")}
    assert set(healed) == {"starfish n=64", "starfish n=128"}  # every (healer, calib size) series present
    assert list(healed["starfish n=64"].get_xdata()) == [0.5, 0.8]
    assert list(healed["starfish n=64"].get_ydata()) == pytest.approx([64.0, 40.0])  # best-by-selection values
    assert list(healed["starfish n=128"].get_ydata()) == pytest.approx([70.0])
    # colour = healer (one colour for both calib sizes), marker = calib size (one each)
    assert {ln.get_color() for ln in healed.values()} == {(1.0, 0.0, 0.0, 1.0)}
    assert healed["starfish n=64"].get_marker() != healed["starfish n=128"].get_marker()
    nm = [c for c in ax.collections if len(c.get_offsets())]
    assert np.asarray(nm[0].get_offsets()).ravel().tolist() == pytest.approx([0.5, 61.0])  # 2:4 at 1 - N/M
    lay = layout_of(fig)
    assert problems(lay) == [] and lay["axes_fraction"] > 0.35
    labels = lay["legends"][0]["labels"]
    assert labels == ["starfish", "calib 64 images", "calib 128 images", "pruned (before healing)",
                      "dense (80.12 %)", "N:M pattern (at 1 − N/M)"]
    assert not lay["legends"][0]["in_axes"]


def test_layout_problems_catch_a_squeezed_figure_with_a_clipped_legend():
    """The broken layout of the issue: axes squeezed into the bottom of a tall canvas, a long legend inside the
    axes running off the canvas. ``problems`` must name all three faults."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    from analysis.layout import layout_of, problems

    fig = Figure(figsize=(7.5, 4.8), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_axes((0.1, 0.08, 0.85, 0.2))
    for i in range(20):
        ax.plot([0, 1], [i, i + 1], label=f"series {i}")
    ax.legend(loc="upper left", bbox_to_anchor=(0, 3.5))
    text = " ".join(problems(layout_of(fig)))
    assert "axes cover" in text and "outside the canvas" in text and "inside an axes" in text


def test_write_report_via_sweep_json(store, tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "sweep.json").write_text(json.dumps(
        {"sweep_id": SWEEP, "name": "from-json", "tracking_uri": store["uri"],
         "experiment": "healsweep", "spec": {}}))
    paths = write_report(run_dir)
    assert paths == {"html": run_dir / "report.html", "md": run_dir / "report.md",
                     "bands": run_dir / "bands.json"}
    md = paths["md"].read_text()
    assert md.startswith("# Sweep report: from-json\n")
    assert f"`{store['ids']['c1/t1']}`" in md and store["uri"] in md
    assert (run_dir / "fig_resnet18.png").exists()


def test_run_links_only_for_http():
    assert run_url("http://mlflow:5000/", "3", "abc") == "http://mlflow:5000/#/experiments/3/runs/abc"
    assert run_url("sqlite:////x/mlflow.db", "3", "abc") is None


def test_partial_sweep_says_so_on_the_first_screen(tmp_path):
    """A sweep a signal interrupted (orchestrator/sweep/end.py mark_parent tags its parent run): the report's first
    lines, before the summary and the findings, say so with the counts and how to resume; a complete sweep
    (``partial=false``, as a resumed sweep that finished is tagged) has no such line."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(uri)
    exp_id = client.create_experiment("healsweep", artifact_location=(tmp_path / "art").as_uri())
    parent = client.create_run(exp_id, tags={"sweep_id": SWEEP, "healsweep.role": "sweep", "partial": "true",
                                             "trials_finished": "15", "trials_planned": "24",
                                             "interrupted_by": "SIGTERM"}, run_name="cut").info.run_id
    _trial(client, exp_id, parent, SWEEP, cell="c1", trial="t0", model="resnet18", pattern="0.5", calib=64,
           dense=RESNET_DENSE, sel=0.7, healed=0.66, pruned=0.1)
    out = tmp_path / "run"
    note = ("Partial sweep: interrupted by SIGTERM with 15 of 24 trials finished; the findings cover those trials "
            f"only. Resume with healsweep run --resume {out.resolve()}")
    paths = write_report_from(uri, SWEEP, out)
    md = paths["md"].read_text().splitlines()
    assert md[:4] == ["# Sweep report: cut", "", f"**{note}**", ""] and md[4].startswith("Sweep: cut · ")
    html = paths["html"].read_text()
    assert f'<p class="partial">{note}</p>' in html
    assert html.index("<h1>") < html.index('class="partial"') < html.index('class="sum"') < html.index("<details>")
    client.set_tag(parent, "partial", "false")
    paths = write_report_from(uri, SWEEP, out)
    assert "Partial sweep" not in paths["md"].read_text() and 'class="partial"' not in paths["html"].read_text()
    assert "Calibration draw" not in paths["md"].read_text()  # calib_seed 0 (no param): the data seed's order
    client.log_param(parent, "calib_seed", "3")  # orchestrator/sweep/parent.py logs it for every sweep
    md = write_report_from(uri, SWEEP, out)["md"].read_text().splitlines()
    assert md[2].startswith("Sweep: cut · ") and " · Cells: 1 · Calibration draw: calib_seed 3 · Tracking URI: " in md[2]


def test_a_sweep_with_no_finished_trial_says_so_where_the_findings_go(tmp_path):
    """Every trial failed: the Findings heading was followed by nothing but a how-to line about quoted numbers."""
    from analysis.findings_render import NO_FINDINGS

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(uri)
    exp_id = client.create_experiment("healsweep", artifact_location=(tmp_path / "art").as_uri())
    parent = client.create_run(exp_id, tags={"sweep_id": SWEEP, "healsweep.role": "sweep"},
                               run_name="none").info.run_id
    _trial(client, exp_id, parent, SWEEP, cell="c1", trial="t0", model="resnet18", pattern="0.5", calib=64,
           status="FAILED", failure="RuntimeError: boom")
    paths = write_report_from(uri, SWEEP, tmp_path / "run")
    md = paths["md"].read_text()
    assert f"## Findings\n\n{NO_FINDINGS}\n" in md and "Ranges are the repairability bands" not in md
    assert NO_FINDINGS in paths["html"].read_text()


def test_common_failure_counts_the_reasons_of_the_cells_asked():
    from analysis.findings import common_failure

    t = pd.DataFrame({"cell_id": ["a", "a", "b", "b", "c", "c"],
                      "failure_reason": ["X: bad", "Y: worse", "X: bad", None, "", "Z: other"]})
    retry = " raised an error, not divergence: healsweep run --resume DIR --retry-failed runs them again once its " \
        "cause is mended."
    assert common_failure(t, ["a", "b"]) == " Most common failure (2 of 3 failed trials): X: bad. 3 of them" + retry
    assert common_failure(t, ["c"]) == " Most common failure (1 of 1 failed trials): Z: other. 1 of them" + retry
    nan = pd.DataFrame({"cell_id": ["a", "a"], "failure_reason": ["HealingDiverged: nan at epoch 2", "OSError: x"]})
    assert common_failure(nan.iloc[:1]) == " Most common failure (1 of 1 failed trials): HealingDiverged: nan at epoch 2."
    assert common_failure(nan).endswith(". 1 of them" + retry)
    assert common_failure(t.iloc[3:5], None) == "" and common_failure(None) == ""


@pytest.mark.timeout(60)
def test_the_cell_table_names_the_runs_of_its_quoted_mean(tmp_path):
    """The "MLflow run" column named the search winner's run while "healed (%)" was the re-evaluations' mean; the
    re-evaluation runs were nowhere in the report (docs/usage.md: export any id of its run columns)."""
    from analysis.report import _html_table, _md_table, model_table
    from analysis.reported import reported

    def row(run, stage, acc, heal_seed=None):
        return dict(run_id=run, experiment_id="1", status="FINISHED", cell_id="c", trial_id=f"c-{run}", stage=stage,
                    model="m", pruner="magnitude", pattern="0.5", grid="main", healer="starfish", calib_size=64,
                    seed=0, heal_seed=heal_seed, lr=1e-3, epochs=2, optuna_trial=0, selection_acc=acc,
                    healed_acc=acc, dense_acc=0.99, pruned_acc=0.5, achieved_sparsity=0.5, scope="all",
                    granularity="token")
    best = reported(pd.DataFrame([row("a" * 32, "search", 0.9944), row("b" * 32, "reevaluate", 0.9972, 1000),
                                  row("c" * 32, "reevaluate", 0.9972, 2000)]))
    t = model_table(best)
    assert t.headers[-2:] == ["MLflow run", "runs of healed (%)"]
    md = _md_table(t, "sqlite:///x.db").splitlines()[-1]
    assert md.endswith(f"| 99.72 ± 0.00 (n=2) | 1.007 | 1.00e-03 | 2 | 1 | starfish | 99.44 | `{'a' * 32}` | "
                       f"`{'b' * 32}`, `{'c' * 32}` |")
    page = _html_table(t, "http://mlflow:5000")
    assert (f'<a href="http://mlflow:5000/#/experiments/1/runs/{"b" * 32}">{"b" * 32}</a><br>'
            f'<a href="http://mlflow:5000/#/experiments/1/runs/{"c" * 32}">{"c" * 32}</a></td></tr>') in page
    alone = model_table(reported(pd.DataFrame([row("a" * 32, "search", 0.9944)])))
    assert alone.headers[-1] == "MLflow run" and alone.links == [[["a" * 32]]]  # the number is the winner's own
