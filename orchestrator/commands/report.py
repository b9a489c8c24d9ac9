"""healsweep report DIR [--readme FILE]: write DIR/report.html and DIR/report.md from MLflow alone; with --readme,
rewrite FILE's generated blocks from them (analysis/readme.py)."""
from __future__ import annotations

from pathlib import Path
from urllib.parse import unquote, urlparse

from orchestrator.commands.common import CliError, report_lines
from orchestrator.lifecycle.resume import DB_FILE, db_problem, own_db
from orchestrator.rundir.faults import damaged
from orchestrator.rundir.files import ResumeError, lock_holder, read_sweep
from orchestrator.rundir.records import TRIALS_FILE
from orchestrator.spec.checks import SpecError
from orchestrator.spec.reach import check_server
from orchestrator.sweep.console import quiet_libraries
from orchestrator.tracking.store import relocate


def add_parser(sub):
    p = sub.add_parser("report", help="write DIR/report.html and DIR/report.md from MLflow",
                       description="Read the sweep recorded in DIR (its sweep.json names the MLflow tracking URI "
                                   "and sweep id) back from MLflow alone and rewrite DIR/report.html (self-contained, "
                                   "figures embedded), DIR/report.md and DIR/bands.json: best trial per cell, "
                                   "healer comparisons, repairability bands and the calibration transition score. "
                                   "A sweep that did not end complete says so first: interrupted, still running, or "
                                   "left unended by a killed driver (with the resume command). "
                                   "Nothing is recomputed; Ray is not started. Exit code 2 when DIR holds no sweep "
                                   "(no sweep.json, or its MLflow database or parent run is missing).")
    p.add_argument("dir", metavar="DIR", help="run directory of a sweep (holds sweep.json), e.g. runs/tiny")
    p.add_argument("--readme", metavar="FILE", help="also rewrite FILE's <!-- report:NAME --> blocks (findings, or "
                   "a figure stem) from this report, e.g. docs/default-sweep.md; figures are copied to FILE's folder "
                   "when it is docs/, else to docs/ beside FILE")
    p.set_defaults(func=main)
    return p


def sqlite_path(uri: str) -> Path | None:
    """The database file of a ``sqlite:///…`` tracking URI, else None."""
    if not uri.startswith("sqlite:"):
        return None
    p = urlparse(uri)
    return Path(unquote(p.netloc + p.path)) if p.netloc else Path(unquote(p.path))


def check_sweep(d: Path) -> dict:
    """sweep.json of ``d`` after checking that its sweep exists in MLflow, without creating anything there."""

    if not (d / "sweep.json").is_file() and not (d / TRIALS_FILE).is_file():
        raise CliError(f"no sweep in {d} (no sweep.json)")
    try:
        info = read_sweep(d)
    except ResumeError as e:
        raise CliError(f"no sweep in {d}: {e}") from None
    if not info.get("parent_run_id"):  # before the database check: a sweep that ended before MLflow has none
        raise CliError(f"no sweep in {d}: it never reached MLflow (no parent run recorded)")
    db = sqlite_path(info["tracking_uri"])
    if db is not None and not db.is_file():  # opening it would create an empty database
        raise CliError(_missing(d, db))
    try:
        check_server(info["tracking_uri"], f"{d / 'sweep.json'}: tracking_uri")
    except SpecError as e:
        raise CliError(str(e)) from None
    from mlflow import MlflowClient
    from mlflow.exceptions import MlflowException

    try:
        MlflowClient(info["tracking_uri"]).get_run(info["parent_run_id"])
    except MlflowException:
        raise CliError(f"no sweep in {d}: parent run {info['parent_run_id']} is not in {info['tracking_uri']}") from None
    return info


def _missing(d: Path, db: Path) -> str:

    fix = f" (rebuild it from {TRIALS_FILE} with healsweep doctor {d} --repair)" if (d / TRIALS_FILE).is_file() else ""
    return f"no sweep in {d}: its MLflow database {db} is missing{fix}"


def _own_db_missing(d: Path) -> bool:
    """The run directory's own SQLite database is gone (a copied run directory must not be reported from the
    database it was copied from)."""

    try:
        info = read_sweep(d)
    except ResumeError:
        return False  # check_sweep says so in one line
    # a sweep that ended before MLflow (no parent run) has no database: check_sweep says so
    return own_db(d, info) and not (d / "mlflow.db").exists() and bool(info.get("parent_run_id"))


def main(args) -> int:

    quiet_libraries(False)  # no MLflow "Downloading artifacts" bars (the parent run's diagnostics)
    d = Path(args.dir)
    why = db_problem(d / DB_FILE) if (d / "sweep.json").is_file() else None
    if why:
        raise CliError(str(damaged(d / DB_FILE, why, d)))
    if (d / "sweep.json").is_file() and _own_db_missing(d):
        raise CliError(_missing(d, d / DB_FILE))
    if (d / "sweep.json").is_file():
        try:
            relocate(d)  # a copied or moved run directory reads its own MLflow store and artifacts
        except (ValueError, OSError):
            pass  # an unreadable sweep.json: check_sweep says so in one line
    check_sweep(d)
    readme = getattr(args, "readme", None)
    if readme and not Path(readme).is_file():  # before the report is rewritten: a refused command changes nothing
        raise CliError(f"--readme {readme}: {'a directory, not a file' if Path(readme).is_dir() else 'no such file'}")
    from analysis.report import write_report

    paths = write_report(d, driver=lock_holder(d) or "")  # a sweep left RUNNING: in progress, or its driver gone
    print(report_lines(paths))
    if readme:
        from analysis.readme import ReadmeError, update_readme

        try:
            names = update_readme(d, args.readme)
        except ReadmeError as e:
            raise CliError(str(e)) from None
        print(f"readme: {args.readme} ({len(names)} block(s): {', '.join(names) or 'none'})")
    return 0
