"""The bundle file: one ``tar.xz`` holding ``manifest.json``, the installer ``install.py`` and the wheels.

The manifest names every wheel with its sha256 and size, the target (Python, platform tags, the marker
environment the walk used), the digest of the freeze the missing set was computed against, and which present
packages were an assumption (a name listed without a version)."""
from __future__ import annotations

import io
import json
import lzma
import tarfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping, Sequence

from tasks.atomic import sha256_file

FORMAT = 1
TOP = "healsweep-offline"  # the archive's one top-level directory
INSTALLER = Path(__file__).with_name("install.py")  # stdlib only: runs on the target with no index


@dataclass(frozen=True)
class Target:
    python: str  # "3.12"
    platforms: tuple[str, ...]  # wheel platform tags accepted, newest first
    environment: Mapping[str, str]  # PEP 508 marker environment used for the walk


@dataclass(frozen=True)
class Present:
    """What the target was said to hold: ``versions`` from a freeze (name -> version or None when assumed)."""
    source: str  # file name(s) or "--present"
    sha256: str  # of the freeze/list text as given
    versions: Mapping[str, str | None]


@dataclass
class Manifest:
    target: Target
    present: Present
    wheels: list[dict] = field(default_factory=list)
    roots: Sequence[str] = ()
    check_imports: Sequence[str] = ()
    satisfied: Mapping[str, str] = field(default_factory=dict)
    upgrades: Mapping[str, tuple[str, str]] = field(default_factory=dict)

    def to_json(self) -> str:
        assumed = sorted(n for n, v in self.present.versions.items() if v is None)
        doc = {"format": FORMAT, "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
               "target": {"python": self.target.python, "implementation": "cp",
                          "platforms": list(self.target.platforms), "environment": dict(self.target.environment)},
               "present": {"source": self.present.source, "sha256": self.present.sha256,
                           "entries": len(self.present.versions),
                           "assumed_any_version": assumed,
                           "note": "a name listed without a version was ASSUMED to satisfy every specifier"},
               "satisfied_by_target": dict(sorted(self.satisfied.items())),
               "upgrades": {n: {"target": a, "bundled": b} for n, (a, b) in sorted(self.upgrades.items())},
               "roots": list(self.roots), "check_imports": list(self.check_imports),
               "wheels": self.wheels}
        return json.dumps(doc, indent=1) + "\n"


def wheel_entry(path: Path, name: str, version: str, requires: Sequence[str]) -> dict:
    return {"file": path.name, "name": name, "version": version, "sha256": sha256_file(path),
            "size": path.stat().st_size, "requires": list(requires)}


def write_archive(out: Path, manifest: Manifest, wheels: Sequence[Path], preset: int, log) -> int:
    """Write ``out`` (tar.xz at xz ``preset``, 9 = 9 extreme) and ``install.py`` next to it; returns its size."""
    xz_preset = preset | lzma.PRESET_EXTREME if preset == 9 else preset
    tmp = out.with_name(out.name + ".partial")
    total = sum(p.stat().st_size for p in wheels)
    log(f"pack {len(wheels)} wheels ({total / 1e6:.1f} MB stored) into {out.name} (xz preset {preset}"
        f"{' extreme' if preset == 9 else ''}; about a minute per 100 MB at preset 9)")
    with tarfile.open(tmp, "w:xz", preset=xz_preset) as tar:
        _add_bytes(tar, f"{TOP}/manifest.json", manifest.to_json().encode())
        _add_bytes(tar, f"{TOP}/install.py", INSTALLER.read_bytes(), mode=0o755)
        for p in sorted(wheels, key=lambda p: p.name.lower()):
            info = tar.gettarinfo(str(p), arcname=f"{TOP}/wheels/{p.name}")
            info.uid = info.gid = 0
            info.uname = info.gname = ""
            with p.open("rb") as f:
                tar.addfile(info, f)
    tmp.replace(out)
    (out.parent / "install.py").write_bytes(INSTALLER.read_bytes())
    return out.stat().st_size


def _add_bytes(tar: tarfile.TarFile, name: str, data: bytes, mode: int = 0o644) -> None:
    info = tarfile.TarInfo(name)
    info.size, info.mode, info.mtime = len(data), mode, int(time.time())
    tar.addfile(info, io.BytesIO(data))
