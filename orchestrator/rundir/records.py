"""A sweep's source of truth for finished trials: ``DIR/trials.jsonl``, append-only and checksummed.

One JSON object per line, each carrying ``crc32`` (8 hex digits) of its canonical JSON without that field. A
``trial`` line is written by the driver when a trial ends, after that trial's MLflow writes and before its Optuna
tell (orchestrator/tracking/recorder.py): the record is the commit point of a trial. It holds everything needed to rebuild
the trial's MLflow run (run name, tags, params, final metrics, per-epoch history, status, times) and its Optuna
trial (study, number, params with their distributions, user attributes, intermediate values, value, state). A
``parent`` line holds the sweep's MLflow parent run (name, params, tags), written once per session.

Each line is appended with one ``write`` and an ``fsync``; an append that fails (a full disk) is cut back to the
previous size. Reading tells three things apart: intact records, a torn last line (a write cut short: dropped,
its trial runs again on resume) and a damaged line before the last (reported by line number: ``healsweep doctor
DIR --repair`` rewrites the file without it). The same line scanner reads ``optuna.journal`` (JSON lines, no
checksum).
"""
from __future__ import annotations

import json
import os
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from tasks.atomic import DiskFullError, atomic_write_bytes, is_disk_full
from tasks.errors import first_line

TRIALS_FILE = "trials.jsonl"
TRIAL, PARENT = "trial", "parent"


def canonical(obj: dict) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":")).encode("utf-8")


def encode(rec: dict) -> bytes:
    """One record line: ``rec`` with its ``crc32``, newline-terminated."""
    body = {k: v for k, v in rec.items() if k != "crc32"}
    return canonical({**body, "crc32": f"{zlib.crc32(canonical(body)):08x}"}) + b"\n"


def check_record(line: bytes) -> dict:
    """The record of one line; ValueError saying why it is damaged."""
    obj = json.loads(line)
    if not isinstance(obj, dict) or not isinstance(obj.get("crc32"), str):
        raise ValueError("not a record (no crc32)")
    want = obj.pop("crc32")
    got = f"{zlib.crc32(canonical(obj)):08x}"
    if got != want:
        raise ValueError(f"checksum mismatch (crc32 {got}, recorded {want})")
    _check_shape(obj)
    return obj


# What a line of each kind must hold for the resume, doctor and a rebuild (orchestrator/tracking/recorder.py
# writes them): field -> type(s). A line with a good checksum but another shape is damaged all the same.
_OPTUNA = {"study": str, "study_attrs": dict, "direction": str, "number": int, "stage": str, "params": dict,
           "distributions": dict, "user_attrs": dict, "intermediate": dict, "state": str}
_MLFLOW = {"run_id": str, "status": str, "tags": dict, "params": dict, "metrics": dict, "history": dict,
           "step": int, "start_time": (int, type(None)), "end_time": (int, type(None))}
_STATES = ("COMPLETE", "FAIL", "PRUNED")


def _check_shape(obj: dict) -> None:
    kind = obj.get("kind")
    if kind == PARENT:
        _fields(obj, {"run_id": str, "tags": dict, "params": dict}, "parent line")
    elif kind == TRIAL:
        _fields(obj, {"trial_id": str, "cell_id": str, "optuna": dict}, "trial line")
        _fields(obj["optuna"], _OPTUNA, "trial line's optuna part")
        if obj["optuna"]["state"] not in _STATES:
            raise ValueError(f"a trial line with Optuna state {obj['optuna']['state']!r}")
        if obj.get("mlflow") is not None:
            _fields(obj["mlflow"], _MLFLOW, "trial line's mlflow part")
    else:
        raise ValueError(f"a line of unknown kind {kind!r}")


def _fields(obj, want: dict, what: str) -> None:
    if not isinstance(obj, dict):
        raise ValueError(f"a {what} that is not an object")
    for k, t in want.items():
        if not isinstance(obj.get(k), t) or isinstance(obj.get(k), bool) and t is int:
            raise ValueError(f"a {what} without a valid {k!r}")


