"""healsweep export RUN_ID --out DIR: the healed model of one trial (safetensors), its mask and a model card.

The run directory is found from the run id: every ``sweep.json`` under ``--runs`` (default ``runs/``, where
``healsweep run`` writes) names its tracking URI and sweep id; the run is looked up in each distinct tracking
URI and the run directory whose sweep id matches the run's ``sweep_id`` tag is used. ``--run-dir`` skips the
search (a run directory outside ``runs/``, or two copies of one sweep).
"""
from __future__ import annotations

import contextlib
import json
import os
import re
from contextlib import contextmanager
from pathlib import Path

from orchestrator.commands.common import CliError, not_a_dir
from orchestrator.spec.checks import SpecError
from orchestrator.spec.reach import check_server
from orchestrator.tracking.store import local_tracking_uri, moved_from
from orchestrator.raytune.cluster import is_remote, store_subdir
from tasks.atomic import file_lock
from tasks.saved_trial import TRIAL_JSON, healed_problem, trial_dir
from tasks.errors import first_line


def add_parser(sub):
    p = sub.add_parser("export", help="write a trial's healed model, mask and model card",
                       description="Export the healed model of the trial whose MLflow run id is RUN_ID (the "
                                   "report's 'MLflow run' and 'runs of healed (%%)' columns): DIR/model.safetensors "
                                   "(full state dict), DIR/mask.safetensors, DIR/model_card.json and "
                                   "DIR/model_card.md (which trial made the weights, the sha256 of the weight files, "
                                   "this run's accuracy and the report's number for its cell, plain timm code that "
                                   "rebuilds the model and its preprocessing). Re-exporting a run gives the same "
                                   "bytes. "
                                   "The run directory is found under --runs unless --run-dir is given.")
    p.add_argument("run_id", metavar="RUN_ID", help="MLflow run id of a finished trial (a child run; the report's "
                                                    "'MLflow run' or 'runs of healed (%%)' columns), or its trial "
                                                    "id (<cell id>-<number>) when one sweep searched holds it")
    p.add_argument("--out", metavar="DIR", required=True, help="output directory")
    where = p.add_mutually_exclusive_group()
    where.add_argument("--run-dir", metavar="DIR", help="the sweep's run directory (holds sweep.json and trials/); "
                                                        "default: found under --runs")
    where.add_argument("--runs", metavar="DIR", default="runs",
                       help="where to look for run directories (DIR/*/sweep.json) when --run-dir is not given "
                            "(default: %(default)s)")
    p.add_argument("--tracking-uri", metavar="URI",
                   help="MLflow tracking URI: the only one searched (default: $MLFLOW_TRACKING_URI, then the URIs "
                        "the run directories name)")
    p.add_argument("--force", action="store_true",
                   help="replace the export of another run that DIR already holds (default: refuse)")
    p.set_defaults(func=main)
    return p


