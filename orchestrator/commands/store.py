"""healsweep store ls | verify [KEY] | gc: inspect, check and clean the dense target store."""
from __future__ import annotations

import argparse
import json
from datetime import datetime, timedelta, timezone
from pathlib import Path

from orchestrator.commands.common import DEFAULT_HOME, CliError

_STORE_HELP = ("store root as given to `healsweep run --store` (targets live in DIR/targets), or a pyarrow.fs "
               "URI / path of the target store itself (e.g. the spec's store.uri) (default: %(default)s)")


def add_parser(sub):
    p = sub.add_parser("store", help="inspect, verify and clean the dense target store",
                       description="Inspect, verify and clean the content-addressed dense target store.")
    cmds = p.add_subparsers(dest="store_cmd", required=True, metavar="ACTION")

    ls = cmds.add_parser("ls", help="list keys: model, rows, shards, size on disk, last use",
                         description="List every complete key: model, row count, shards, bytes on disk, last use.")
    vf = cmds.add_parser("verify", help="full checksum pass; exit code 1 if any shard is damaged",
                         description="Check every shard's size and sha256 against its manifest (all keys, or KEY). "
                                     "Exit code 0: all sound; 1: damage found (the next sweep recomputes it); "
                                     "2: usage error.")
    vf.add_argument("key", nargs="?", help="one 32-hex-character key (default: every key)")
    gc = cmds.add_parser("gc", help="delete keys unused for DAYS or not referenced by given runs",
                         description="Delete keys (complete or not) that were not used for --older-than DAYS, "
                                     "or that no --keep-referenced RUN_DIR refers to (its targets.json).")
    how = gc.add_mutually_exclusive_group(required=True)
    how.add_argument("--older-than", type=float, metavar="DAYS", help="delete keys last used more than DAYS ago")
    how.add_argument("--keep-referenced", action="append", metavar="RUN_DIR",
                     help="keep only keys referenced by these run directories (repeatable)")
    gc.add_argument("--dry-run", action="store_true", help="print what would be deleted, delete nothing")
    for q in (ls, vf, gc):
        q.add_argument("--store", metavar="DIR", default=str(DEFAULT_HOME / "store"), help=_STORE_HELP)
        q.set_defaults(func=main)
    return p


def _open(root: str):
    from tasks.store import TargetStore

    if "://" not in root and not Path(root).exists():
        raise CliError(f"--store: {root} does not exist")
    if "://" not in root and (Path(root) / "targets").is_dir():
        root = str(Path(root) / "targets")
    return TargetStore(root)


def main(args: argparse.Namespace) -> int:
    from tasks.store import StoreError

    store = _open(args.store)
    try:
        return {"ls": _ls, "verify": _verify, "gc": _gc}[args.store_cmd](store, args)
    except StoreError as e:
        raise CliError(str(e)) from None


def _ls(store, args) -> int:
    print(f"{'key':32}  {'model':14} {'rows':>7} {'shards':>6} {'MB':>10}  last use")
    total = 0
    for k in store.keys():
        m = store.manifest(k)
        size = store.key_bytes(k)
        total += size
        used = store.last_use(k)
        print(f"{k}  {str(m['meta'].get('model', '?')):14} {m['num_rows']:>7} {len(m['shards']):>6} "
              f"{size / 1e6:>10.2f}  {used.isoformat(timespec='seconds') if used else 'never'}")
    print(f"{len(store.keys())} keys, {total / 1e6:.2f} MB")
    return 0


def _verify(store, args) -> int:
    keys = [args.key] if args.key else store.keys()
    damaged = 0
    for k in keys:
        if store.manifest(k) is None:
            raise CliError(f"key {k} has no manifest (missing or not finalized)")
        bad = store.verify(k, full=True)
        damaged += len(bad)
        for s, problem in bad:
            print(f"{k} {s['file']} (rows {s['row_start']}-{s['row_stop']}): {problem}")
        print(f"{k}: {'DAMAGED' if bad else 'ok'}")
    print(f"{len(keys)} keys checked, {damaged} damaged shards")
    return 1 if damaged else 0


def _referenced(run_dirs: list[str]) -> set[str]:
    keys = set()
    for d in run_dirs:
        f = Path(d) / "targets.json"
        if not f.is_file():
            raise CliError(f"--keep-referenced: {d} has no targets.json (not a healsweep run directory)")
        keys |= set(json.loads(f.read_text())["keys"].values())
    return keys


def _gc(store, args) -> int:
    from tasks.store import KEY_RE

    candidates = [n for n in store.fs.listdir() if KEY_RE.match(n)]
    if args.keep_referenced:
        keep = _referenced(args.keep_referenced)
        drop = [k for k in candidates if k not in keep]
    else:
        if args.older_than < 0:
            raise CliError(f"--older-than must be >= 0 days, got {args.older_than:g}")
        cutoff = datetime.now(timezone.utc) - timedelta(days=args.older_than)

        def last(k):
            t = store.last_use(k)
            if t is None:
                mt = store.fs.mtime(f"{k}/manifest.json") or store.fs.mtime(k)
                t = datetime.fromtimestamp(mt, timezone.utc) if mt else None
            return t

        drop = [k for k in candidates if (t := last(k)) is None or t < cutoff]
    freed = 0
    for k in drop:
        freed += store.key_bytes(k)
        print(f"{'would delete' if args.dry_run else 'deleted'} {k}")
        if not args.dry_run:
            store.delete(k)
    print(f"{len(drop)} of {len(candidates)} keys {'to delete' if args.dry_run else 'deleted'}, "
          f"{freed / 1e6:.2f} MB")
    return 0
