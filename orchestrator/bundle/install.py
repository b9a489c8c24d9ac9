#!/usr/bin/env python3
"""Install a healsweep offline bundle with no package index: standard library only, run by the TARGET's Python.

    python3 install.py healsweep-offline.tar.xz                   # into the running Python's environment (a venv)
    python3 install.py healsweep-offline.tar.xz --target /tmp/site  # into a directory; then PYTHONPATH=/tmp/site
    python3 install.py healsweep-offline.tar.xz --user             # into the user site

Steps: extract to a temporary directory; check every wheel's sha256 against the manifest and that this Python and
platform (version, glibc) are the bundle's target; ``python -m pip install --no-index --no-deps`` the wheels; import
what a sweep needs (the manifest's check_imports) and run ``pip check``. One line per problem; exit code 0 when
installed and every check passed, 1 when a check failed after installing, 2 when nothing was installed.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

_LEGACY_GLIBC = {"manylinux1": (2, 5), "manylinux2010": (2, 12), "manylinux2014": (2, 17)}


def extract(bundle: Path, dest: Path) -> Path:
    """Unpack ``bundle`` into ``dest``; the directory holding manifest.json."""
    with tarfile.open(bundle, "r:*") as tar:
        if hasattr(tarfile, "data_filter"):
            tar.extractall(dest, filter="data")
        else:  # Python < 3.10.12: refuse members that leave dest
            for m in tar.getmembers():
                if m.name.startswith("/") or ".." in Path(m.name).parts or not (m.isfile() or m.isdir()):
                    raise ValueError(f"unsafe member {m.name!r}")
            tar.extractall(dest)
    found = sorted(dest.glob("*/manifest.json")) or sorted(dest.glob("manifest.json"))
    if not found:
        raise ValueError("no manifest.json in the bundle")
    return found[0].parent


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def verify_wheels(root: Path, manifest: dict) -> list[str]:
    """One line per wheel that is missing or whose sha256 differs from the manifest's."""
    problems = []
    for w in manifest["wheels"]:
        path = root / "wheels" / w["file"]
        if not path.is_file():
            problems.append(f"missing wheel {w['file']}")
        elif sha256(path) != w["sha256"]:
            problems.append(f"sha256 mismatch: {w['file']} (corrupt or altered bundle)")
    return problems


def min_glibc(filename: str) -> tuple[int, int] | None:
    """The oldest glibc a wheel file runs on (its most permissive manylinux tag); None for a pure wheel."""
    versions = []
    for tag in filename[:-4].split("-")[-1].split("."):
        m = re.match(r"manylinux_(\d+)_(\d+)_", tag)
        if m:
            versions.append((int(m.group(1)), int(m.group(2))))
        elif tag.split("_")[0] in _LEGACY_GLIBC:
            versions.append(_LEGACY_GLIBC[tag.split("_")[0]])
    return min(versions) if versions else None


def check_interpreter(manifest: dict) -> list[str]:
    """One line per way this Python or machine differs from the bundle's target."""
    target = manifest["target"]
    have = f"{sys.version_info[0]}.{sys.version_info[1]}"
    problems = []
    if have != target["python"]:
        problems.append(f"this is Python {have} ({sys.executable}); the bundle is for Python {target['python']}: "
                        f"run install.py with a Python {target['python']}")
    if sys.implementation.name != "cpython":
        problems.append(f"this is {sys.implementation.name}; the bundle holds CPython wheels")
    machine, env = os.uname().machine, target["environment"]
    if sys.platform != env["sys_platform"] or machine != env["platform_machine"]:
        problems.append(f"this machine is {sys.platform} {machine}; the bundle is for {env['sys_platform']} "
                        f"{env['platform_machine']}")
    need = max((g for g in (min_glibc(w["file"]) for w in manifest["wheels"]) if g), default=None)
    libc = os.confstr("CS_GNU_LIBC_VERSION") if hasattr(os, "confstr") else None
    if need and libc and libc.startswith("glibc "):
        got = tuple(int(x) for x in libc.split()[1].split(".")[:2])
        if got < need:
            problems.append(f"this machine has {libc}; the bundle's wheels need glibc {need[0]}.{need[1]} or newer")
    return problems


def pip_install(root: Path, manifest: dict, target: Path | None, user: bool) -> list[str]:
    """Install every wheel with pip and no index; one line per failure (pip's last error line)."""
    wheels = [str(root / "wheels" / w["file"]) for w in manifest["wheels"]]
    cmd = [sys.executable, "-m", "pip", "install", "--no-index", "--no-deps", "--disable-pip-version-check",
           "--no-warn-script-location"]
    if target is not None:
        cmd += ["--target", str(target), "--upgrade"]  # --upgrade: a rerun replaces what an earlier one put there
    elif user:
        cmd += ["--user"]
    print(f"install.py: pip install --no-index --no-deps {len(wheels)} wheels"
          f"{f' --target {target}' if target else ' --user' if user else f' into {sys.prefix}'}", flush=True)
    proc = subprocess.run([*cmd, *wheels], capture_output=True, text=True)
    if proc.returncode != 0:
        err = [ln for ln in (proc.stderr + proc.stdout).splitlines() if ln.strip()]
        return [f"pip install failed: {err[-1] if err else proc.returncode}"]
    return []