def _sweep_json(d: Path) -> dict:
    try:
        meta = json.loads((d / "sweep.json").read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise CliError(f"{d}: unreadable sweep.json ({type(e).__name__})") from None
    if not isinstance(meta, dict):
        raise CliError(f"{d}: sweep.json is not an object")
    return meta


def _get_run(uri: str, run_id: str):
    """The MLflow run, or None when ``uri`` does not hold it (a sqlite file that does not exist is not created)."""
    from mlflow import MlflowClient
    from mlflow.exceptions import MlflowException

    if uri.startswith("sqlite:///") and not Path(uri[len("sqlite:///"):]).is_file():
        return None
    try:
        check_server(uri, "--tracking-uri")  # 3 s: a server that is down took MLflow's retries, silently, minutes
    except SpecError as e:
        raise CliError(str(e)) from None
    try:
        return MlflowClient(uri).get_run(run_id)
    except MlflowException:
        return None


def _own_uri(d: Path, meta: dict):
    """sweep.json's tracking URI, or the run directory's own SQLite store when the directory was moved or copied
    (sweep.json still names the old place: what ``tracking.store.relocate`` rewrites; an export reads, so it does
    not rewrite)."""
    return local_tracking_uri(d) if moved_from(d, meta) else meta.get("tracking_uri")


def _candidates(runs: Path) -> tuple[list[tuple[Path, dict]], list[str]]:
    """-> ([(run directory, its sweep.json)], [why each unreadable one was skipped]): one damaged run directory
    under ``runs`` does not stop the export of a run in another."""
    dirs = ([runs] if (runs / "sweep.json").is_file() else []) + sorted(p.parent for p in runs.glob("*/sweep.json"))
    found, skipped = [], []
    for d in dirs:
        try:
            found.append((d, _sweep_json(d)))
        except CliError as e:
            skipped.append(str(e))
    return found, skipped


def _skipped(skipped: list[str]) -> str:
    return f" (skipped: {'; '.join(skipped)})" if skipped else ""


def _given_run_dir(run_dir: str) -> tuple[Path, dict]:
    d = Path(run_dir)
    if not (d / "sweep.json").is_file():
        lost = (d / "trials.jsonl").is_file()  # a run directory that lost its sweep.json
        raise CliError(f"--run-dir {d}: " + (f"sweep.json missing; rebuild it with healsweep doctor {d} --repair"
                                             if lost else "not a run directory (no sweep.json)"))
    return d, _sweep_json(d)


def _given_uri(d: Path, meta: dict, tracking_uri: str | None) -> str:
    uri = tracking_uri or _own_uri(d, meta) or f"sqlite:///{(d / 'mlflow.db').resolve()}"
    if not isinstance(uri, str):
        raise CliError(f"{d}: sweep.json's tracking_uri is not a URI ({str(uri)[:40]!r}); give --tracking-uri")
    return uri


def _search_uris(cands: list[tuple[Path, dict]], tracking_uri: str | None) -> list[str]:
    """Each distinct tracking URI once, in order: --tracking-uri alone when given (no other store is searched),
    else $MLFLOW_TRACKING_URI, then the run directories'."""
    if tracking_uri:
        return [tracking_uri]
    uris = [os.environ["MLFLOW_TRACKING_URI"]] if os.environ.get("MLFLOW_TRACKING_URI") else []
    return list(dict.fromkeys(uris + [u for d, m in cands if isinstance(u := _own_uri(d, m), str)]))


def find_run(run_id: str, run_dir: str | None, runs: str, tracking_uri: str | None):
    """-> (run directory, tracking URI, MLflow run)."""
    if run_dir:
        d, meta = _given_run_dir(run_dir)
        uri = _given_uri(d, meta, tracking_uri)
        run = _get_run(uri, run_id)
        if run is None:
            raise CliError(f"run {run_id!r} not found in {uri}")
        if (sweep := run.data.tags.get("sweep_id")) != meta.get("sweep_id"):  # one tracking store, two sweeps: the
            raise CliError(f"run {run_id!r} is of sweep {sweep}, but {d} holds sweep {meta.get('sweep_id')}: "  # other's
                           "give that sweep's run directory, or leave out --run-dir")  # trial of the same id was exported
        return d, uri, run
    cands, skipped = _candidates(Path(runs))
    for uri in _search_uris(cands, tracking_uri):
        run = _get_run(uri, run_id)
        if run is None:
            continue
        sweep = run.data.tags.get("sweep_id")
        match = [d for d, m in cands if m.get("sweep_id") == sweep]
        if len(match) > 1:
            raise CliError(f"run {run_id!r}: sweep {sweep} is in {len(match)} run directories "
                           f"({', '.join(map(str, match))}); choose one with --run-dir DIR")
        if match:
            return match[0], uri, run
        raise CliError(f"run {run_id!r} (sweep {sweep}) is in {uri}, but no run directory under {runs}/ holds "
                       f"that sweep{_skipped(skipped)}; give --run-dir DIR")
    if tracking_uri:
        raise CliError(f"run {run_id!r} not found in {tracking_uri}; check the run id and --tracking-uri")
    raise CliError(f"run {run_id!r} not found in the {len(cands)} run director{'y' if len(cands) == 1 else 'ies'} "
                   f"under {runs}/{_skipped(skipped)}; give --run-dir DIR (or --runs DIR)")


def fetch_stored(run_dir: Path, trial_id: str, dest: Path, healed_acc: float | None = None) -> str | None:
    """A trial that ran on a node without the run directory left its healed weights in the remote store's
    ``healed/<sweep id>/<trial id>/`` (tasks/store/healed.py): copy them into ``dest``. ``healed_acc``: the MLflow
    run's, which the copy's trial.json must repeat (a copy of the run directory, resumed elsewhere, writes under
    the same keys). -> None when fetched or when the sweep's store is not remote (nothing to fetch), else why not."""
    meta = _sweep_json(run_dir)
    uri = ((meta.get("spec") or {}).get("store") or {}).get("uri")
    if not (isinstance(uri, str) and is_remote(uri)):
        return None
    from tasks.store.healed import HealedStore

    def accept(d: Path) -> str | None:
        got = _final(d).get("healed_acc")
        if healed_acc is not None and got != healed_acc:
            return f"its copy there is of another run (healed_acc {got}, this run's {healed_acc})"
        return None

    try:
        why = HealedStore(store_subdir(uri, "healed")).fetch(str(meta.get("sweep_id")), trial_id, dest, accept)
    except OSError as e:  # an unreachable endpoint, refused credentials
        why = f"{type(e).__name__}: {first_line(e) if str(e) else ''}"
    return f"the store has no usable copy ({why})" if why else None


def _final(d: Path) -> dict:
    try:
        final = json.loads((d / TRIAL_JSON).read_text(encoding="utf-8")).get("final")
    except (OSError, ValueError, AttributeError):
        return {}
    return final if isinstance(final, dict) else {}


EXPORT_FILES = ("model.safetensors", "mask.safetensors", "model_card.json", "model_card.md")


def earlier_export(out: Path, run_id: str) -> str | None:
    """Why writing the export of ``run_id`` to ``out`` would replace another's (None: nothing of another run
    there; a re-export of the same run replaces its own files)."""
    present = [n for n in EXPORT_FILES if (out / n).exists()]
    if not present:
        return None
    try:
        held = json.loads((out / "model_card.json").read_text(encoding="utf-8")).get("mlflow_run_id")
    except (OSError, ValueError, AttributeError):
        held = None
    if held == run_id:
        return None
    what = f"the export of run {held!r}" if isinstance(held, str) else ", ".join(present)
    return f"{out} already holds {what}; choose another --out or pass --force to replace it"


RUN_ID = re.compile(r"[0-9a-f]{32}")  # an MLflow run id (uuid4 hex)
TRIAL_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.]*-[0-9]+")  # <cell id>-<number>: trial.json's, the MLflow tag trial_id


