"""The offline bundle's bar: a clean virtual environment with no index installs from the bundle and runs the tiny
sweep.

The "target" is a fresh venv of this Python that already holds what a CUDA image holds (torch, torchvision, timm,
numpy, pandas, pyarrow, scipy, scikit-learn, matplotlib, ... with everything they need): those packages are this
test environment's own, shown to the venv through a .pth file pointing at a directory of links to exactly them.
Its freeze goes to `healsweep bundle` (pip download from PyPI, as in CI: the only network use), `install.py` installs
the bundle with pip's index pointed at a dead address, and `healsweep run configs/tiny.yaml` runs in the venv.
"""
from __future__ import annotations

import importlib.metadata as md
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

REPO = Path(__file__).resolve().parents[2]
# What the CUDA image held, plus healsweep's other heavy core dependencies a CUDA image usually has.
IMAGE = ("torch", "torchvision", "timm", "numpy", "pandas", "pyarrow", "scipy", "scikit-learn", "matplotlib",
         "safetensors", "pyyaml", "tqdm", "protobuf", "grpcio", "packaging", "requests")


def _pypi_reachable() -> bool:
    try:
        socket.create_connection(("pypi.org", 443), timeout=5).close()
        return True
    except OSError:
        return False


def image_closure(names) -> list[md.Distribution]:
    """The installed distributions ``names`` and everything they require here (markers of this machine)."""
    found: dict[str, md.Distribution] = {}
    todo = list(names)
    while todo:
        name = canonicalize_name(todo.pop())
        if name in found:
            continue
        try:
            dist = md.distribution(name)
        except md.PackageNotFoundError:
            continue
        found[name] = dist
        for line in dist.requires or ():
            req = Requirement(line)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(req.name)
    return list(found.values())


def link_view(dists, view: Path) -> str:
    """Links in ``view`` to each distribution's top-level files; returns their freeze (name==version lines)."""
    view.mkdir()
    for dist in dists:
        base = Path(dist.locate_file(""))
        tops = {Path(str(f)).parts[0] for f in dist.files or () if not str(f).startswith("..")}
        for top in sorted(tops):
            src, dst = base / top, view / top
            if src.exists() and not dst.exists() and not top.endswith(".pth") and top != "__pycache__":
                dst.symlink_to(src)
    return "".join(f"{canonicalize_name(d.metadata['Name'])}=={d.version}\n" for d in dists)


def _run(cmd, **kw) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, capture_output=True, text=True, **kw)
    assert proc.returncode == 0, f"{cmd[:4]} exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


def _glibc_platform() -> str:
    libc = os.confstr("CS_GNU_LIBC_VERSION") or "glibc 2.17"
    return f"manylinux_2_{min(int(libc.split()[1].split('.')[1]), 28)}_{os.uname().machine}"


def build_bundle_for(freeze: Path, out: Path, env: dict) -> tuple[Path, dict, str]:
    """`healsweep bundle` for this Python and machine against ``freeze``: (archive, manifest, size line)."""
    strip = "unneeded" if shutil.which("strip") else "none"
    build = _run([sys.executable, "-m", "orchestrator.cli", "bundle", "--python", f"{sys.version_info[0]}.{sys.version_info[1]}",
                  "--freeze", str(freeze), "--platform", _glibc_platform(), "--out", str(out), "--xz-preset", "1",
                  "--max-mb", "200", "--strip", strip], cwd=REPO, env={**env, "PYTHONPATH": str(REPO)})
    size = re.search(r"bundle: \S+ ([\d.]+) MB \((\d+) wheels", build.stdout)
    archive = out / "healsweep-offline.tar.xz"
    with tarfile.open(archive) as tar:
        manifest = json.load(tar.extractfile("healsweep-offline/manifest.json"))
    return archive, manifest, f"{size.group(1)} MB at xz preset 1, {size.group(2)} wheels"


def clean_venv(where: Path, image: Path) -> tuple[Path, Path]:
    """A fresh venv that sees the image's packages through a .pth file: (its python, its site-packages)."""
    _run([sys.executable, "-m", "venv", str(where)])
    py = where / "bin" / "python"
    site = Path(_run([py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]).stdout.strip())
    (site / "image.pth").write_text(str(image) + "\n")
    return py, site


@pytest.mark.skipif(not _pypi_reachable(), reason="needs PyPI to fetch the bundle's wheels (CI has it)")
def test_clean_venv_installs_the_bundle_with_no_index_and_runs_the_tiny_sweep(tmp_path):
    t0 = time.monotonic()
    (tmp_path / "freeze.txt").write_text(link_view(image_closure(IMAGE), tmp_path / "image"))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    archive, manifest, size = build_bundle_for(tmp_path / "freeze.txt", tmp_path / "bundle", env)
    bundled = {w["name"] for w in manifest["wheels"]}
    assert {"healsweep", "ray", "optuna", "mlflow-skinny", "sqlalchemy", "alembic"} <= bundled
    assert not bundled & {"torch", "numpy", "pandas", "mlflow", "datasets", "flask"}  # present, or not needed
    t1 = time.monotonic()
    py, site = clean_venv(tmp_path / "venv", tmp_path / "image")
    offline = {**env, "PIP_INDEX_URL": "http://127.0.0.1:9/simple", "PIP_FIND_LINKS": "", "PIP_NO_INDEX": "1"}
    inst = _run([py, str(archive.parent / "install.py"), str(archive)], env=offline, cwd=tmp_path)
    assert "install.py: ok:" in inst.stdout
    where = _run([py, "-c", "import ray, optuna, mlflow, orchestrator; print(ray.__file__, orchestrator.__file__)"],
                 cwd=tmp_path, env=offline).stdout.split()
    assert all(w.startswith(str(site)) for w in where), where  # the bundle's copies, not this environment's
    absent = "import importlib.util as u, sys; sys.exit(any(u.find_spec(m) for m in ('flask', 'datasets')))"
    _run([py, "-c", absent], cwd=tmp_path)  # the sweep runs without full MLflow's server and without datasets
    t2 = time.monotonic()
    run = subprocess.run([py.parent / "healsweep", "run", str(REPO / "configs" / "tiny.yaml"), "--out",
                          str(tmp_path / "run"), "--num-cpus", "2", "--quiet"], cwd=tmp_path, env=offline,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "8 trials finished, 0 failed" in run.stdout and (tmp_path / "run" / "report.html").is_file()
    count = _run([py, "-c", _COUNT_TRIALS, run.stdout.split("mlflow: ")[1].split()[0]], cwd=tmp_path, env=offline)
    assert count.stdout.split() == ["8", "FINISHED"]  # read back through the bundle's mlflow-skinny
    print(f"bundle {size}; build {t1 - t0:.0f} s, venv + install {t2 - t1:.0f} s, tiny sweep {time.monotonic() - t2:.0f} s")


_COUNT_TRIALS = """
import sys
from mlflow import MlflowClient
c = MlflowClient(sys.argv[1])
runs = c.search_runs([c.get_experiment_by_name("healsweep").experiment_id], "tags.`healsweep.role` = 'trial'")
print(len(runs), *sorted({r.info.status for r in runs}))
"""
