"""healsweep command line. Subcommands live in ``orchestrator.commands``."""
from __future__ import annotations

import argparse
import atexit
import importlib
import os
import select
import sys
import traceback
from importlib.metadata import PackageNotFoundError, version

from orchestrator.commands import COMMANDS
from orchestrator.commands.common import CliError
from orchestrator.rundir import interrupt
from orchestrator.rundir.faults import one_line


def package_version() -> str:

    try:
        return version("healsweep")
    except PackageNotFoundError:  # running from a checkout that was never installed
        return "unknown (not installed)"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="healsweep",
        description="Prune and heal vision models over grids of model x sparsity x calibration size x pruner x "
                    "healer, on Ray Tune with a per-cell Optuna search, logged to MLflow, with reports.")
    p.add_argument("--version", action="version", version=f"healsweep {package_version()}")
    sub = p.add_subparsers(dest="cmd", required=True, metavar="COMMAND")
    for name in COMMANDS:
        importlib.import_module(f"orchestrator.commands.{name}").add_parser(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    interrupt.opened(None)  # no sweep opened by this command yet (tests call main several times in one process)
    try:
        code = args.func(args)
    except CliError as e:
        print(f"healsweep: error: {e}", file=sys.stderr)
        code = 2
    except KeyboardInterrupt:  # Ctrl-C before a sweep handles it (orchestrator/rundir/interrupt.py): no traceback
        print(interrupt.escaped_line(), file=sys.stderr)
        code = 130
    except BrokenPipeError as e:  # `healsweep store ls | head`: the reader left; quiet, as a shell tool is
        code = 141 if stdout_gone() else fault_exit(e, args)  # 128 + SIGPIPE
    except Exception as e:  # a full disk, a damaged database: one line (orchestrator/rundir/faults.py); else a bug
        code = fault_exit(e, args)
    if argv is None and ("torch" in sys.modules or "ray" in sys.modules):  # the console script, after a command that
        exit_now(code)  # loaded torch or Ray (a sweep on a warm store loads Ray, MLflow and no torch)
    return code


def stdout_gone() -> bool:
    """Whether standard output's reader has gone (a pipe whose read end is closed polls POLLERR); if so, it is
    pointed at /dev/null so that the interpreter's last flush raises nothing (the Python docs' recipe for SIGPIPE)."""
    try:
        fd = sys.stdout.fileno()
        poll = select.poll()
        poll.register(fd, select.POLLOUT)
        gone = any(ev & select.POLLERR for _, ev in poll.poll(0))
    except (OSError, ValueError, AttributeError):  # no real stdout (a test's capture), or no poll on this platform
        return False
    if gone:
        os.dup2(os.open(os.devnull, os.O_WRONLY), fd)
    return gone


def fault_exit(e: Exception, args) -> int:
    """A fault at the edges as one line on stderr and its exit code (--verbose: its traceback too); anything
    else is raised again."""

    run_dir = getattr(args, "resume", None) or getattr(args, "dir", None) or getattr(args, "out", None)
    cmd = getattr(args, "cmd", None)
    again = (f"run healsweep doctor {run_dir}{' --repair' * bool(getattr(args, 'repair', False))} again"
             if cmd == "doctor" else f"run healsweep export {getattr(args, 'run_id', 'RUN_ID')} again"
             if cmd == "export" else None)  # an export's --out is no run directory: nothing to resume
    found = one_line(e, run_dir, again)
    if found is None:
        raise e
    if getattr(args, "verbose", False):
        traceback.print_exception(e)
    print(f"healsweep: error: {found[0]}", file=sys.stderr)
    return found[1]


def exit_now(code: int) -> None:
    """End the process without the interpreter's module teardown (2-3 s with torch, Ray and MLflow loaded):
    atexit handlers run and streams are flushed first; every file a command writes is closed by then."""

    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # closed or broken pipe
            pass
    os._exit(code)


if __name__ == "__main__":
    sys.exit(main())
