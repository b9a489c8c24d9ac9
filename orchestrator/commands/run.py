"""healsweep run SPEC: validate, then run the sweep and write its report (or --resume DIR to continue one)."""
from __future__ import annotations

import argparse
import os
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path

from orchestrator.commands.common import (DEFAULT_HOME, CliError, interrupted_exit, load_spec_or_exit, not_a_dir,
                                          report_lines, summary_lines)
from orchestrator.lifecycle.continuation import RefineError
from orchestrator.lifecycle.resume import check_resumable, note, nothing_to_resume, prepare_resume, weights_note
from orchestrator.lifecycle.widen import run_widening
from orchestrator.raytune.cluster import ClusterError, check_store_uri, connect  # light: no ray import
from orchestrator.rundir import faults, interrupt
from orchestrator.rundir.files import (ResumeError, interrupted_round, lock_run_dir, probe_run_dir, read_sweep,
                                       record_complete)
from orchestrator.spec.dry_run import DRY_SIZES
from orchestrator.spec.reach import check_server
from orchestrator.sweep.background import background
from orchestrator.tracking.retry import retryable
from orchestrator.tracking.store import relocate
from orchestrator.sweep.console import StageClock, process_age, quiet_libraries
from tasks.errors import DatasetError, ModelSourceError  # no torch: a warm sweep loads no model and no dataset


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("run", help="validate a sweep spec, run it and write its report",
                       description="Validate SPEC, load the models, cache dense block targets in "
                                   "the store (Ray tasks), run every trial (Ray Tune + per-cell Optuna), log to "
                                   "MLflow and write DIR/report.html and DIR/report.md. With --resume DIR, continue "
                                   "the sweep of DIR after its driver died: finished trials are not run again.")
    p.add_argument("spec", nargs="?", help="sweep spec (YAML), e.g. configs/default.yaml (not with --resume)")
    p.add_argument("--out", metavar="DIR", help="run directory (default: runs/<spec name>)")
    p.add_argument("--resume", metavar="DIR", help="continue the sweep recorded in run directory DIR")
    p.add_argument("--retry-failed", action="store_true",
                   help="with --resume: run the sweep's failed trials again (those that raised or met a full disk; "
                        "a diverged trial is its configuration's result and is kept); their new MLflow runs replace "
                        "the failed ones")
    p.add_argument("--store", metavar="DIR",
                   help=f"target/mask store root, shared across sweeps (default: {DEFAULT_HOME / 'store'}; "
                        f"with --dry-run: DIR/store)")
    p.add_argument("--cache", metavar="DIR",
                   help=f"reference model cache (default: {DEFAULT_HOME / 'models'})")
    p.add_argument("--address", help="Ray cluster address: HOST:PORT of the head's GCS, or 'auto' (the cluster this "
                                    "machine belongs to; printed); default: a fresh local Ray. ray:// is refused")
    p.add_argument("--num-cpus", type=int, help="CPUs for the local Ray instance (default: all)")
    p.add_argument("--cpu-only", action="store_true", help="ignore the spec's GPU requests and its device: run every task on CPU")
    p.add_argument("--resources", metavar="K=V,...",
                   help="override the spec's resources, keys cpu, gpu (per trial), dense_cpu, dense_gpu; e.g. cpu=1,gpu=0")
    p.add_argument("--no-report", action="store_true", help="skip writing the report at the end")
    p.add_argument("--quiet", action="store_true", help="no progress bars and no stage lines")
    p.add_argument("--verbose", action="store_true",
                   help="also show Ray, Tune and MLflow output (warnings, experiment tables, artifact bars)")
    p.add_argument("--offline", action="store_true",
                   help="no downloads (sets HF_HUB_OFFLINE=1): pretrained weights and datasets must be cached")
    p.add_argument("--dry-run", action="store_true",
                   help="check SPEC's every stage here, before its real run: the same architectures, scopes, "
                        "sparsities, pruners and healers with random-init weights on a generated image folder at "
                        f"the models' input size ({DRY_SIZES['calibration']} calibration, {DRY_SIZES['selection']} "
                        f"selection, {DRY_SIZES['evaluation']} evaluation images), one 1-epoch trial "
                        "per cell, CPU only, offline; into runs/<name>-dry-run (orchestrator/spec/dry_run.py)")
    p.set_defaults(func=main)
    return p


