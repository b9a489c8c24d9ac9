"""A newcomer's commands through the real console script: every --help explains itself, --version, and
`healsweep export RUN_ID --out DIR` as docs/usage.md writes it, on a real (small) sweep, with a model card whose
plain timm code reproduces the logged healed accuracy."""
from __future__ import annotations

import argparse
import json
import os
import re
import stat
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

import pytest
import yaml

from tests.orchestrator.run_cli import REPO, healsweep

PROJECT = ("tasks", "orchestrator", "analysis")


def _parsers(p: argparse.ArgumentParser, path=("healsweep",)):
    yield path, p
    for a in p._actions:
        if isinstance(a, argparse._SubParsersAction):
            for name, sp in a.choices.items():
                yield from _parsers(sp, (*path, name))


def test_every_command_and_argument_has_a_description():
    from orchestrator.cli import build_parser

    seen = []
    for path, p in _parsers(build_parser()):
        seen.append(" ".join(path))
        assert p.description and len(p.description) > 40, f"{' '.join(path)}: no description"
        for a in p._actions:
            if not isinstance(a, (argparse._HelpAction, argparse._SubParsersAction)):
                assert a.help, f"{' '.join(path)} {a.option_strings or a.dest}: no help"
    assert {"healsweep validate", "healsweep report", "healsweep export", "healsweep refine",
            "healsweep store verify"} <= set(seen)


def _synopsis() -> dict[str, str]:
    """docs/usage.md's "Every command and option" block: command ('healsweep store') -> its lines' text."""
    text = (REPO / "docs" / "usage.md").read_text().split("## Every command and option", 1)[1]
    block, out, cmd = text.split("```text\n", 1)[1].split("```", 1)[0], {}, ""
    for line in block.splitlines():
        if line.startswith("healsweep "):
            cmd = " ".join(line.split()[:2])
        out[cmd] = out.get(cmd, "") + " " + line.split("  # ")[0]
    return out


def test_the_usage_page_names_every_command_and_option():
    """Every subcommand, and every option of it (its long form), is in docs/usage.md's synopsis on that command's
    lines: an option added to a parser and not to the page fails here (the page once missed six)."""
    from orchestrator.cli import build_parser

    synopsis = _synopsis()
    for path, p in _parsers(build_parser()):
        if len(path) < 2:
            continue
        cmd = " ".join(path[:2])
        assert cmd in synopsis, f"{cmd}: not in docs/usage.md's synopsis"
        if len(path) > 2:
            assert re.search(rf"\b{path[2]}\b", synopsis[cmd]), f"{' '.join(path)}: not in docs/usage.md"
        for a in p._actions:
            if a.option_strings and not isinstance(a, argparse._HelpAction):
                flag = max(a.option_strings, key=len)
                assert re.search(rf"{re.escape(flag)}\b", synopsis[cmd]), f"{cmd} {flag}: not in docs/usage.md"


