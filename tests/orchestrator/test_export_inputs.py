"""``healsweep export`` given the wrong or a changed run directory, and a trial whose saved files are damaged: one
line naming what is wrong, never a card that mixes two runs, never a traceback (the export user's findings)."""
from __future__ import annotations

import json
import shutil

import pytest
from mlflow import MlflowClient

from tests.orchestrator.run_cli import healsweep
from tests.orchestrator.test_export import trial  # noqa: F401 - the module's real trial (fixture)


def _run(uri: str, sweep: str) -> str:
    client = MlflowClient(uri)
    exp = client.get_experiment_by_name("healsweep")
    exp_id = exp.experiment_id if exp else client.create_experiment("healsweep")
    run = client.create_run(exp_id, tags={"healsweep.role": "trial", "trial_id": "c0ffee-0", "sweep_id": sweep})
    client.set_terminated(run.info.run_id, "FINISHED")
    return run.info.run_id


def test_run_dir_of_another_sweep_and_a_moved_run_dir(tmp_path):
    """Two sweeps on one tracking store with the same trial ids: ``--run-dir`` of the other sweep exported the other
    sweep's weights under this run's card (rc 0). A moved run directory (sweep.json still names the old path): the
    export looked in the old database ("not found") until a report relocated it."""
    uri = f"sqlite:///{tmp_path / 'shared.db'}"
    for name, sweep in (("a", "s1"), ("b", "s2")):
        (tmp_path / "runs" / name / "trials").mkdir(parents=True)
        (tmp_path / "runs" / name / "sweep.json").write_text(json.dumps({"tracking_uri": uri, "sweep_id": sweep}))
    s1 = _run(uri, "s1")
    r = healsweep("export", s1, "--out", "x", "--run-dir", "runs/b", cwd=tmp_path)
    assert r.returncode == 2 and r.stderr.strip() == (
        f"healsweep: error: run '{s1}' is of sweep s1, but runs/b holds sweep s2: give that sweep's run directory, "
        "or leave out --run-dir"), r.stderr
    moved = tmp_path / "elsewhere" / "m"
    (moved / "trials").mkdir(parents=True)
    m = _run(f"sqlite:///{moved / 'mlflow.db'}", "s3")
    (moved / "sweep.json").write_text(json.dumps({"tracking_uri": f"sqlite:///{tmp_path / 'runs' / 'm' / 'mlflow.db'}",
                                                  "sweep_id": "s3"}))
    for where in (["--run-dir", str(moved)], ["--runs", str(moved.parent)]):
        r = healsweep("export", m, "--out", "x", *where, cwd=tmp_path)
        assert r.returncode == 2 and "c0ffee-0: no healed.safetensors" in r.stderr, (where, r.stderr)  # run found
    assert json.loads((moved / "sweep.json").read_text())["tracking_uri"].startswith(f"sqlite:///{tmp_path / 'runs'}")


def test_a_damaged_mask_or_trial_json_is_one_error(trial, tmp_path):  # noqa: F811
    """A mask file replaced or truncated in the store, or a trial.json without its final result, ended the export
    in StoreError's, safetensors' or a KeyError's traceback."""
    from tasks.export import load_trial
    from tasks.saved_trial import TRIAL_JSON

    root, _, _ = trial
    d = tmp_path / "run" / "trials" / "cell-0"
    shutil.copytree(root / "run" / "trials" / "cell-0", d)
    masks = tmp_path / "masks"
    shutil.copytree(root / "masks", masks)
    rec = json.loads((d / TRIAL_JSON).read_text())
    rec["params"]["mask_root"] = str(masks)
    (d / TRIAL_JSON).write_text(json.dumps(rec))
    f = masks / f"{'b' * 32}.safetensors"
    f.write_bytes(f.read_bytes()[:40])
    with pytest.raises(ValueError, match=f"cell-0: its mask {'b' * 32} in {masks} is damaged \\(.+\\); the next "
                                         "sweep that uses it computes it again"):
        load_trial(d)
    del rec["final"]
    (d / TRIAL_JSON).write_text(json.dumps(rec))
    with pytest.raises(ValueError, match=f"{TRIAL_JSON}: unreadable or incomplete \\(KeyError: 'final'\\)"):
        load_trial(d)


