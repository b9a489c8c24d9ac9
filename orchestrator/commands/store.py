"""healsweep store ls | verify | gc [WHERE]: inspect, check and clean the dense target store (and list the masks,
rankings and diagnostics that live beside it).

WHERE (or --store) is a run directory (its store is read from targets.json / sweep.json), a store root as given
to `healsweep run --store` (targets in WHERE/targets), or the target store itself (a path or pyarrow.fs URI).
"""
from __future__ import annotations

import argparse
import json
import math
import os
from datetime import datetime, timedelta, timezone
from pathlib import Path

from orchestrator.commands.common import DEFAULT_HOME, CliError
from orchestrator.commands.store_bucket import RECENT, bucket_entries, bucket_rule, gc_bucket
from orchestrator.raytune.cluster import is_remote, store_subdir
from orchestrator.rundir import records, store_users
from tasks.errors import first_line

_WHERE_HELP = ("a run directory (its store is found from sweep.json), a store root as given to `healsweep run "
               "--store` (targets in DIR/targets), or the target store itself (path or pyarrow.fs URI)")
_SIDE = ("masks", "rankings", "diagnostics")  # beside targets/ under a store root


def add_parser(sub):
    p = sub.add_parser("store", help="inspect, verify and clean the dense target store",
                       description="Inspect, verify and clean the content-addressed dense target store. WHERE: " + _WHERE_HELP
                       + f"; default {DEFAULT_HOME / 'store'} (relative to the current directory).")
    cmds = p.add_subparsers(dest="store_cmd", required=True, metavar="ACTION")

    ls = cmds.add_parser("ls", help="list target keys (model, rows, shards, size, last use), masks, rankings, "
                                    "diagnostics and quarantined files with sizes",
                         description="List every target key (model, rows, shards, MB, last use; damaged keys "
                                     "marked), then the masks, rankings, diagnostics and quarantined files with "
                                     "sizes; for a remote store also the bucket's tune/ and healed/ per sweep.")
    vf = cmds.add_parser("verify", help="full checksum pass; exit code 1 if anything is damaged",
                         description="Check every manifest (readable, shards covering exactly its rows) and every "
                                     "shard's size and sha256 (all keys, or KEY), then every mask beside them "
                                     "(readable, its identity its key's, its content its digest; local or remote "
                                     "store). Exit code 0: all sound; 1: damage "
                                     "found (the next sweep quarantines and recomputes it); 2: usage error.")
    vf.add_argument("where_key", nargs="*", metavar="WHERE|KEY",
                    help="where the store is (see WHERE) and/or one 32-hex-character key (default: every key)")
    gc = cmds.add_parser("gc", help="delete keys and masks unused for DAYS or not referenced by given runs",
                         description="Delete target keys (complete or not) that were not used for --older-than "
                                     "DAYS, or that no --keep-referenced RUN_DIR refers to (its targets.json); then "
                                     "the masks beside them by the same rule (a mask's last use is its file's mtime, "
                                     "touched by every sweep that reuses it; a run refers to the masks its "
                                     "trials.jsonl names; a remote store keeps each mask's last use in "
                                     "masks/.last_use/). Rankings and RR diagnostics are kept. With a remote "
                                     "store also the bucket's tune/ (Ray Tune's storage, per sweep: by age, or of "
                                     "sweeps the runs are not and not written in the last hour) and, with "
                                     "--healed, healed/ (weights of trials on nodes without the run directory). "
                                     "A local store's gc is refused while a sweep uses it (each live sweep holds a "
                                     "lock file under STORE/.users/; --dry-run still lists), and a sweep starting "
                                     "meanwhile waits for the gc to end.")
    how = gc.add_mutually_exclusive_group(required=True)
    how.add_argument("--older-than", type=float, metavar="DAYS",
                     help="delete keys and masks last used more than DAYS ago")
    how.add_argument("--keep-referenced", action="append", metavar="RUN_DIR",
                     help="keep only keys and masks referenced by these run directories (repeatable)")
    gc.add_argument("--healed", action="store_true",
                    help="with --keep-referenced and a remote store: also delete the healed weights in the "
                         "bucket (healed/<sweep id>/) of every sweep those runs are not (results, not a cache: "
                         "never deleted by age or without this flag)")
    gc.add_argument("--dry-run", action="store_true", help="print what would be deleted, delete nothing")
    for q in (ls, gc):
        q.add_argument("where", nargs="?", metavar="WHERE", help=_WHERE_HELP)
    for q in (ls, vf, gc):
        q.add_argument("--store", metavar="DIR", help="same as WHERE")
        q.set_defaults(func=main)
    return p


