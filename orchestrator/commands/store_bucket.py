"""``healsweep store gc`` with a remote store: what sweeps leave in the bucket beside the targets, per sweep.

- ``healed/<sweep id>/``: the healed weights of trials that ran on nodes without the run directory
  (tasks/store/healed.py; ``healsweep export`` fetches them from there);
- ``tune/<name>-<sweep id>-s<session>/``: Ray Tune's storage on a cluster (its epoch checkpoints are dropped after
  each fit; a driver that crashed leaves them, and the experiment state stays).

``--keep-referenced RUN_DIR``: both, for every sweep those run directories are not (their sweep.json). ``--older-than
DAYS``: Tune's storage last written more than DAYS ago; healed weights are results, not a cache, so age alone never
deletes them. A directory that names no sweep is left alone.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from pathlib import Path

from orchestrator.commands.common import CliError
from orchestrator.raytune.cluster import is_remote, store_subdir

SWEEP_ID = re.compile(r"^[0-9a-f]{12}$")
SESSION = re.compile(r"-([0-9a-f]{12})-s\d+$")  # a sweep's Tune experiment: <name>-<sweep id>-s<session>


@dataclass
class SweepDir:
    fs: object  # its pyarrow file system
    path: str
    name: str
    sweep_id: str | None  # None: no sweep's (left alone)
    files: int
    size: int  # bytes
    newest: datetime | None  # its newest file's mtime (UTC); None: no file


def gc_bucket(targets: str, args) -> None:
    """Collect healed/ and tune/ beside the remote target store ``targets`` by ``args``' rule (module docstring);
    prints one line per directory and a summary per kind. Nothing for a local store (it has neither)."""
    if not is_remote(targets):
        return
    keep = referenced_sweeps(args.keep_referenced) if args.keep_referenced else None
    cutoff = datetime.now(timezone.utc) - timedelta(days=args.older_than or 0)
    for kind in ("tune", "healed"):
        dirs = [d for d in sweep_dirs(store_subdir(targets, kind), kind) if d.sweep_id is not None]
        if keep is None and kind == "healed":
            if dirs:
                print(f"healed: kept the weights of {len(dirs)} sweep(s) (results, not a cache: --keep-referenced "
                      "RUN_DIR deletes those of every sweep it does not name)")
            continue
        drop = [d for d in dirs if (d.sweep_id not in keep if keep is not None else d.newest is None or d.newest < cutoff)]
        for d in drop:
            print(f"{'would delete' if args.dry_run else 'deleted'} {kind}/{d.name} ({d.files} files)")
            if not args.dry_run:
                _delete(d, kind)
        print(f"{kind}: {len(drop)} of {len(dirs)} sweep directories {'to delete' if args.dry_run else 'deleted'}, "
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
        raise CliError(f"store gc: cannot read {uri}: {str(e).strip().splitlines()[0][:200]}") from None
    return out


def _delete(d: SweepDir, kind: str) -> None:
    try:
        d.fs.delete_dir(d.path)
    except OSError as e:
        raise CliError(f"store gc: could not delete {kind}/{d.name}: {str(e).strip().splitlines()[0][:200]}") from None


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
