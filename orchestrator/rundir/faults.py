"""Faults at the edges of a sweep (a full disk, a damaged file) end in one line, never a traceback.

- ``one_line(e, run_dir)``: the message and exit code for an exception the CLI did not expect: a full disk
  (``tasks.atomic.DiskFullError`` names the path, what it is, the bytes needed and the space left; exit 1) or a
  damaged SQLite tracking database (names the file and the repair command; exit 2). None for anything else
  (a bug: its traceback is shown).
- ``stop(e)`` / ``stopped()``: a fault met on a thread of the driver (the MLflow writer's, which writes the trial
  record) stops the sweep: Tune's stopper (orchestrator/raytune/tune_stop.py) asks for it, ``healsweep run`` raises it at
  the end, also when something after it failed too (``follows_fault``: the report on the same full disk). Module
  state, like orchestrator/rundir/interrupt.py: Tune pickles its stopper.
"""
from __future__ import annotations

import errno
import logging
import sqlite3
from pathlib import Path

from orchestrator.rundir.files import ResumeError
from tasks.atomic import DiskFullError, is_disk_full
from tasks.errors import first_line

_state: dict = {"error": None}
DB_DAMAGED = ("database disk image is malformed", "file is not a database", "file is encrypted or is not a database",
              "malformed database schema", "no such table")
DB_FULL = ("database or disk is full",)
DB_READ_ONLY = ("attempt to write a readonly database",)
NOT_WRITABLE = (errno.EACCES, errno.EPERM, errno.EROFS)  # permission denied, not permitted, read-only file system


class DamagedFileError(ResumeError):
    """A file of a run directory that cannot be used as it is: one line naming it and the repair command."""


def repair_hint(run_dir: Path | str | None) -> str:
    return f"healsweep doctor {run_dir or 'DIR'} --repair"


def damaged(path: Path | str, why: str, run_dir: Path | str | None) -> DamagedFileError:
    state = "is missing" if why == "missing" else f"is damaged ({why})"
    return DamagedFileError(f"{path} {state}: repair it with {repair_hint(run_dir)}, then run the command again")


def stop(e: BaseException) -> None:
    if _state["error"] is None:
        _state["error"] = e


def stopped() -> BaseException | None:
    return _state["error"]


def clear() -> None:
    _state["error"] = None


def follows_fault(e: BaseException) -> bool:
    """Whether ``e`` came after a fault that already stopped the sweep (the report, or a last MLflow write, on the
    same full disk): the command raises that fault (``raise_stopped``), whose line names the first write that
    failed, and logs ``e`` at DEBUG."""
    first = _state["error"]
    if first is None or first is e:
        return False
    logging.getLogger("healsweep").debug("after the fault that stopped the sweep: %r", e)
    return True


def raise_stopped() -> None:
    e, _state["error"] = _state["error"], None
    if e is not None:
        raise e


def _chain(e: BaseException):
    seen = 0
    while e is not None and seen < 20:
        yield e
        seen += 1
        e = e.__cause__ or e.__context__ or getattr(e, "orig", None)


def one_line(e: BaseException, run_dir: Path | str | None = None, then: str | None = None) -> tuple[str, int] | None:
    """(message, exit code) for a fault at the edges, else None. ``then``: what to run once space is freed
    (default: continue with healsweep run --resume DIR; a failed repair: the repair again)."""
    then = then or f"continue with healsweep run --resume {run_dir or 'DIR'}"
    for x in _chain(e):
        if isinstance(x, DiskFullError):
            return f"{x}; free space there, then {then}", 1
    for x in _chain(e):
        text = str(x).lower()
        db = Path(run_dir) / "mlflow.db" if run_dir else "the MLflow tracking database"
        if any(m in text for m in DB_FULL):  # the database's path and the space left there, as for any file
            full = DiskFullError(db) if run_dir else f"no space left on device writing {db}"
            return f"{full}; free space there, then {then}", 1
        if any(m in text for m in DB_DAMAGED) and _is_db_error(x):
            return str(damaged(db, first_line(x, 100), run_dir)), 2
        if any(m in text for m in DB_READ_ONLY):
            return f"cannot write {db}: it is read-only; {_writable(run_dir)}", 1
    for x in _chain(e):
        if is_disk_full(x):
            where = f" {x.filename}" if getattr(x, "filename", None) else ""
            return (f"no space left on device{where} ({errno.errorcode.get(x.errno, x.errno)}); free space, then "
                    f"{then}"), 1
        if isinstance(x, OSError) and x.errno in NOT_WRITABLE:
            where = f" {x.filename}" if getattr(x, "filename", None) else ""
            return f"cannot write{where}: {x.strerror} ({errno.errorcode[x.errno]}); {_writable(run_dir)}", 1
    return None


def _writable(run_dir: Path | str | None) -> str:
    """What to do about a file the command cannot write (a read-only mount, a file of another user)."""
    return (f"make {run_dir} and its files writable (or copy it somewhere writable), then run the command again"
            if run_dir else "make it writable, then run the command again")


def _is_db_error(x: BaseException) -> bool:

    return isinstance(x, sqlite3.DatabaseError) or type(x).__module__.startswith(("sqlalchemy", "mlflow"))
