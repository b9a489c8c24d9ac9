"""Healed weights that a trial could not leave in the run directory.

On a cluster whose nodes share only the store URI (docs/scaling.md "One storage URI"), a trial on a node that does
not see the driver's run directory puts its two saved files (tasks/saved_trial.py) under
``<store.uri>/healed/<sweep id>/<trial id>/`` instead of on its own disk, then ``pair.json`` (both files' sha256):
two attempts of one trial (a node presumed dead that still runs) cannot leave a mixed pair unnoticed.
``healsweep export`` fetches them into the run directory. Keys are plain one-component names (``TRIAL_KEY_RE``):
nothing escapes the root. No pickle: safetensors and JSON, checked (sums, ``healed_problem``) before use.
"""
from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import pyarrow.fs as pafs

from tasks.atomic import sha256_file
from tasks.saved_trial import HEALED, TRIAL_JSON, TRIAL_KEY_RE, healed_problem
from tasks.store.fs import StoreFS

FILES = (HEALED, TRIAL_JSON)
PAIR = "pair.json"  # {file name: sha256}, written last: what ``has`` looks for


def _key(kind: str, key: str) -> str:
    if not isinstance(key, str) or not TRIAL_KEY_RE.match(key) or ".." in key:
        raise ValueError(f"{kind} {str(key)[:80]!r}: not a plain key (matching {TRIAL_KEY_RE.pattern})")
    return key


class HealedStore:
    """``<root>/<sweep id>/<trial id>/{healed.safetensors,trial.json,pair.json}``; ``root`` a local directory or a
    ``pyarrow.fs`` URI (``s3://bucket/store/healed?endpoint_override=...``). Reading creates nothing."""

    def __init__(self, root: str) -> None:
        self.fs = StoreFS(root, create=False)

    def _rel(self, sweep_id: str, trial_id: str, name: str = "") -> str:
        rel = f"{_key('sweep id', sweep_id)}/{_key('trial id', trial_id)}"
        return f"{rel}/{name}" if name else rel

    def put(self, sweep_id: str, trial_id: str, src: Path) -> None:
        """Copy ``src``'s two saved files there (streamed, each object written whole or not at all), then their
        sums."""
        self.fs.mkdir(self._rel(sweep_id, trial_id))
        for name in FILES:
            pafs.copy_files(str(Path(src) / name), self.fs.path(self._rel(sweep_id, trial_id, name)),
                            source_filesystem=pafs.LocalFileSystem(), destination_filesystem=self.fs.fs)
        sums = {n: sha256_file(Path(src) / n) for n in FILES}
        self.fs.write_atomic(self._rel(sweep_id, trial_id, PAIR), json.dumps(sums, sort_keys=True).encode())

    def has(self, sweep_id: str, trial_id: str) -> bool:
        return self.fs.size(self._rel(sweep_id, trial_id, PAIR)) is not None

    def fetch(self, sweep_id: str, trial_id: str, dest: Path, accept=None) -> str | None:
        """Copy both files into ``dest`` (through a temporary directory beside it, renamed once checked); -> None
        when ``dest`` then holds the pair, else why not (not in the store; a damaged or mixed copy, or one that
        ``accept(dir)`` refuses with a reason: nothing of it reaches ``dest``)."""
        raw = self.fs.read_bytes(self._rel(sweep_id, trial_id, PAIR))
        if raw is None:
            return f"not in {self.fs.uri}"
        dest = Path(dest)
        dest.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(prefix=".fetch-", dir=dest.parent) as tmp:
            for name in FILES:
                pafs.copy_files(self.fs.path(self._rel(sweep_id, trial_id, name)), str(Path(tmp) / name),
                                source_filesystem=self.fs.fs, destination_filesystem=pafs.LocalFileSystem())
            if why := _check(Path(tmp), raw):
                return f"the copy in {self.fs.uri} is damaged: {why}"
            if accept is not None and (why := accept(Path(tmp))):
                return why
            dest.mkdir(exist_ok=True)
            for name in FILES:
                os.replace(Path(tmp) / name, dest / name)
        return None


def _check(d: Path, raw: bytes) -> str | None:
    """Why the files in ``d`` are not the pair ``raw`` (pair.json) names, or None."""
    try:
        sums = json.loads(raw)
    except (ValueError, RecursionError):
        return f"{PAIR} unreadable"
    if why := healed_problem(d):
        return why
    off = [n for n in FILES if not isinstance(sums, dict) or sums.get(n) != sha256_file(d / n)]
    return f"{', '.join(off)} not the file(s) {PAIR} names (two attempts of the trial wrote them)" if off else None