def _env(target: Path | None) -> dict:
    env = dict(os.environ)
    if target is not None:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(target), env.get("PYTHONPATH", "")) if p)
    return env


_IMPORT_PROBE = """
import importlib, sys
for name in sys.argv[1:]:
    try:
        importlib.import_module(name)
    except Exception as e:
        print(f"cannot import {name}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
"""


def check_imports(manifest: dict, target: Path | None) -> list[str]:
    """One line per module of the manifest's check_imports that does not import (from a neutral directory, so a
    checkout in the working directory does not stand in for the installed packages)."""
    names = manifest.get("check_imports", [])
    if not names:
        return []
    with tempfile.TemporaryDirectory(prefix="healsweep-probe-") as cwd:
        proc = subprocess.run([sys.executable, "-c", _IMPORT_PROBE, *names], capture_output=True, text=True,
                              env=_env(target), cwd=cwd)
    lines = [ln for ln in proc.stdout.splitlines() if ln.strip()]
    if proc.returncode != 0 and not lines:
        lines = [f"import check crashed: {(proc.stderr.strip().splitlines() or ['exit ' + str(proc.returncode)])[-1]}"]
    return lines


def _canon(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def pip_check(manifest: dict, target: Path | None) -> tuple[list[str], list[str]]:
    """``pip check`` on the environment as a sweep will see it: (problems that involve a bundled package, other
    lines, which were there before: the image's own)."""
    proc = subprocess.run([sys.executable, "-m", "pip", "check", "--disable-pip-version-check"], capture_output=True,
                          text=True, env=_env(target))
    bundled = {_canon(w["name"]) for w in manifest["wheels"]}
    problems, others = [], []
    for line in proc.stdout.splitlines():
        words = {_canon(w.strip(",.;:")) for w in line.split()}
        if "no broken requirements" in line.lower() or not line.strip():
            continue
        (problems if words & bundled else others).append(f"pip check: {line.strip()}")
    return problems, others


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="install.py", description=__doc__.split("\n\n", 1)[0] + " (see the module "
                                "docstring for the steps)", formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("bundle", type=Path, help="the bundle file, e.g. healsweep-offline.tar.xz")
    where = p.add_mutually_exclusive_group()
    where.add_argument("--target", type=Path, help="install into this directory (use it as PYTHONPATH=DIR)")
    where.add_argument("--user", action="store_true", help="install into the user site (pip install --user)")
    p.add_argument("--ignore-target-mismatch", action="store_true",
                   help="install although this Python/platform is not the bundle's target (pip will likely refuse)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if not args.bundle.is_file():
        print(f"install.py: error: no bundle file {args.bundle}", file=sys.stderr)
        return 2
    target = args.target.resolve() if args.target else None
    with tempfile.TemporaryDirectory(prefix="healsweep-offline-") as tmp:
        try:
            root = extract(args.bundle, Path(tmp))
            manifest = json.loads((root / "manifest.json").read_text())
        except (OSError, ValueError, tarfile.TarError, KeyError) as e:
            print(f"install.py: error: cannot read bundle {args.bundle}: {e}", file=sys.stderr)
            return 2
        print(f"install.py: {args.bundle.name}: {len(manifest['wheels'])} wheels for CPython "
              f"{manifest['target']['python']} ({manifest['present']['source']})", flush=True)
        blocking = verify_wheels(root, manifest)
        mismatch = check_interpreter(manifest)
        blocking += [] if args.ignore_target_mismatch else mismatch
        blocking = blocking or pip_install(root, manifest, target, args.user)
        if blocking:
            for line in blocking:
                print(f"install.py: error: {line}", file=sys.stderr)
            return 2
    return _after_install(manifest, target)


def _after_install(manifest: dict, target: Path | None) -> int:
    problems = check_imports(manifest, target)
    pip_problems, others = pip_check(manifest, target)
    for line in others:
        print(f"install.py: note (not from the bundle): {line}")
    for line in problems + pip_problems:
        print(f"install.py: problem: {line}", file=sys.stderr)
    if problems or pip_problems:
        return 1
    where = f"PYTHONPATH={target} " if target else ""
    print(f"install.py: ok: {len(manifest['wheels'])} wheels installed; imports {', '.join(manifest['check_imports'])} "
          f"work. Run: {where}{sys.executable} -m orchestrator.cli --help")
    return 0


if __name__ == "__main__":
    sys.exit(main())