def locate(where: str | None) -> tuple[str, Path | None]:
    """(target store path or URI, store root holding masks/rankings/diagnostics or None) for WHERE."""
    where = where or str(DEFAULT_HOME / "store")
    if "://" in where and not where.startswith("file://"):
        return where, None
    d = Path(where[len("file://"):] if where.startswith("file://") else where).expanduser()
    if not d.exists():  # a read-only command creates nothing (a file:// URI made the directory and said "0 keys")
        raise CliError(f"store: {where} does not exist (give a run directory, a store root or --store DIR)")
    if not d.is_dir():
        raise CliError(f"store: {where} is a file, not a store directory or a run directory")
    if (d / "sweep.json").is_file() or (d / "targets.json").is_file():
        return _from_run_dir(d)
    if (d / "targets").is_dir() or any((d / s).is_dir() for s in _SIDE):
        return str((d / "targets").resolve()), d.resolve()
    return str(d.resolve()), None


def _from_run_dir(d: Path) -> tuple[str, Path | None]:
    try:
        if (d / "targets.json").is_file():
            targets = json.loads((d / "targets.json").read_text())["store"]
        else:
            info = json.loads((d / "sweep.json").read_text())
            targets = (info["spec"].get("store") or {}).get("uri") or str(Path(info["store"]) / "targets")
        info = json.loads((d / "sweep.json").read_text()) if (d / "sweep.json").is_file() else {}
        if not isinstance(info, dict):
            raise TypeError(f"sweep.json holds a {type(info).__name__}, not an object")
    except (ValueError, KeyError, TypeError, AttributeError, OSError) as e:
        raise CliError(f"store: {d} is not a readable run directory ({type(e).__name__}: {e})") from None
    if not isinstance(targets, str) or not targets:
        raise CliError(f"store: {d}: no target store recorded")
    root = Path(info["store"]) if isinstance(info.get("store"), str) else None
    if "://" not in targets and not Path(targets).exists():
        raise CliError(f"store: the target store of run {d} ({targets}) does not exist")
    return targets, root


def main(args: argparse.Namespace) -> int:
    from tasks.store import KEY_RE, StoreError, TargetStore

    where, key = args.store, None
    for a in getattr(args, "where_key", None) or []:
        if KEY_RE.match(a) and not Path(a).exists() and key is None:
            key = a
        elif where is None:
            where = a
        else:
            raise CliError(f"store verify: unexpected argument {a[:80]!r} (give at most WHERE and one KEY)")
    given = getattr(args, "where", None)
    if args.store is not None and given is not None and Path(given) != Path(args.store):
        raise CliError(f"store: give WHERE or --store, not both ({given[:80]!r} and {args.store[:80]!r})")
    where = where or given
    targets, root = locate(where)
    args.key = key
    try:
        store = TargetStore(targets, create="://" not in str(targets))  # ls/verify on a bucket: reads only
    except (StoreError, OSError, ValueError) as e:  # ValueError: pyarrow's ArrowInvalid (an unknown URI scheme)
        raise CliError(f"store: cannot open {targets}: {first_line(e, 200)}") from None
    try:
        return {"ls": _ls, "verify": _verify, "gc": _gc}[args.store_cmd](store, args, root)
    except StoreError as e:
        raise CliError(str(e)) from None


def _size(p: Path) -> int:
    if p.is_file():
        return p.stat().st_size
    return sum(f.stat().st_size for f in p.rglob("*") if f.is_file() and not f.is_symlink())