def main(args) -> int:
    if getattr(args, "offline", False):
        os.environ["HF_HUB_OFFLINE"] = os.environ["HF_DATASETS_OFFLINE"] = "1"  # inherited by Ray workers

    quiet_libraries(args.verbose)  # before Ray/Tune/MLflow are imported
    started = time.perf_counter()
    clock = StageClock(enabled=not args.quiet)
    clock.add("imports", process_age())
    _precheck(args)
    if args.resume and not (args.retry_failed and retryable(Path(args.resume))) and \
            (done := nothing_to_resume(Path(args.resume))) is not None:
        return _complete_already(Path(args.resume), *done, report=not args.no_report)
    spec, out, store, cache, models, owns_ray = _resolve_while_ray_starts(args, clock)
    try:
        res = _run(args, spec, out, store, cache, clock, owns_ray, models)
    except Exception as e:
        if not faults.follows_fault(e):  # else the fault's line, raised below, names the first write that failed
            raise
    finally:
        _shutdown_ray(owns_ray)  # run_sweep shuts it down itself unless it failed before its own try

    faults.raise_stopped()  # a fault that stopped the trials (a full disk under the record): one line, exit 1
    if res.interrupted is None:  # every trial and widening round ran: a resume of it has nothing to start
        record_complete(out, res.trials_finished + res.trials_failed)
    # the command's wall time (Ray's start, widening rounds and the report included): the sweep's own figure
    # (res.seconds, from its trials' start) read as the run's duration and was half of it
    print(summary_lines(res.sweep_id, res.trials_finished, res.trials_failed, res.dense_forward_images,
                        time.perf_counter() - started, res.tracking_uri))
    if res.report:
        print(report_lines(res.report))
    _retry_hint(out, res.trials_failed)
    return interrupted_exit(res) or (0 if res.trials_failed == 0 else 1)  # SIGINT/SIGTERM: one line, 128 + signal


def _retry_hint(out: Path, failed: int) -> None:
    """After a sweep with failed trials: how to run again those a retry would (not the diverged ones)."""
    if failed and (n := retryable(out)):
        note(f"{n} failed trial(s) can run again: healsweep run --resume {out} --retry-failed")


def _complete_already(out: Path, finished: int, failed: int, report: bool) -> int:
    """``run --resume`` of a sweep that ended complete: no Ray, no dense stage; the summary lines of a run (0 dense
    images) and the report rewritten (the analysis may be newer than the sweep). Exit 0: nothing failed here."""
    t0 = time.perf_counter()
    relocate(out)  # a copied or moved run directory: its own SQLite store, as a resume that runs trials
    info = read_sweep(out)
    print(f"healsweep: {out}: the sweep ended complete and its files are unchanged since: nothing to resume "
          f"(healsweep refine {out} searches further)", file=sys.stderr)
    if line := weights_note(out):
        note(line)
    paths = None
    if report:
        from analysis.report import write_report

        paths = write_report(out)
    print(summary_lines(info["sweep_id"], finished, failed, 0, time.perf_counter() - t0, info["tracking_uri"]))
    if paths:
        print(report_lines(paths))
    _retry_hint(out, failed)
    return 0