def test_an_export_that_runs_out_of_space_leaves_nothing(trial, tmp_path):  # noqa: F811
    """On a full disk the export wrote model.safetensors, then failed: --out held the model alone, and the retry
    was refused as "another run's export". All four files or none now. A real full file system: a tmpfs with room
    for the model but not its mask (root only; skipped where mounting is not allowed)."""
    import os
    import subprocess

    from tasks.atomic import DiskFullError
    from tasks.export import export_trial

    root, _, _ = trial
    d = root / "run" / "trials" / "cell-0"
    whole = export_trial(d, tmp_path / "whole")
    need = whole["model"].stat().st_size + whole["mask"].stat().st_size // 2
    mnt = tmp_path / "small"
    mnt.mkdir()
    size = -(-need // 4096) * 4096
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mnt)],
                                           capture_output=True).returncode:
        pytest.skip("cannot mount a small tmpfs here")
    try:
        with pytest.raises(DiskFullError):
            export_trial(d, mnt / "x")
        assert sorted(p.name for p in (mnt / "x").iterdir()) == []
    finally:
        subprocess.run(["umount", str(mnt)], capture_output=True)


def test_a_full_disk_during_an_export_says_to_run_the_export_again(tmp_path, capsys):
    """It said "continue with healsweep run --resume <--out>": an export's --out is no run directory."""
    import argparse

    from orchestrator.cli import fault_exit
    from tasks.atomic import DiskFullError

    args = argparse.Namespace(cmd="export", run_id="0" * 32, out=str(tmp_path / "x"))
    assert fault_exit(DiskFullError(tmp_path / "x" / "mask.safetensors"), args) == 1
    err = capsys.readouterr().err
    assert err.rstrip().endswith(f"free space there, then run healsweep export {'0' * 32} again") and "--resume" not in err


@pytest.mark.timeout(300)
def test_a_trial_id_for_a_run_id_is_mapped_or_explained(tmp_path):
    """A trial id given where a run id is expected was a plain "run ... not found". One in a single sweep is that
    trial's run; one in two sweeps, or in none, says so and where the run ids are."""
    uri = f"sqlite:///{tmp_path / 'shared.db'}"
    for name, sweep in (("a", "s1"), ("b", "s2")):
        (tmp_path / "runs" / name / "trials").mkdir(parents=True)
        (tmp_path / "runs" / name / "sweep.json").write_text(json.dumps({"tracking_uri": uri, "sweep_id": sweep}))
    s1, s2 = _run(uri, "s1"), _run(uri, "s2")  # both trials c0ffee-0
    r = healsweep("export", "c0ffee-0", "--out", "x", cwd=tmp_path)
    assert r.returncode == 2 and r.stderr.strip() == (
        f"healsweep: error: trial id 'c0ffee-0' names 2 runs (sweeps s1, s2): give its MLflow run id "
        f"({', '.join(sorted([s1, s2]))}) or --run-dir of its sweep"), r.stderr
    r = healsweep("export", "c0ffee-0", "--out", "x", "--run-dir", "runs/b", cwd=tmp_path)  # s2's: found, no weights
    assert r.returncode == 2 and (tmp_path / "runs" / "b" / "trials" / "c0ffee-0").name in r.stderr \
        and "no healed.safetensors" in r.stderr and str(tmp_path / "runs" / "b") in r.stderr, r.stderr
    r = healsweep("export", "c0ffee-7", "--out", "x", cwd=tmp_path)
    assert r.returncode == 2 and r.stderr.strip() == (
        "healsweep: error: 'c0ffee-7' looks like a trial id (<cell id>-<number>), not an MLflow run id (32 hex "
        "digits), and no trial run of that id is in the sweeps of the 2 run directories under runs/; the report's "
        "'MLflow run' and 'runs of healed (%)' columns give run ids"), r.stderr
    assert not (tmp_path / "x").exists()
