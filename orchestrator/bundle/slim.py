"""Slimmer wheels that pip still accepts.

- ELF binaries stripped: ``strip --strip-unneeded`` by default (debug sections and the static symbol table go; the
  dynamic symbols every loader and exported-name backtrace needs stay); ``--strip-debug`` keeps the static symbols
  too, for C++ crash backtraces that name internal functions.
- Files nobody on a sweep machine needs dropped: Ray's Java jars, the Ray dashboard's built web client.
- Every member stored uncompressed: the bundle's xz compresses the whole set far better than each wheel's deflate.
- RECORD rewritten with each file's new sha256 and size (pip refuses a wheel whose RECORD does not match).
"""
from __future__ import annotations

import base64
import hashlib
import shutil
import subprocess
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from orchestrator.bundle.resolve import BundleError

# (wheel name, member prefix): dropped. Ray's jars serve Java workers; the dashboard's web client is served only by
# ray[default]'s dashboard, which a sweep does not start.
DROP = (("ray", "ray/jars/"), ("ray", "ray/dashboard/client/build/"))
_SIGNATURES = ("RECORD.jws", "RECORD.p7s")


@dataclass(frozen=True)
class SlimReport:
    before: int  # bytes of the wheel file as fetched
    after: int  # bytes of the rewritten (stored, uncompressed) wheel
    stripped: int  # ELF members whose debug sections were removed
    saved_by_strip: int  # uncompressed bytes removed by strip
    dropped: int  # members dropped
    saved_by_drop: int  # uncompressed bytes dropped


def strip_tool() -> str:
    """Path of binutils' ``strip``; a one-line error naming the package when it is missing."""
    path = shutil.which("strip")
    if path is None:
        raise BundleError("`strip` not found: install binutils (apt-get install binutils), or pass --strip none")
    return path


def record_line(name: str, data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{name},sha256={digest},{len(data)}"


STRIP_MODES = ("unneeded", "debug", "none")


def slim_wheel(src: Path, dest: Path, dist_name: str, strip: tuple[str, str] | None) -> SlimReport:
    """Rewrite wheel ``src`` into ``dest`` (same file name): ELF binaries stripped when ``strip`` is (the tool's path,
    mode: unneeded or debug), ``DROP`` members of ``dist_name`` removed, members stored uncompressed, RECORD regenerated."""
    drop = tuple(prefix for name, prefix in DROP if name == dist_name)
    counts = {"stripped": 0, "saved_by_strip": 0, "dropped": 0, "saved_by_drop": 0}
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dest, "w", zipfile.ZIP_STORED) as zout:
        record_name = _record_name(zin, src)
        records = []
        for info in zin.infolist():
            name = info.filename
            if name == record_name or name.endswith(_SIGNATURES) or info.is_dir():
                continue
            if name.startswith(drop):
                counts["dropped"] += 1
                counts["saved_by_drop"] += info.file_size
                continue
            data = zin.read(info)
            if strip and data[:4] == b"\x7fELF":
                slim = strip_elf(data, strip)
                if len(slim) < len(data):
                    counts["stripped"] += 1
                    counts["saved_by_strip"] += len(data) - len(slim)
                    data = slim
            zout.writestr(_stored(info), data)
            records.append(record_line(name, data))
        records.append(f"{record_name},,")
        zout.writestr(zipfile.ZipInfo(record_name, date_time=(1980, 1, 1, 0, 0, 0)), "\n".join(records) + "\n")
    return SlimReport(before=src.stat().st_size, after=dest.stat().st_size, **counts)


def _record_name(z: zipfile.ZipFile, src: Path) -> str:
    names = [n for n in z.namelist() if n.count("/") == 1 and n.endswith(".dist-info/RECORD")]
    if len(names) != 1:
        raise BundleError(f"{src.name}: not a wheel (no single *.dist-info/RECORD)")
    return names[0]


def _stored(info: zipfile.ZipInfo) -> zipfile.ZipInfo:
    out = zipfile.ZipInfo(info.filename, date_time=info.date_time)
    out.external_attr = info.external_attr  # keeps executable bits (Ray's gcs_server, raylet)
    out.compress_type = zipfile.ZIP_STORED
    return out


def strip_elf(data: bytes, strip: tuple[str, str]) -> bytes:
    """``data`` (an ELF file) stripped (``strip = (tool, mode)``); unchanged when strip cannot handle it."""
    with tempfile.TemporaryDirectory(prefix="healsweep-strip-") as tmp:
        path = Path(tmp) / "elf"
        path.write_bytes(data)
        proc = subprocess.run([strip[0], f"--strip-{strip[1]}", str(path)], capture_output=True)
        return path.read_bytes() if proc.returncode == 0 else data