def _ls(store, args, root) -> int:
    from tasks.store import StoreError

    print(f"targets: {store.root}")
    print(f"{'key':32}  {'model':14} {'rows':>7} {'shards':>6} {'MB':>10}  last use")
    total, keys = 0, store.keys()
    for k in keys:
        size = store.key_bytes(k)
        total += size
        used = store.last_use(k)
        try:
            m = store.manifest(k)
            model, rows, shards = str(m["meta"].get("model", "?")), m["num_rows"], len(m["shards"])
        except StoreError:
            model, rows, shards = "DAMAGED", "?", "?"
        print(f"{k}  {model:14} {rows:>7} {shards:>6} {size / 1e6:>10.2f}  "
              f"{used.isoformat(timespec='seconds') if used else 'never'}")
    print(f"{len(keys)} keys, {total / 1e6:.2f} MB")
    for k in (part := _unfinished(store, keys)):
        shards = sum(n.endswith(".arrow") for n in store.fs.listdir(k))
        print(f"{k}  {'UNFINISHED':14} {'?':>7} {shards:>6} {store.key_bytes(k) / 1e6:>10.2f}  no manifest")
    if part:
        print(f"{len(part)} unfinished ({UNFINISHED})")
    sections = [("quarantine", Path(store.fs.path(".quarantine")))] if store.fs.local else []
    sections += [(s, root / s) for s in _SIDE] if root is not None else []
    listed = [(name, str(d), _local_entries(d)) for name, d in sections if d.is_dir()]
    if is_remote(str(store.root)):  # a bucket: masks, rankings, diagnostics and Ray Tune's and healed weights
        listed += bucket_entries(str(store.root), _SIDE + ("tune", "healed"))
    for name, where, entries in listed:
        print(f"\n{name}: {where}")
        for label, b in entries:
            print(f"  {label:60} {b / 1e6:>10.2f} MB")
        print(f"{name}: {len(entries)} entr{'y' if len(entries) == 1 else 'ies'}, "
              f"{sum(b for _, b in entries) / 1e6:.2f} MB")
    return 0


def _local_entries(d: Path) -> list[tuple[str, int]]:
    return [(e.name + ("/" if e.is_dir() else ""), _size(e)) for e in sorted(d.iterdir())]


UNFINISHED = ("no manifest: a sweep is writing these targets now, or its dense stage stopped midway; the next sweep "
              "that needs them completes them, store gc collects them by age")


def _unfinished(store, keys: list[str]) -> list[str]:
    """Key directories without a manifest (``store.keys()`` lists complete target sets only)."""
    from tasks.store import KEY_RE, StoreError

    def ours(name: str) -> bool:  # (a key directory that is a link out of the root is skipped, as keys() does)
        try:
            store.key_dir(name)
        except StoreError:
            return False
        return True

    done = set(keys)
    return [n for n in sorted(store.fs.listdir()) if KEY_RE.match(n) and n not in done and ours(n)]


def _verify(store, args, root) -> int:
    from tasks.store import StoreError

    keys = [args.key] if args.key else store.keys()
    damaged = 0
    for k in keys:
        try:
            if store.manifest(k) is None:
                raise CliError(f"key {k} has no manifest (missing or not finalized)")
            bad = [(f"{s['file']} (rows {s['row_start']}-{s['row_stop']})", p) for s, p in store.verify(k)]
        except StoreError as e:  # unreadable or inconsistent manifest: report it, go on with the next key
            bad = [("manifest.json", str(e))]
        damaged += bool(bad)
        for what, problem in bad:
            print(f"{k} {what}: {problem}")
        print(f"{k}: {'DAMAGED' if bad else 'ok'}")
    part = [] if args.key else _unfinished(store, keys)
    for k in part:
        print(f"{k}: unfinished ({UNFINISHED})")
    print(f"{len(keys)} keys checked, {damaged} damaged" + (f", {len(part)} unfinished" if part else ""))
    masks = None if args.key else _masks(str(store.root), root)
    if masks is not None:
        damaged += _verify_masks(masks)
    return 1 if damaged else 0