def looks_like_trial_id(text: str) -> bool:
    return not RUN_ID.fullmatch(text) and bool(TRIAL_ID.fullmatch(text))


def trial_run_id(trial_id: str, run_dir: str | None, runs: str, tracking_uri: str | None) -> str:
    """A trial id -> the MLflow run id of the one live trial run with that ``trial_id`` tag, in the stores and
    sweeps an export by run id searches (with --run-dir: its sweep alone). A trial id is unique within a sweep,
    not across sweeps: one in several sweeps is refused, naming them."""
    if run_dir:
        d, meta = _given_run_dir(run_dir)
        uris, sweeps, where = [_given_uri(d, meta, tracking_uri)], {meta.get("sweep_id")}, f"{d}'s sweep"
    else:
        cands, _ = _candidates(Path(runs))
        uris, sweeps = _search_uris(cands, tracking_uri), {m.get("sweep_id") for _, m in cands}
        where = f"the sweeps of the {len(cands)} run director{'y' if len(cands) == 1 else 'ies'} under {runs}/"
    found = {}
    for uri in uris:
        for run in _trial_runs(uri, trial_id):
            if run.data.tags.get("sweep_id") in sweeps:
                found[run.info.run_id] = run.data.tags.get("sweep_id")
    if len(found) == 1:
        return next(iter(found))
    if not found:
        raise CliError(f"{trial_id!r} looks like a trial id (<cell id>-<number>), not an MLflow run id (32 hex "
                       f"digits), and no trial run of that id is in {where}; the report's 'MLflow run' and "
                       "'runs of healed (%)' columns give run ids")
    sweeps = sorted(set(map(str, found.values())))
    raise CliError(f"trial id {trial_id!r} names {len(found)} runs (sweep{'s' if len(sweeps) > 1 else ''} "
                   f"{', '.join(sweeps)}): give its MLflow run id ({', '.join(sorted(found))})"
                   + (" or --run-dir of its sweep" if len(sweeps) > 1 else ""))


