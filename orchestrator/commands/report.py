"""healsweep report DIR: write DIR/report.html and DIR/report.md from MLflow alone."""
from __future__ import annotations

from pathlib import Path

from orchestrator.commands.common import CliError


def add_parser(sub):
    p = sub.add_parser("report", help="write DIR/report.html and DIR/report.md from MLflow",
                       description="Read the sweep recorded in DIR (its sweep.json names the MLflow tracking URI "
                                   "and sweep id) back from MLflow alone and rewrite DIR/report.html (self-contained, "
                                   "figures embedded), DIR/report.md and DIR/bands.json: best trial per cell, "
                                   "healer comparisons, repairability bands and the calibration transition score. "
                                   "Nothing is recomputed; Ray is not started.")
    p.add_argument("dir", metavar="DIR", help="run directory of a sweep (holds sweep.json), e.g. runs/tiny")
    p.set_defaults(func=main)
    return p


def main(args) -> int:
    from analysis.report import write_report

    d = Path(args.dir)
    if not (d / "sweep.json").is_file():
        raise CliError(f"{d}: not a run directory (no sweep.json)")
    paths = write_report(d)
    print(f"report: {paths['html']}\n        {paths['md']}")
    return 0