def _resolve_while_ray_starts(args, clock) -> tuple:
    """After ``_precheck`` (flags, paths, the spec file's YAML: a one-line error before Ray), the spec's
    full check (method registries, compatibility verdicts: torch imports, ~1.5-3 s) and, on a local instance, the
    models stage (timm import, checkpoint load, ~2 s) run in a thread while this thread starts Ray (~3 s). Ray is
    shut down again when the spec is refused; MLflow's modules are then imported aside (``_import_mlflow_aside``).
    Measured on 2 cores (configs/tiny.yaml, quiet): the trials start ~2-4 s sooner than with the three one after
    another.
    -> (spec, run dir, store dir, model cache, models or None, whether this call started Ray)."""


    def resolve():
        t0 = time.perf_counter()
        try:
            spec, out, store, cache = _resolve(args)
        finally:
            clock.add("spec", time.perf_counter() - t0)
        models = None if args.address else _models(spec, store, cache, clock, not args.quiet)
        _import_sweep_modules()
        _import_mlflow_aside()
        return spec, out, store, cache, models
    resolved = background(resolve)
    try:
        where = f"attaching to {args.address}" if args.address else "starting a local instance"
        with clock.stage("ray", f"ray: {where} (while the spec is checked)"):
            started = connect(args.address, None if args.address else args.num_cpus, verbose=args.verbose)
    except ClusterError as e:
        raise CliError(str(e)) from None
    try:
        return (*resolved(), started)
    except BaseException:
        _shutdown_ray(started)
        raise


def _models(spec, store: Path, cache: Path, clock, progress: bool) -> dict:
    """The models stage of a sweep on a local instance (orchestrator/sweep/run.py takes them as ``models``)."""
    from orchestrator.sweep.run import models_line
    from orchestrator.sweep.stages import prepare_models, store_paths

    try:
        with clock.stage("models", models_line(spec, on_cluster=False)):
            return prepare_models(spec, store_paths(spec.store.uri, store.resolve(), cache.resolve())["cache"],
                                  progress=progress)
    except (ModelSourceError, DatasetError) as e:  # a checkpoint changed since the spec check (digest,
        raise CliError(str(e)) from None  # truncation), a dataset's files (missing split, too few images): one line


def _import_sweep_modules() -> None:
    """What the sweep needs before Tune starts (Optuna, Ray Tune ~1 s, SciPy's QMC for the search's first wave
    ~0.5 s), imported while Ray starts instead of after it. MLflow (~1.7 s) is not among them: it is imported
    aside (``_import_mlflow_aside``), and nothing before Tune's start waits for it."""
    import optuna  # noqa: F401
    from scipy.stats import qmc  # noqa: F401  (orchestrator.search.lattice.sobol_points)

    import orchestrator.search  # noqa: F401  (ray.tune.search)
    import orchestrator.tracking.logger  # noqa: F401


def _import_mlflow_aside():
    """MLflow's client and SQL store modules (~1.7 CPU-s: SQLAlchemy, Alembic, the ORM mappers) imported in a thread
    of their own, started once the spec is checked: Ray's start leaves a core idle for ~1-2 s on 2 cores (its
    processes wait on each other) and this fills it. Without it the parent stage imports them while Tune starts
    the trial actors, whose own imports already keep every core busy (orchestrator/sweep/parent.py). Nothing
    waits for this thread: the parent stage's import waits on the import lock for whatever is left. A failed
    import is left to raise where MLflow is used. -> the thread (not a daemon: exit waits for an import)."""

    def imports() -> None:
        try:
            import mlflow.store.tracking.sqlalchemy_store  # noqa: F401
            from mlflow import MlflowClient  # noqa: F401
        except Exception:  # noqa: BLE001 - raised again, with its context, by the parent stage's import
            pass
    th = threading.Thread(target=imports, name="healsweep-mlflow-imports")
    th.start()
    return th


def _shutdown_ray(started: bool) -> None:
    if started:
        import ray

        if ray.is_initialized():
            ray.shutdown()