def _masks(targets: str, root: Path | None):
    """The mask store beside the targets (``<store.uri>/masks`` for a remote store, ``<root>/masks`` for a
    local store root), or None when there is none."""
    from tasks.store import MaskStore

    if is_remote(targets):
        masks = MaskStore(store_subdir(targets, "masks"), create=False)
        return masks if masks.fs.is_dir("") else None
    return MaskStore(root / "masks", create=False) if root is not None and (root / "masks").is_dir() else None


def _verify_masks(masks) -> int:
    """Every mask beside the targets read and checked (identity and content digest); -> how many are damaged."""
    keys, bad = masks.keys(), 0
    for k in keys:
        why = masks.problem(k)
        if why is not None:
            bad += 1
            fix = ("the next sweep that uses it deletes it and computes it again" if masks.fs is not None else
                   "healsweep doctor RUN_DIR --repair moves it aside, the next sweep recomputes it")
            print(f"mask {k}: DAMAGED ({why}); {fix}")
    print(f"{len(keys)} masks checked, {bad} damaged")
    return bad


def _referenced(run_dirs: list[str]) -> set[str]:
    keys = set()
    for d in run_dirs:
        f = Path(d) / "targets.json"
        if not f.is_file():
            raise CliError(f"--keep-referenced: {d} has no targets.json (not a healsweep run directory)")
        try:
            keys |= set(json.loads(f.read_text())["keys"].values())
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise CliError(f"--keep-referenced: {f} is unreadable ({type(e).__name__})") from None
    return keys


def _gc(store, args, root) -> int:
    from tasks.store import KEY_RE

    if args.healed and not args.keep_referenced:
        raise CliError("--healed needs --keep-referenced RUN_DIR (healed weights are never deleted by age)")
    if not args.keep_referenced and (not math.isfinite(args.older_than) or not 0 <= args.older_than <= 36500):
        raise CliError(f"--older-than must be a number of days in [0, 36500], got {args.older_than:g}")
    candidates = [n for n in store.fs.listdir() if KEY_RE.match(n)]
    bucket = bucket_rule(str(store.root), args)  # checked before anything is deleted (the runs' sweep.json)
    if args.healed and bucket is None:
        raise CliError("--healed: a local store has no healed weights to collect (they are in each run's trials/; "
                       "healed/ exists only in a remote store.uri's bucket)")
    if bucket is not None:  # no locks on a bucket (--keep-referenced keeps what was used or written in the last hour)
        return _collect(store, args, root, candidates, bucket)
    roots = list(dict.fromkeys(r for r in (root, Path(str(store.root)).parent) if r is not None))  # where sweeps
    mine = []  # using these targets hold (sweep/run.py store_roots): the store directory, the targets' parent
    try:
        for r in roots:
            try:
                mine.append(store_users.hold(r, "gc", f"healsweep store gc (pid {os.getpid()})"))
            except OSError as e:  # a read-only store: nothing to collect there, but a dry run can still list
                if not args.dry_run:
                    raise CliError(f"store gc: cannot write {r / store_users.USERS} ({e.strerror or e})") from None
        if sweeps := [u for r in roots for u in store_users.live(r, "sweep")]:
            if not args.dry_run:
                raise CliError(f"store gc: {roots[0]} is in use now by {' and '.join(sweeps[:3])}"
                               f"{' and more' if len(sweeps) > 3 else ''}: gc could delete the targets and masks a "
                               "sweep reads; run it when no sweep uses the store")
            print(f"note: {roots[0]} is in use now by {' and '.join(sweeps[:3])}: a real gc is refused until it "
                  "is not")
        return _collect(store, args, root, candidates, None)
    finally:
        for f in mine:
            store_users.release(f)


