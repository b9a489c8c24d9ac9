"""Every `healsweep` command in the README's and the user docs' fenced blocks, run as the pages write them.

PAGES: README.md (the front door: its first fenced block is the quick start, exactly the two commands) and the
docs pages the README's commands moved to (docs/usage.md, docs/default-sweep.md, docs/scaling.md,
docs/models-and-data.md). Their blocks are read in that order, as one document.

- ```bash blocks: each line is run verbatim through bash (venv scripts first on PATH) in one fresh working
  directory, in page order, and must exit 0. The only substitution: RUN_ID, which the page tells the reader
  to take from the report's "MLflow run" column, is taken from there. The working directory holds a link to
  configs/ and the cached reference models in .healsweep/models (content-addressed: exactly what a first run
  would train, 70 s, so the test does not retrain them).
  Not run, with reason: `bash .ci/sweep` (the 9-minute default sweep; its code path is `healsweep run`, run here
  on configs/tiny.yaml), `bash .ci/test` (the test suite itself). The cluster commands (`ray up`, `ray exec`,
  `mlflow server`) are inline code, not fenced: they need a cluster and a database.
- ```text blocks (the command synopsis): every `--option` named for a command exists in that command's parser.
- plain ``` blocks with `$ healsweep ...` and the expected output: run, and the output must match the page
  (bad.yaml is configs/tiny.yaml with the sparsity the page's message names).
HEALSWEEP_README=PATH checks proposed README text before it is committed (the docs pages are read from the
repository).
"""
from __future__ import annotations

import argparse
import os
import re
import shlex
from pathlib import Path

import pytest
import yaml

from tests.orchestrator.run_cli import REPO, shell

README = Path(os.environ.get("HEALSWEEP_README", REPO / "README.md"))
DOCS = [REPO / "docs" / name for name in ("usage.md", "default-sweep.md", "scaling.md", "models-and-data.md")]
PAGES = [README, *DOCS]
QUICK_START = ["bash .ci/sweep", "bash .ci/test"]
NOT_RUN = {"bash .ci/sweep": "the 9-minute default sweep", "bash .ci/test": "the test suite itself"}


def fenced_blocks(text: str) -> list[tuple[str, list[str]]]:
    """-> [(language, lines)] of every ``` block."""
    return [(m.group(1), m.group(2).splitlines()) for m in re.finditer(r"^```(\w*)\n(.*?)^```", text, re.S | re.M)]


def _strip_comment(line: str) -> str:
    return re.sub(r"\s+#\s.*$", "", line).strip()


def pages_text() -> str:
    return "\n".join(p.read_text(encoding="utf-8") for p in PAGES)


def commands(lang: str) -> list[str]:
    """Command lines of the pages' blocks of one language (comments removed, continuation lines joined)."""
    out: list[str] = []
    for block_lang, lines in fenced_blocks(pages_text()):
        if block_lang != lang:
            continue
        for line in lines:
            cmd = _strip_comment(line)
            if cmd.startswith(("healsweep", "bash ")):
                out.append(cmd)
            elif cmd and line.startswith(" ") and out:  # a continuation of the previous synopsis line
                out[-1] += " " + cmd
    return out


def test_readme_starts_with_the_two_commands():
    text = README.read_text(encoding="utf-8")
    assert len(text.splitlines()) <= 250, "README.md is a front door: at most 250 lines (details go to docs/)"
    first_lang, first = fenced_blocks(text)[0]
    assert first_lang == "bash" and [_strip_comment(ln) for ln in first if ln.strip()] == QUICK_START
    assert text.index("```bash") < text.index("\n## ", text.index("## Quick start") + 1)


def test_readme_has_the_newcomer_commands():
    run = commands("bash")
    assert {c.split()[1] for c in run if c.startswith("healsweep")} >= {"validate", "run", "report", "refine",
                                                                        "store", "export"}
    assert set(NOT_RUN) <= {c for c in run if c.startswith("bash ")}
    assert commands("text"), "the command synopsis (```text block) is missing"


def test_synopsis_options_exist():
    from orchestrator.cli import build_parser

    top = build_parser()
    sub = next(a for a in top._actions if a.choices and "run" in a.choices).choices
    for line in commands("text"):
        words = line.split()
        parser = top if words[1].startswith("-") else sub[words[1]]
        opts = set(parser._option_string_actions)
        for a in parser._actions:  # store ACTION subcommands
            if isinstance(a, argparse._SubParsersAction) and parser is not top:
                for p in a.choices.values():
                    opts |= set(p._option_string_actions)
        for o in re.findall(r"--[a-z][a-z-]*", line):
            assert o in opts, f"README synopsis `{line}`: {o} is not an option of healsweep {words[1]}"


def test_documented_error_example(tmp_path):
    blocks = [ls for lang, ls in fenced_blocks(pages_text()) if not lang and ls
              and ls[0].startswith("$ healsweep")]
    assert blocks
    for lines in blocks:
        cmd, expected = lines[0][2:], [ln for ln in lines[1:] if ln.strip()]
        bad = yaml.safe_load((REPO / "configs" / "tiny.yaml").read_text())
        bad["sparsities"] = [0.5, 1.5]
        (tmp_path / "bad.yaml").write_text(yaml.safe_dump(bad))
        r = shell(cmd, cwd=tmp_path)
        assert r.returncode == 2 and r.stderr.splitlines() == expected, (cmd, r.stderr)


@pytest.mark.e2e
def test_readme_commands_run_verbatim(tmp_path):
    cache = Path(os.environ.get("HEALSWEEP_TEST_CACHE", REPO / ".healsweep" / "models")).resolve()
    (tmp_path / "configs").symlink_to(REPO / "configs")
    (tmp_path / ".healsweep").mkdir()
    (tmp_path / ".healsweep" / "models").symlink_to(cache)
    ran = []
    for cmd in commands("bash"):
        if cmd in NOT_RUN:
            continue
        if "RUN_ID" in cmd:  # the page: any id in the report's "MLflow run" column
            report = next((tmp_path / "runs").glob("*/report.md")).read_text()
            ids = re.findall(r"\| `([0-9a-f]{32})` \|", report)
            assert ids, "no MLflow run column in the report"
            cmd = cmd.replace("RUN_ID", shlex.quote(ids[0]))
        r = shell(cmd, cwd=tmp_path, timeout=900)
        assert r.returncode == 0, f"documented command `{cmd}` exited {r.returncode}:\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}"
        ran.append(cmd)
    assert len(ran) >= 6
