"""``healsweep store gc`` with a remote store: what sweeps leave in the bucket beside the targets, per sweep.

- ``tune/<name>-<sweep id>-s<session>/``: Ray Tune's storage on a cluster (its epoch checkpoints are dropped after
  each fit; a driver that crashed leaves them, and the experiment state stays);
- ``healed/<sweep id>/``: the healed weights of trials that ran on nodes without the run directory
  (tasks/store/healed.py; ``healsweep export`` fetches them from there).

``--older-than DAYS``: Tune's storage last written more than DAYS ago. ``--keep-referenced RUN_DIR``: Tune's storage
of every sweep those run directories are not (their sweep.json), and with ``--healed`` their healed weights too,
unless written in the last hour (a sweep of another run directory, or another user's on a shared bucket, may be
running there). Healed weights are results, not a cache: never deleted by age or without the flag.
A directory that names no sweep is left alone.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from pathlib import Path

from orchestrator.commands.common import CliError
from orchestrator.raytune.cluster import is_remote, store_subdir
from tasks.errors import first_line

SWEEP_ID = re.compile(r"^[0-9a-f]{12}$")
SESSION = re.compile(r"-([0-9a-f]{12})-s\d+$")  # a sweep's Tune experiment: <name>-<sweep id>-s<session>
RECENT = timedelta(hours=1)  # --keep-referenced keeps Tune storage written since: a sweep may be running there


@dataclass(frozen=True)
class Rule:
    keep: frozenset | None  # --keep-referenced: the runs' sweep ids; None: by age
    cutoff: datetime  # only what was last written before it: by age, DAYS ago; by reference, RECENT ago
    healed: bool  # --healed


@dataclass
class SweepDir:
    fs: object  # its pyarrow file system
    path: str
    name: str
    sweep_id: str | None  # None: no sweep's (left alone)
    files: int
    size: int  # bytes
    newest: datetime | None  # its newest file's mtime (UTC); None: no file


def bucket_rule(targets: str, args) -> Rule | None:
    """The rule for the bucket beside the target store ``targets`` (None: a local store, which has neither);
    CliError for a --keep-referenced run without a readable sweep.json, before anything is deleted."""
    if not is_remote(targets):
        return None
    now = datetime.now(timezone.utc)
    if args.keep_referenced:
        return Rule(frozenset(referenced_sweeps(args.keep_referenced)), now - RECENT, bool(args.healed))
    return Rule(None, now - timedelta(days=args.older_than), False)


def gc_bucket(targets: str, rule: Rule, dry_run: bool) -> None:
    """Collect tune/ and healed/ beside ``targets`` by ``rule`` (module docstring): a line per directory and a
    summary per kind."""
    for kind in ("tune", "healed"):
        dirs = [d for d in sweep_dirs(store_subdir(targets, kind), kind) if d.sweep_id is not None]
        if kind == "healed" and not rule.healed:
            if dirs:
                print(f"healed: kept the weights of {len(dirs)} sweep(s) (results, not a cache: --keep-referenced "
                      "RUN_DIR --healed deletes those of every sweep the runs are not)")
            continue
        mine = [d for d in dirs if rule.keep is None or d.sweep_id not in rule.keep]  # by age, or not referenced
        drop = [d for d in mine if d.newest is not None and d.newest < rule.cutoff]
        if rule.keep is not None and (busy := sum(d.newest is not None and d.newest >= rule.cutoff for d in mine)):
            print(f"{kind}: kept {busy} sweep directories written in the last hour (a sweep may be running there)")
        for d in drop:
            print(f"{'would delete' if dry_run else 'deleted'} {kind}/{d.name} ({d.files} files)")
            if not dry_run:
                _delete(d, kind)
        print(f"{kind}: {len(drop)} of {len(dirs)} sweep directories {'to delete' if dry_run else 'deleted'}, "
              f"{sum(d.size for d in drop) / 1e6:.2f} MB")


def sweep_dirs(uri: str, kind: str) -> list[SweepDir]:
    """The directories directly under ``uri`` (a bucket's healed/ or tune/), each with the sweep it belongs to."""
    import pyarrow.fs as pafs

    out = []
    try:
        fs, root = pafs.FileSystem.from_uri(uri)
        for d in fs.get_file_info(pafs.FileSelector(root, allow_not_found=True)):
            if d.type != pafs.FileType.Directory:
                continue
            m = SESSION.search(d.base_name) if kind == "tune" else SWEEP_ID.match(d.base_name)
            files = [f for f in fs.get_file_info(pafs.FileSelector(d.path, recursive=True))
                     if f.type == pafs.FileType.File]
            times = [f.mtime.astimezone(timezone.utc) for f in files if f.mtime is not None]
            out.append(SweepDir(fs, d.path, d.base_name, m.group(m.lastindex or 0) if m else None, len(files),
                                sum(f.size or 0 for f in files), max(times) if times else None))
    except OSError as e:  # an unreachable endpoint, refused credentials
        raise CliError(f"store gc: cannot read {uri}: {first_line(e, 200)}") from None
    return out


def _delete(d: SweepDir, kind: str) -> None:
    try:
        d.fs.delete_dir(d.path)
    except OSError as e:
        raise CliError(f"store gc: could not delete {kind}/{d.name}: {first_line(e, 200)}") from None


def referenced_sweeps(run_dirs: list[str]) -> set[str]:
    """The sweep ids of these run directories (their sweep.json); CliError naming one that has none."""
    ids = set()
    for d in run_dirs:
        try:
            sid = json.loads((Path(d) / "sweep.json").read_text(encoding="utf-8"))["sweep_id"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise CliError(f"--keep-referenced: {d} has no readable sweep.json ({type(e).__name__}): not a "
                           "healsweep run directory") from None
        ids.add(str(sid))
    return ids


def bucket_entries(targets: str, kinds: tuple[str, ...]) -> list[tuple[str, str, list[tuple[str, int]]]]:
    """``healsweep store ls`` of a remote store: for each of ``kinds`` (masks, tune, ...) beside ``targets`` that
    holds anything, (kind, its URI, [(entry directly under it, a directory's name ending in "/", bytes)])."""
    import pyarrow.fs as pafs

    out = []
    for kind in kinds:
        uri = store_subdir(targets, kind)
        try:
            fs, root = pafs.FileSystem.from_uri(uri)
            infos = fs.get_file_info(pafs.FileSelector(root, recursive=True, allow_not_found=True))
        except OSError as e:  # an unreachable endpoint, refused credentials
            raise CliError(f"store ls: cannot read {uri}: {first_line(e, 200)}") from None
        sizes: dict[str, int] = {}
        for f in infos:
            top, sep, _ = f.path[len(root.rstrip("/")) + 1:].partition("/")
            label = top + ("/" if sep or f.type == pafs.FileType.Directory else "")
            sizes[label] = sizes.get(label, 0) + ((f.size or 0) if f.type == pafs.FileType.File else 0)
        if sizes:
            out.append((kind, uri, sorted(sizes.items())))
    return out