def check_json(line: bytes) -> dict:
    """One journal line (a JSON object); ValueError when it is not one."""
    obj = json.loads(line)
    if not isinstance(obj, dict):
        raise ValueError(f"a JSON {type(obj).__name__}, not an object")
    return obj


@dataclass
class Scan:
    """What a line file holds: intact ``records`` (file order, with their line numbers), ``damaged`` lines before
    the last ((line number, why)), and ``torn``: the byte offset of a torn last line (None: the file ends cleanly)."""
    path: Path
    records: list[dict] = field(default_factory=list)
    lines: list[int] = field(default_factory=list)
    damaged: list[tuple[int, str]] = field(default_factory=list)
    torn: int | None = None
    torn_bytes: int = 0
    size: int = 0

    @property
    def clean(self) -> bool:
        return not self.damaged and self.torn is None


def scan(path: Path, check: Callable[[bytes], dict] = check_record) -> Scan:
    """Read ``path`` line by line (a missing file is an empty scan)."""
    out = Scan(Path(path))
    try:
        data = Path(path).read_bytes()
    except FileNotFoundError:
        return out
    out.size, pos = len(data), 0
    raw = data.split(b"\n")
    ends_clean = data.endswith(b"\n") or not data
    body = raw[:-1] if ends_clean else raw
    for i, line in enumerate(body, start=1):
        last = i == len(body)
        if not line.strip() and (ends_clean or not last):  # a blank line (an editor's trailing newline) holds no
            pos += len(line) + 1  # record and loses none: not a torn write
            continue
        try:
            if last and not ends_clean:
                raise ValueError("no newline at its end (a write cut short)")
            out.records.append(check(line))
            out.lines.append(i)
        except (ValueError, UnicodeDecodeError, RecursionError) as e:
            if last:
                out.torn, out.torn_bytes = pos, len(data) - pos
            else:
                out.damaged.append((i, _why(e)))
        pos += len(line) + 1
    return out


def _why(e: Exception) -> str:
    return first_line(e, 120)


def drop_torn(s: Scan) -> int:
    """Cut a torn last line off the file; -> bytes dropped."""
    if s.torn is None:
        return 0
    with open(s.path, "rb+") as f:
        f.truncate(s.torn)
        os.fsync(f.fileno())
    dropped, s.torn, s.torn_bytes = s.torn_bytes, None, 0
    return dropped


def rewrite(path: Path, records: list[dict], line: Callable[[dict], bytes] = encode) -> None:
    """Replace the file by ``records`` (atomic: a repair never leaves half a file)."""
    atomic_write_bytes(path, b"".join(line(r) for r in records), fsync=True)


def append(path: Path, rec: dict) -> None:
    """Append one record with a single write and an fsync. On failure the file is cut back to its previous size
    (no torn line is left for the next append to follow); a full disk is a DiskFullError naming the file."""
    path = Path(path)
    data = encode(rec)
    new = not path.exists()
    with open(path, "ab") as f:
        start = f.tell()
        try:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        except OSError as e:
            _cut(f, start)
            if is_disk_full(e):
                raise DiskFullError(path, len(data)) from e
            raise
    if new:
        _sync_dir(path.parent)


def _cut(f, size: int) -> None:
    try:
        f.truncate(size)
    except OSError:
        pass


def _sync_dir(d: Path) -> None:
    fd = os.open(d, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def trials(s: Scan) -> dict[str, dict]:
    """{trial id: its record} of a scan (a trial recorded twice - a rebuilt session - keeps its last record)."""
    return {r["trial_id"]: r for r in s.records if r.get("kind") == TRIAL and isinstance(r.get("trial_id"), str)}


def parent(s: Scan) -> dict | None:
    """The latest parent-run record, or None."""
    return next((r for r in reversed(s.records) if r.get("kind") == PARENT), None)
