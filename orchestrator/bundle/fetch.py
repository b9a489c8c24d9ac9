"""Wheels for the target: ``pip download --no-deps --only-binary=:all:`` for its Python and platform tags, each
wheel's METADATA read back, and healsweep's own wheel built from this checkout."""
from __future__ import annotations

import email.parser
import importlib.util
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import Callable, Sequence

from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name, parse_wheel_filename
from packaging.version import Version

from orchestrator.bundle.resolve import BundleError, Dist

Log = Callable[[str], None]


def manylinux_platforms(platform: str) -> list[str]:
    """``manylinux_2_28_x86_64`` -> every manylinux tag a glibc-2.28 machine accepts, newest first (pip does not
    expand PEP 600 tags itself): manylinux_2_28 ... manylinux_2_5 and the legacy aliases 2014, 2010, 1."""
    m = re.fullmatch(r"manylinux_2_(\d+)_(\w+)", platform)
    if not m:
        return [platform]
    glibc, arch = int(m.group(1)), m.group(2)
    tags = [f"manylinux_2_{n}_{arch}" for n in range(glibc, 4, -1)]
    legacy = {17: "manylinux2014", 12: "manylinux2010", 5: "manylinux1"}
    for n, alias in legacy.items():
        if n <= glibc and (alias == "manylinux2014" or arch in ("x86_64", "i686")):  # 2010 and 1: Intel only
            tags.insert(tags.index(f"manylinux_2_{n}_{arch}") + 1, f"{alias}_{arch}")
    return tags


def read_wheel(path: Path) -> Dist:
    """The Dist of wheel file ``path``: name and version from its METADATA, its Requires-Dist lines."""
    try:
        with zipfile.ZipFile(path) as z:
            meta = [n for n in z.namelist() if n.count("/") == 1 and n.endswith(".dist-info/METADATA")]
            if len(meta) != 1:
                raise BundleError(f"{path.name}: not a wheel (no single *.dist-info/METADATA)")
            msg = email.parser.Parser().parsestr(z.read(meta[0]).decode("utf-8"), headersonly=True)
    except (zipfile.BadZipFile, UnicodeDecodeError) as e:
        raise BundleError(f"{path.name}: not a wheel ({type(e).__name__})") from None
    return Dist(canonicalize_name(msg["Name"]), Version(msg["Version"]), tuple(msg.get_all("Requires-Dist") or ()), path)


def pip_fetcher(dest: Path, python: str, platforms: Sequence[str], index_args: Sequence[str], log: Log):
    """A ``Fetch`` that runs ``pip download`` for the target into ``dest`` and reads the wheel it saved."""
    dest.mkdir(parents=True, exist_ok=True)
    base = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--disable-pip-version-check",
            "--python-version", python, "--implementation", "cp", "--dest", str(dest), *index_args]
    for tag in platforms:
        base += ["--platform", tag]

    def fetch(name: str, spec: SpecifierSet) -> Dist:
        log(f"  fetch {name}{spec or ''}")
        proc = subprocess.run([*base, f"{name}{spec}"], capture_output=True, text=True)
        if proc.returncode != 0:
            err = [ln for ln in proc.stderr.splitlines() if ln.strip()]
            raise BundleError(f"pip download {name}{spec} for Python {python} failed: {err[-1] if err else proc.returncode}")
        path = _saved_wheel(proc.stdout, dest, name, spec)
        dist = read_wheel(path)
        log(f"    {path.name} ({path.stat().st_size / 1e6:.1f} MB)")
        return dist

    return fetch


def _saved_wheel(stdout: str, dest: Path, name: str, spec: SpecifierSet) -> Path:
    """The wheel pip just saved (or found already downloaded) for ``name``: from its output, else the newest
    matching wheel in ``dest``."""
    for line in stdout.splitlines():
        m = re.match(r"\s*(?:Saved|File was already downloaded)\s+(\S+\.whl)\s*$", line)
        if m:
            path = Path(m.group(1))
            path = path if path.is_absolute() else Path.cwd() / path
            if canonicalize_name(parse_wheel_filename(path.name)[0]) == name:
                return path
    found = [(parse_wheel_filename(p.name)[1], p) for p in dest.glob("*.whl")
             if parse_wheel_filename(p.name)[0] == name and spec.contains(parse_wheel_filename(p.name)[1], True)]
    if not found:
        raise BundleError(f"pip download {name}{spec} saved no wheel in {dest}")
    return max(found)[1]


_SOURCES = ("pyproject.toml", "README.md", "orchestrator", "tasks", "analysis")


def build_own_wheel(repo: Path, dest: Path, log: Log) -> Path:
    """healsweep's wheel built from the checkout at ``repo`` (a copy of its sources, so the checkout gets no build/
    or egg-info litter), into ``dest``."""
    if not (repo / "pyproject.toml").is_file():
        raise BundleError(f"{repo}: no pyproject.toml; `healsweep bundle` builds healsweep's wheel from a source checkout")
    dest.mkdir(parents=True, exist_ok=True)
    log(f"build healsweep wheel from {repo}")
    with tempfile.TemporaryDirectory(prefix="healsweep-src-") as tmp:
        for name in _SOURCES:
            src = repo / name
            if src.is_dir():
                shutil.copytree(src, Path(tmp) / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
            elif src.is_file():
                shutil.copy2(src, Path(tmp) / name)
        # with setuptools here, no build environment is fetched from an index
        isolation = ["--no-build-isolation"] if importlib.util.find_spec("setuptools") else []
        cmd = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--disable-pip-version-check", "-q", *isolation,
               "-w", str(dest), tmp]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            err = [ln for ln in proc.stderr.splitlines() if ln.strip()]
            raise BundleError(f"building healsweep's wheel failed: {err[-1] if err else proc.returncode}")
    wheels = sorted(dest.glob("healsweep-*.whl"), key=lambda p: p.stat().st_mtime)
    if not wheels:
        raise BundleError(f"building healsweep's wheel left no healsweep-*.whl in {dest}")
    return wheels[-1]
