"""healsweep report DIR: write DIR/report.html and DIR/report.md from MLflow alone."""
from __future__ import annotations

from pathlib import Path

from orchestrator.commands.common import CliError


def add_parser(sub):
    p = sub.add_parser("report", help="write DIR/report.html and DIR/report.md from MLflow")
    p.add_argument("dir", help="run directory of a sweep (holds sweep.json)")
    p.set_defaults(func=main)
    return p


def main(args) -> int:
    from analysis.report import write_report

    d = Path(args.dir)
    if not (d / "sweep.json").is_file():
        raise CliError(f"{d}: not a run directory (no sweep.json)")
    from orchestrator.cluster import relocate  # [cluster] a copied run directory reads its own store

    relocate(d)
    paths = write_report(d)
    print(f"report: {paths['html']}\n        {paths['md']}")
    return 0
