"""healsweep report DIR [--readme FILE]: write DIR/report.html and DIR/report.md from MLflow alone; with --readme,
rewrite FILE's generated blocks from them (analysis/readme.py)."""
from __future__ import annotations

from pathlib import Path

from orchestrator.commands.common import CliError


def add_parser(sub):
    p = sub.add_parser("report", help="write DIR/report.html and DIR/report.md from MLflow")
    p.add_argument("dir", help="run directory of a sweep (holds sweep.json)")
    p.add_argument("--readme", metavar="FILE", help="also rewrite FILE's <!-- report:NAME --> blocks (findings, or "
                   "a figure stem) from this report; figures are copied to docs/ beside FILE")
    p.set_defaults(func=main)
    return p


def main(args) -> int:
    from analysis.report import write_report

    d = Path(args.dir)
    if not (d / "sweep.json").is_file():
        raise CliError(f"{d}: not a run directory (no sweep.json)")
    paths = write_report(d)
    print(f"report: {paths['html']}\n        {paths['md']}")
    if getattr(args, "readme", None):
        from analysis.readme import ReadmeError, update_readme

        if not Path(args.readme).is_file():
            raise CliError(f"{args.readme}: no such file")
        try:
            names = update_readme(d, args.readme)
        except ReadmeError as e:
            raise CliError(str(e)) from None
        print(f"readme: {args.readme} ({len(names)} block(s): {', '.join(names) or 'none'})")
    return 0