def _collect(store, args, root, candidates: list[str], bucket) -> int:
    """``_gc``'s collection, once no live sweep uses a local store: target keys, masks, a bucket's tune/ and
    healed/."""
    if args.keep_referenced:
        keep = _referenced(args.keep_referenced)
        drop = [k for k in candidates if k not in keep]
        if bucket is not None:  # no locks there: a sweep of another run directory may be reading or writing a key
            recent = datetime.now(timezone.utc) - RECENT
            busy = {k for k in drop if (t := _last_activity(store, k)) is not None and t >= recent}
            if busy:
                print(f"kept {len(busy)} keys used or written in the last hour (a sweep may be running there)")
            drop = [k for k in drop if k not in busy]
    else:
        cutoff = datetime.now(timezone.utc) - timedelta(days=args.older_than)
        drop = [k for k in candidates if (t := _last_activity(store, k)) is None or t < cutoff]
    freed = 0
    for k in drop:
        freed += store.key_bytes(k)
        print(f"{'would delete' if args.dry_run else 'deleted'} {k}")
        if not args.dry_run:
            store.delete(k)
    print(f"{len(drop)} of {len(candidates)} keys {'to delete' if args.dry_run else 'deleted'}, "
          f"{freed / 1e6:.2f} MB")
    if (masks := _masks(str(store.root), root)) is not None:
        _gc_masks(masks, args)
    if bucket is not None:  # a remote store: tune/ and healed/ beside the targets
        gc_bucket(str(store.root), bucket, args.dry_run)
    return 0


def _last_activity(store, key: str) -> datetime | None:
    """When ``key`` was last used (its last-use record) or written (its newest file), whichever is later: a key a
    sweep is writing has shards but neither a manifest nor a last use yet (it was deleted as ageless on a bucket),
    and one it extends or repairs has new shards under an old last use."""
    mt = store.fs.newest_mtime(key)
    times = [t for t in (store.last_use(key), datetime.fromtimestamp(mt, timezone.utc) if mt else None) if t]
    return max(times, default=None)


def _gc_masks(masks, args) -> None:
    """The masks beside the targets (tasks/store/masks.py MaskStore, local or remote), collected by the same rule:
    last used (a sweep that reuses a mask touches it) more than DAYS ago, or not referenced by the
    --keep-referenced runs' trials.jsonl (each trial's ``mask_key``; a run without the record keeps every mask)."""
    keys = masks.keys()
    if args.keep_referenced:
        keep = _referenced_masks(args.keep_referenced)
        if keep is None:
            print(f"masks: kept all {len(keys)}: a --keep-referenced run has no trials.jsonl to name its masks")
            return
        drop = [k for k in keys if k not in keep]
        if masks.fs is not None:  # a bucket, maybe shared: a sweep of another run directory may be using a mask now
            recent = datetime.now(timezone.utc) - RECENT
            busy = {k for k in drop if (t := masks.last_use(k)) is not None and t >= recent}
            if busy:
                print(f"masks: kept {len(busy)} used in the last hour (a sweep may be running there)")
            drop = [k for k in drop if k not in busy]
    else:
        cutoff = datetime.now(timezone.utc) - timedelta(days=args.older_than)
        drop = [k for k in keys if (t := masks.last_use(k)) is None or t < cutoff]
    freed = 0
    for k in drop:
        freed += masks.size(k) or 0
        print(f"{'would delete' if args.dry_run else 'deleted'} mask {k}")
        if not args.dry_run:
            masks.delete(k)
    print(f"{len(drop)} of {len(keys)} masks {'to delete' if args.dry_run else 'deleted'}, {freed / 1e6:.2f} MB")


def _referenced_masks(run_dirs: list[str]) -> set[str] | None:
    """Mask keys the trials of these run directories used (None: one of them has no record to say)."""
    keys: set[str] = set()
    for d in run_dirs:
        f = Path(d) / records.TRIALS_FILE
        if not f.is_file():
            return None
        for r in records.trials(records.scan(f)).values():
            key = ((r.get("mlflow") or {}).get("tags") or {}).get("mask_key")
            if isinstance(key, str):
                keys.add(key)
    return keys
