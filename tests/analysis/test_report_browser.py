"""The report renders in a real browser: headless Chromium loads report.html (no network), every figure
decodes (naturalWidth > 0), and the screenshot is not blank. Skipped where Chromium is not installed
(Debian: ``apt-get install -y chromium``)."""
from __future__ import annotations

import json
import re
import shutil
import subprocess

import matplotlib.image as mpimg
import numpy as np
import pytest

from analysis import write_report
from tests import transition_fixture as tf

CHROMIUM = next((p for p in (shutil.which("chromium"), shutil.which("chromium-browser"),
                             shutil.which("google-chrome")) if p), None)
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="headless Chromium not installed "
                                "(apt-get install -y chromium); browser check skipped")
FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--hide-scrollbars", "--virtual-time-budget=5000")
PROBE = ("<script>window.addEventListener('load',function(){var r=[];document.querySelectorAll('img')"
         ".forEach(function(i){r.push([i.naturalWidth,i.naturalHeight,i.complete])});"
         "document.body.setAttribute('data-probe',JSON.stringify(r));});</script>")


def _chromium(tmp_path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([CHROMIUM, *FLAGS, f"--user-data-dir={tmp_path / 'profile'}", *args],
                          capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    root = tmp_path_factory.mktemp("browser")
    sweep = tf.build_store(root)
    run_dir = root / "run"
    tf.write_sweep_json(run_dir, sweep["uri"])
    return write_report(run_dir)["html"]


def test_figures_decode_in_chromium(report, tmp_path):
    page = report.read_text()
    n_img = page.count("<img ")
    assert n_img == 6  # top-1 vs sparsity, paired healers, four transition figures
    probe = tmp_path / "probe.html"  # a copy with a load-time probe; the report itself has no script
    probe.write_text(page.replace("</body>", PROBE + "</body>"))
    out = _chromium(tmp_path, "--dump-dom", probe.as_uri())
    assert out.returncode == 0, out.stderr[-2000:]
    m = re.search(r'data-probe="([^"]*)"', out.stdout)
    assert m, "probe did not run: " + out.stdout[:500]
    sizes = json.loads(m.group(1).replace("&quot;", '"'))
    assert len(sizes) == n_img
    assert all(w > 100 and h > 100 and done for w, h, done in sizes), sizes


def test_screenshot_not_blank(report, tmp_path):
    shot = tmp_path / "shot.png"
    out = _chromium(tmp_path, f"--screenshot={shot}", "--window-size=1280,4000", report.as_uri())
    assert out.returncode == 0 and shot.is_file(), out.stderr[-2000:]
    px = mpimg.imread(str(shot))  # (H, W, C) floats in [0, 1]
    assert px.shape[0] == 4000 and px.shape[1] == 1280
    rgb = px[..., :3]
    assert rgb.std() > 0.05  # a blank page has std ~0
    assert len(np.unique((rgb.reshape(-1, 3) * 255).astype(np.uint8), axis=0)) > 200  # figures, not just text


FIRST_SCREEN = ("<script>window.addEventListener('load',function(){var r=[];"
                "document.querySelectorAll('#findings table.ranges tbody tr, #findings table.best tbody tr, "
                "#findings p.headline').forEach(function(t){var b=t.getBoundingClientRect();"
                "r.push([t.closest('table')?t.closest('table').className:t.className,"
                "t.innerText,b.bottom,b.right])});document.body.setAttribute('data-probe',JSON.stringify(r));});"
                "</script>")


def test_first_screen_names_ranges_and_best_method(report, tmp_path):
    """In a 1400x900 window, without scrolling: every pruner x healer row of the findings (recoverable,
    transition, collapse) and the best method at the lowest and highest sparsity are visible."""
    probe = tmp_path / "first.html"
    probe.write_text(report.read_text().replace("</body>", FIRST_SCREEN + "</body>"))
    out = _chromium(tmp_path, "--window-size=1400,900", "--dump-dom", probe.as_uri())
    assert out.returncode == 0, out.stderr[-2000:]
    rows = json.loads(re.search(r'data-probe="([^"]*)"', out.stdout).group(1).replace("&quot;", '"'))
    ranges = [r for r in rows if r[0] == "ranges"]
    best = [r for r in rows if r[0] == "best"]
    # fixture: magnitude x {none, starfish}; starfish recovers to 70 %, transition 80-90 %, collapses at 95 %
    assert [r[1].split("\t")[:6] for r in ranges] == [
        ["magnitude", "none", "64", "50 % (lowest tested)", "70 %", "from 80 %"],
        ["magnitude", "starfish", "64", "up to 70 %", "80–90 %", "from 95 %"]]
    assert len(best) == 5 and best[0][1].startswith("0.5\tmagnitude × starfish 88.00 %")
    assert all(b <= 900 and right <= 1400 for _, _, b, right in ranges + [best[0], best[-1]]), rows
    (head,) = [r for r in rows if r[0] == "headline"]  # the best method at every sparsity, above the tables
    assert head[1].startswith("Best: 0.5: magnitude × starfish 88.0 %") and head[2] <= 900
    assert head[2] <= min(b for _, _, b, _ in ranges)


def test_every_png_passes_the_layout_check(report):
    from analysis.layout import problems

    pngs = sorted(report.parent.glob("fig_*.png"))
    assert len(pngs) == 6
    for png in pngs:
        lay = json.loads((png.parent / (png.name + ".json")).read_text())
        assert problems(lay) == [], (png.name, problems(lay))
        shot = mpimg.imread(str(png))  # the sidecar describes this PNG
        assert shot.shape[:2] == (round(lay["height"]), round(lay["width"]))