def _trial_runs(uri: str, trial_id: str) -> list:
    """The live trial runs tagged ``trial_id`` in ``uri`` (none when a sqlite file does not exist)."""
    from mlflow import MlflowClient

    if uri.startswith("sqlite:///") and not Path(uri[len("sqlite:///"):]).is_file():
        return []
    try:
        check_server(uri, "--tracking-uri")
    except SpecError as e:
        raise CliError(str(e)) from None
    client = MlflowClient(uri)
    exps = [e.experiment_id for e in client.search_experiments()]
    return client.search_runs(exps, f"tags.trial_id = '{trial_id}' and tags.`healsweep.role` = 'trial'",
                              max_results=100) if exps else []


def report_quote(uri: str, run) -> dict | None:
    """The report's healed number for the run's cell and the runs it averages (``analysis.reported``: the
    report's own code, on that cell's runs), or None when the cell has none (no finished search trial)."""
    from mlflow import MlflowClient

    from analysis.reported import cell_results

    sweep, cell = run.data.tags.get("sweep_id"), run.data.tags.get("cell_id")
    if not sweep or not cell:
        return None
    experiment = MlflowClient(uri).get_experiment(run.info.experiment_id).name
    res = cell_results(uri, sweep, experiment, cell)
    res = res[res["cell_id"] == cell]
    if res.empty:
        return None
    return {"healed_acc": float(res["healed_acc"].iloc[0]), "run_ids": str(res["quoted_run_ids"].iloc[0]).split(";")}


def main(args) -> int:
    run_id = trial_run_id(args.run_id, args.run_dir, args.runs, args.tracking_uri) \
        if looks_like_trial_id(args.run_id) else args.run_id
    run_dir, uri, run = find_run(run_id, args.run_dir, args.runs, args.tracking_uri)
    if run.data.tags.get("healsweep.role") != "trial":
        raise CliError(f"run {run_id!r} is not a trial run (tag healsweep.role != 'trial')")
    if run.info.status != "FINISHED":
        raise CliError(f"run {run_id!r} did not finish (status {run.info.status})")
    info = {**run.data.params, "run_id": run_id, "metrics": dict(run.data.metrics), "tags": dict(run.data.tags)}
    if why := not_a_dir(args.out):
        raise CliError(f"--out: {why}")
    with _one_export_at_a_time(Path(args.out)):  # two exports to one --out: the second sees the first's files
        if not args.force and (why := earlier_export(Path(args.out), run_id)):
            raise CliError(f"--out: {why}")
        return _export(args, run_dir, run, {**info, "report": report_quote(uri, run)})


@contextmanager
def _one_export_at_a_time(out: Path):
    """An exclusive lock on ``out/.export.lock`` (a file opened for writing, so it holds on NFS too) for the check
    and the writes: two exports started together to one --out both passed the check, and one silently replaced
    the other. The lock file is removed before the lock is let go, so --out holds only the export; a waiter that
    then holds a removed file sees it is not the one at that name and takes the lock again. An --out this call made
    and left without an export is removed."""
    made = not out.exists()
    out.mkdir(parents=True, exist_ok=True)
    try:
        with file_lock(out / ".export.lock", remove=True,
                       on_wait=lambda: print(f"waiting for another healsweep export to {out} to end", flush=True)):
            yield
    finally:
        if made and not any(p.name in EXPORT_FILES for p in out.iterdir()):
            with contextlib.suppress(OSError):
                out.rmdir()


def _export(args, run_dir: Path, run, info: dict) -> int:
    from tasks.export import export_trial

    fetched = None
    try:
        d = trial_dir(run_dir, run.data.tags.get("trial_id", ""))
        if healed_problem(d):
            fetched = fetch_stored(run_dir, d.name, d, run.data.metrics.get("healed_acc"))
        paths = export_trial(d, Path(args.out), info)
    except (FileNotFoundError, ValueError) as e:
        raise CliError(str(e) + (f"; {fetched}" if fetched else "")) from None
    for k, p in paths.items():
        print(f"{k}: {p}")
    return 0
