"""healsweep report DIR --readme FILE: marked blocks of a README or a docs page (docs/default-sweep.md) are
rewritten from the fixture sweep's report (the real console script in a subprocess); text outside the markers is
kept; an unknown block exits 2 and writes nothing."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from tests import transition_fixture as tf

CLI = [str(Path(sys.executable).parent / "healsweep")]


def _run(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=300, env=env)


def test_readme_blocks_from_the_report(tmp_path):
    sweep = tf.build_store(tmp_path)
    run_dir = tmp_path / "run"
    tf.write_sweep_json(run_dir, sweep["uri"])
    readme = tmp_path / "repo" / "README.md"
    readme.parent.mkdir()
    readme.write_text("# Title\nkept\n<!-- report:findings -->\nstale 96.67\n<!-- /report:findings -->\nmiddle\n"
                      "<!-- report:fig_resnet_digits -->old<!-- /report:fig_resnet_digits -->\nend\n")
    out = _run("report", str(run_dir), "--readme", str(readme))
    assert out.returncode == 0, out.stderr[-2000:]
    text = readme.read_text()
    assert text.startswith("# Title\nkept\n<!-- report:findings -->\nRanges are the repairability bands")
    assert "\n### resnet_digits — grid `main`\n" in text
    # what is quoted, as this sweep ran it: the fixture re-evaluates no winner (the text said it re-healed them)
    assert "quoted healed accuracy (each cell's best search trial: search.reevaluate 0, no re-healing)" in text
    assert "stale 96.67" not in text and "\nmiddle\n" in text and text.endswith("end\n")
    assert "| magnitude | starfish | 64 | up to 70 % | 80–90 % | from 95 % |" in text
    assert "<!-- report:fig_resnet_digits -->\n![fig_resnet_digits](docs/fig_resnet_digits.png)\n" in text
    assert (readme.parent / "docs" / "fig_resnet_digits.png").read_bytes() == \
        (run_dir / "fig_resnet_digits.png").read_bytes()
    # a block the report does not have: one-line error, exit 2, README unchanged
    readme.write_text(text + "<!-- report:nope --><!-- /report:nope -->\n")
    before = readme.read_text()
    bad = _run("report", str(run_dir), "--readme", str(readme))
    assert bad.returncode == 2 and "report:nope" in bad.stderr and readme.read_text() == before
    # a block whose closing marker was lost: one line naming it, README unchanged (was: exit 0, block left stale)
    readme.write_text(text.replace("<!-- /report:findings -->", ""))
    before = readme.read_text()
    bad = _run("report", str(run_dir), "--readme", str(readme))
    assert bad.returncode == 2 and readme.read_text() == before
    assert bad.stderr.strip().splitlines()[-1] == (f"healsweep: error: {readme}: <!-- report:findings --> (line 3) "
                                                   "has no <!-- /report:findings --> after it")
    mtime = (run_dir / "report.html").stat().st_mtime_ns
    for missing, why in ((tmp_path / "none.md", "no such file"), (tmp_path, "a directory, not a file")):
        bad = _run("report", str(run_dir), "--readme", str(missing))
        assert bad.returncode == 2 and bad.stderr.strip() == f"healsweep: error: --readme {missing}: {why}", bad.stderr
    assert (run_dir / "report.html").stat().st_mtime_ns == mtime  # refused before the report was rewritten


def test_unpaired_markers_are_named_with_their_line():
    from analysis.readme import unpaired

    assert unpaired("a\n<!-- report:x -->b<!-- /report:x -->\n<!-- report:y -->\n<!-- /report:y -->") is None
    assert unpaired("a\n\n<!-- /report:x -->\n") == "<!-- /report:x --> (line 3) has no <!-- report:x --> before it"
    assert unpaired("<!-- report:x -->\n<!-- /report:y -->") == \
        "<!-- report:x --> (line 1) has no <!-- /report:x --> after it"
    # markers shown as code document the syntax (docs/usage.md, docs/layout.md): not markers
    assert unpaired("write `<!-- report:NAME -->` blocks\n```\n<!-- /report:x -->\n```\n") is None
    for page in ("usage.md", "layout.md", "default-sweep.md"):
        assert unpaired((Path(__file__).resolve().parents[2] / "docs" / page).read_text()) is None, page
    # a block is the nearest closing marker of its name: the second opener is the unpaired one
    assert unpaired("<!-- report:x -->1<!-- /report:x -->\n<!-- report:x -->") == \
        "<!-- report:x --> (line 2) has no <!-- /report:x --> after it"


def test_default_sweep_page_from_the_report(tmp_path):
    """The command the default sweep's page names: `healsweep report runs/default --readme docs/default-sweep.md`
    rewrites the page's findings block in place and copies its figures beside it (docs/, linked as fig_x.png)."""
    repo = Path(__file__).resolve().parents[2]
    page_text = (repo / "docs" / "default-sweep.md").read_text()
    assert "`healsweep report runs/default --readme docs/default-sweep.md`" in page_text
    sweep = tf.build_store(tmp_path)
    run_dir = tmp_path / "run"
    tf.write_sweep_json(run_dir, sweep["uri"])
    # the fixture sweep has one model (resnet_digits, grid main): keep the page's blocks it can fill
    page_text = re.sub(r"<!-- report:fig_vit_digits_healers -->.*?<!-- /report:fig_vit_digits_healers -->\n", "",
                       page_text, flags=re.S)
    page = tmp_path / "checkout" / "docs" / "default-sweep.md"
    page.parent.mkdir(parents=True)
    page.write_text(page_text)
    out = _run("report", str(run_dir), "--readme", str(page))
    assert out.returncode == 0, out.stderr[-2000:]
    text = page.read_text()
    head = page_text[:page_text.index("<!-- report:findings -->")]
    assert text.startswith(head + "<!-- report:findings -->\nRanges are the repairability bands")
    assert "| magnitude | starfish | 64 | up to 70 % | 80–90 % | from 95 % |" in text
    assert "### vit_digits" not in text  # the page's old findings are gone: the fixture has no ViT
    assert "<!-- report:fig_resnet_digits -->\n![fig_resnet_digits](fig_resnet_digits.png)\n" in text
    assert (page.parent / "fig_resnet_digits.png").read_bytes() == (run_dir / "fig_resnet_digits.png").read_bytes()
    assert not (page.parent / "docs").exists()
