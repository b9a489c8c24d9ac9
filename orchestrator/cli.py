"""healsweep command line. Subcommands live in ``orchestrator.commands``."""
from __future__ import annotations

import argparse
import importlib
import sys

from orchestrator.commands import COMMANDS
from orchestrator.commands.common import CliError


def package_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

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
    try:
        return args.func(args)
    except CliError as e:
        print(f"healsweep: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