def _precheck(args) -> None:
    """The checks that need neither the spec's registries nor Ray: flags, paths, --resources, the spec file's
    registry-free checks (spec.parse.check_plain; or the --resume record), and the run directory neither holding
    another sweep nor held by a live driver: CliError (one line) before Ray starts."""
    from orchestrator.raytune.resources import parse_override
    from orchestrator.spec import SpecError
    from orchestrator.spec.parse import check_plain

    if args.num_cpus is not None and args.num_cpus < 1:
        raise CliError(f"--num-cpus must be >= 1, got {args.num_cpus}")
    for flag, value in (("--out", args.out), ("--resume", args.resume), ("--store", args.store),
                        ("--cache", args.cache)):
        if value and (why := not_a_dir(value)):
            raise CliError(f"{flag}: {why}")
    try:
        override = parse_override(args.resources) if args.resources else {}
        if args.cpu_only and any(override.get(k) for k in ("gpus_per_trial", "gpus_per_dense_task")):  # gpu=0 agrees
            raise CliError("--cpu-only runs every task on the CPU: give it or --resources gpu=/dense_gpu= above 0, "
                           "not both")
        if args.retry_failed and not args.resume:
            raise CliError("--retry-failed runs the failed trials of a sweep: give it with --resume DIR")
        if args.resume:
            if args.spec or args.out or args.dry_run:
                raise CliError("--resume DIR takes no SPEC, --out or --dry-run: the sweep's spec and paths are in DIR")
            info = read_sweep(Path(args.resume))
            if last := interrupted_round(info):
                raise CliError(f"refine round {last.get('round')} of {args.resume} did not finish: continue it with "
                               f"healsweep refine {args.resume} (run --resume resumes the main grid only)")
            _same_paths(args, info)
            check_server(info["tracking_uri"], f"{Path(args.resume) / 'sweep.json'}: tracking_uri")
            probe_run_dir(Path(args.resume), resume=True)
            check_resumable(Path(args.resume))  # a damaged database, journal or record: one line before Ray
        elif not args.spec:
            raise CliError("run: give a SPEC file, or --resume DIR")
        else:
            name = check_plain(_spec_mapping(args, data_root=None, check=True), Path(args.spec).resolve().parent)[1]
            probe_run_dir(Path(args.out or Path("runs") / name), resume=False)
    except (SpecError, ResumeError) as e:
        raise CliError(str(e)) from None


def _same_paths(args, info: dict) -> None:
    """--store and --cache with --resume: the sweep's own (recorded in sweep.json) or refused (they were ignored)."""
    for flag, given, key in (("--store", args.store, "store"), ("--cache", args.cache, "cache")):
        if given and Path(given).resolve() != Path(str(info.get(key))).resolve():
            raise CliError(f"{flag} {given}: this sweep's {key} is {info.get(key)} (its sweep.json), which --resume "
                           f"uses; leave {flag} out")


def _resolve(args) -> tuple:
    """(spec, run dir, store dir, model cache) from the arguments or a resumed run dir; CliError when bad."""
    from orchestrator.raytune.resources import override_resources
    from orchestrator.spec import SpecError, parse_spec

    store, cache = Path(args.store or DEFAULT_HOME / "store"), Path(args.cache or DEFAULT_HOME / "models")
    try:
        if args.resume:
            out = Path(args.resume)
            info = read_sweep(out)
            spec = parse_spec(info["spec"])
            store, cache = Path(info["store"]), Path(info["cache"])
        elif args.dry_run:
            spec, out = _dry_run(args)
            store = Path(args.store or out / "store")
        else:
            spec = load_spec_or_exit(args.spec)
            out = Path(args.out or Path("runs") / spec.name)
        spec = override_resources(spec, args.resources, args.cpu_only)
        check_store_uri(spec.store.uri)
        local = spec.store.uri and ("://" not in spec.store.uri or spec.store.uri.startswith("file://"))
        if local and (why := not_a_dir(spec.store.uri.removeprefix("file://"))):
            raise CliError(f"store.uri: {why}")  # else a traceback at the dense stage, the run directory half made
    except (SpecError, ResumeError, ClusterError) as e:
        raise CliError(str(e)) from None
    return spec, out, store, cache


def _spec_mapping(args, data_root: str | None, check: bool = False) -> dict:
    """SPEC's YAML mapping; with --dry-run rewritten for it (orchestrator/spec/dry_run.py), the spec as written
    checked first with ``check`` (what the rewrite replaces, as its real run would check it)."""
    from orchestrator.spec.dry_run import check_recipe, dry_run_spec
    from orchestrator.spec.load import read_spec_text, read_yaml

    raw = read_yaml(read_spec_text(args.spec))
    if args.dry_run and check:
        check_recipe(raw, Path(args.spec).resolve().parent)
    return dry_run_spec(raw, data_root) if args.dry_run else raw