def test_output_into_a_closed_pipe_ends_quietly(tmp_path):
    """`healsweep store ls | head -1`: a reader that leaves early ends the command with the shell's 141 (128 +
    SIGPIPE) and nothing on stderr (it was a BrokenPipeError traceback). The pipe is closed before the command
    writes, as `| true` does."""
    from tests.orchestrator.run_cli import HEALSWEEP, env

    (tmp_path / "store").mkdir()
    for cmd in (["store", "ls", "--store", str(tmp_path / "store")], ["validate", str(REPO / "configs" / "tiny.yaml")]):
        p = subprocess.Popen([str(HEALSWEEP), *cmd], cwd=tmp_path, env=env(), stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
        p.stdout.close()
        err = p.stderr.read()
        assert p.wait(timeout=120) == 141 and err == "", (cmd, err)


def test_help_and_version_through_the_console_script():
    r = healsweep("validate", "--help")
    assert r.returncode == 0 and "Nothing is trained or logged" in r.stdout
    assert re.search(r"SPEC\s+sweep spec \(YAML\)", r.stdout)
    r = healsweep("report", "--help")
    assert r.returncode == 0 and "from MLflow alone" in r.stdout and re.search(r"DIR\s+run directory", r.stdout)
    r = healsweep("--version")
    assert r.returncode == 0 and r.stdout.strip() == f"healsweep {version('healsweep')}"


SMALL = {"name": "small", "models": ["vit_digits", "resnet_digits"], "sparsities": [0.5], "calib_sizes": [64],
         "pruners": ["magnitude"], "healers": ["starfish"],
         "search": {"trials_per_cell": 1, "lr": [2.0e-3, 2.0e-3], "epochs": [1, 1]}}


@pytest.fixture(scope="module")
def small_sweep(tmp_path_factory):
    """A real two-trial sweep run by the console script in a fresh working directory -> (cwd, run dir)."""
    cwd = tmp_path_factory.mktemp("newcomer")
    (cwd / "small.yaml").write_text(yaml.safe_dump(SMALL))
    cache = os.environ.get("HEALSWEEP_TEST_CACHE", str(REPO / ".healsweep" / "models"))
    r = healsweep("run", "small.yaml", "--cache", cache, "--num-cpus", "2", "--quiet", "--no-report", cwd=cwd)
    assert r.returncode == 0, r.stdout + r.stderr
    return cwd, cwd / "runs" / "small"


def _trial_runs(run_dir: Path) -> dict:
    from mlflow import MlflowClient

    meta = json.loads((run_dir / "sweep.json").read_text())
    client = MlflowClient(meta["tracking_uri"])
    exp = client.get_experiment_by_name("healsweep")
    runs = client.search_runs([exp.experiment_id], "tags.`healsweep.role` = 'trial'")
    return {r.data.params["model"]: r for r in runs}


@pytest.mark.e2e
@pytest.mark.parametrize("model", ["vit_digits", "resnet_digits"])
def test_export_as_the_readme_writes_it_reproduces_the_logged_accuracy(small_sweep, model):
    cwd, run_dir = small_sweep
    run = _trial_runs(run_dir)[model]
    out = cwd / f"exported-{model}"
    r = healsweep("export", run.info.run_id, "--out", out.name, cwd=cwd)  # no --run-dir: found under runs/
    assert r.returncode == 0, r.stderr
    files = sorted(p.name for p in out.iterdir())
    assert files == ["mask.safetensors", "model.safetensors", "model_card.json", "model_card.md"]
    assert {stat.S_IMODE(p.stat().st_mode) for p in out.iterdir()} == {0o644}
    card = json.loads((out / "model_card.json").read_text())
    assert card["mlflow_run_id"] == run.info.run_id and card["metrics"] == run.data.metrics
    assert card["evaluation"]["digest"] == run.data.params["eval_digest"] and len(card["evaluation"]["indices"]) == 360
    md = (out / "model_card.md").read_text()
    code = re.search(r"```python\n(.*?)```", md, re.S).group(1)
    assert "_build" not in code and not re.search(r"^\s*(from|import) (tasks|orchestrator|analysis)\b", code, re.M)
    # the card's code, run on its own in the export directory, without this checkout on the path
    probe = (f"exec(open('card.py').read()); import json, sys; print(json.dumps({{'acc': accuracy, 'project': "
             f"sorted(m for m in sys.modules if m.split('.')[0] in {PROJECT!r})}}))")
    (out / "card.py").write_text(code)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    p = subprocess.run([sys.executable, "-c", probe], cwd=out, env=env, capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0, p.stderr
    res = json.loads(p.stdout.strip().splitlines()[-1])
    assert res["project"] == []  # plain timm / scikit-learn code: no healsweep module was imported
    assert res["acc"] == pytest.approx(run.data.metrics["healed_acc"], abs=1e-6)  # the logged healed accuracy
    from safetensors.torch import load_file

    sd, mask = load_file(str(out / "model.safetensors")), load_file(str(out / "mask.safetensors"))
    assert all(not sd[k][m == 0].any() for k, m in mask.items())  # the healed model keeps the mask
    kept = sum(int(m.sum()) for m in mask.values()) / sum(m.numel() for m in mask.values())
    assert kept == pytest.approx(0.5, abs=0.01) and card["achieved_sparsity"] == pytest.approx(1 - kept)


@pytest.mark.e2e
def test_export_without_run_dir_explains_where_it_looked(small_sweep, tmp_path):
    cwd, _ = small_sweep
    r = healsweep("export", "f" * 32, "--out", tmp_path / "x", cwd=cwd)
    assert r.returncode == 2 and r.stderr.strip() == (f"healsweep: error: run '{'f' * 32}' not found in the 1 run "
                                                      "directory under runs/; give --run-dir DIR (or --runs DIR)")