def _dry_run(args) -> tuple:
    """(the dry run's spec, its run directory): the generated image folder is written to DIR/data at the models'
    input size, then the rewritten spec gets every check of a real one. SpecError when it is refused."""
    from orchestrator.spec import check_tracking, parse_spec
    from orchestrator.spec.dry_run import DRY_CALIB, DRY_SIZES, dry_classes, input_size, keeps_digits
    from tasks.data.synthetic import write_image_folder

    draft = _spec_mapping(args, data_root=None)
    out = Path(args.out or Path("runs") / draft["name"])
    data = out / "data"
    if not keeps_digits(draft):
        classes = dry_classes(draft)
        per_class = -(-(sum(DRY_SIZES.values()) + DRY_CALIB) // classes)  # room for a train split
        write_image_folder(data, classes, per_class, input_size(draft))
    spec = parse_spec(_spec_mapping(args, str(data.resolve())), base_dir=Path(args.spec).resolve().parent)
    check_tracking(spec)
    return spec, out


def _run(args, spec, out: Path, store: Path, cache: Path, clock, owns_ray: bool = False, models: dict | None = None):
    """The sweep, then its widening rounds when the spec asks for them (orchestrator/lifecycle/widen.py). One
    ``interrupt.catching`` holds the signals over all of them: a Ctrl-C between the sweep and a round (or two
    rounds) is recorded, and the next round ends at once, its parent run KILLED and partial."""
    from orchestrator.sweep.dense import StoreBudgetError
    from orchestrator.sweep.run import run_sweep

    try:
        widen = spec.search.widen  # extra rounds past the search boundary
        if args.resume:
            lock_run_dir(out)  # before its files are settled: no doctor --repair or second driver meanwhile
            trials = prepare_resume(out)  # damaged files: one line; torn last lines dropped; journal agrees with it
            if line := weights_note(out, trials):
                note(line)
        with interrupt.catching():
            res = run_sweep(spec, out, store, cache, address=args.address, progress=not args.quiet,
                            report=not args.no_report and not widen, num_cpus=args.num_cpus,
                            resume=bool(args.resume), verbose=args.verbose, clock=clock, owns_ray=owns_ray,
                            models=models, retry_failed=args.retry_failed)
            if widen and res.interrupted is None and faults.stopped() is None:  # a fault: no widening round
                rounds = run_widening(out, widen["rounds"], widen["factor"], address=args.address,
                                      progress=not args.quiet, num_cpus=args.num_cpus, report=not args.no_report,
                                      total=True)
                res = _widened(res, rounds, out, not args.no_report)
            elif widen and not args.no_report:  # interrupted before widening: the partial sweep's report
                res = _widened(res, [], out, True)
            if res.interrupted is None and (sig := interrupt.received()) is not None:  # after the last sweep (its
                res = replace(res, interrupted=sig)  # report, a round that found no cell): not ended complete
    except (ResumeError, StoreBudgetError, ClusterError, RefineError, ModelSourceError, DatasetError) as e:
        raise CliError(str(getattr(e, "cause", None) or e)) from None  # a Ray task's error: its cause's line
    return res


def _widened(res, rounds: list[dict], out: Path, report: bool):
    """The sweep's result with the widening rounds' trials added (and the report they rewrote)."""

    for d in (d for d in rounds if d.get("started", True)):
        print(f"widen round {d['round']}: {len(d['cells'])} cells on the search boundary searched past it")
    if not rounds:
        if report:
            from analysis.report import write_report

            return replace(res, report=write_report(out))
        return res
    last = rounds[-1]["result"]
    return replace(res, trials_finished=last.trials_finished, trials_failed=last.trials_failed,
                   trials_planned=last.trials_planned, interrupted=last.interrupted, report=rounds[-1].get("report"))
