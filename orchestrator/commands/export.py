"""healsweep export RUN_ID --out DIR: the healed model of one trial (safetensors), its mask and a model card."""
from __future__ import annotations

import json
from pathlib import Path

from orchestrator.commands.common import CliError


def add_parser(sub):
    p = sub.add_parser("export", help="write a trial's healed model, mask and model card",
                       description="Export the healed model of the trial whose MLflow run id is RUN_ID: "
                                   "DIR/model.safetensors (full state dict), DIR/mask.safetensors, "
                                   "DIR/model_card.json and DIR/model_card.md.")
    p.add_argument("run_id", metavar="RUN_ID", help="MLflow run id of a finished trial (a child run)")
    p.add_argument("--out", metavar="DIR", required=True, help="output directory")
    p.add_argument("--run-dir", metavar="DIR", help="the sweep's run directory (holds sweep.json and trials/)")
    p.add_argument("--tracking-uri", metavar="URI", help="MLflow tracking URI (default: the run directory's)")
    p.set_defaults(func=main)
    return p


def resolve(run_dir: str | None, tracking_uri: str | None) -> tuple[Path, str]:
    """-> (run directory, tracking URI) from whichever of the two was given."""
    if run_dir:
        d = Path(run_dir)
        if not (d / "sweep.json").is_file():
            raise CliError(f"--run-dir {d}: not a run directory (no sweep.json)")
        return d, tracking_uri or json.loads((d / "sweep.json").read_text())["tracking_uri"]
    if tracking_uri and tracking_uri.startswith("sqlite:///"):
        d = Path(tracking_uri[len("sqlite:///"):]).parent
        if (d / "sweep.json").is_file():
            return d, tracking_uri
    raise CliError("give --run-dir DIR (the sweep's run directory); --tracking-uri alone works only for the "
                   "sqlite database inside a run directory")


def main(args) -> int:
    from mlflow import MlflowClient
    from mlflow.exceptions import MlflowException

    from tasks.export import export_trial

    run_dir, uri = resolve(args.run_dir, args.tracking_uri)
    try:
        run = MlflowClient(uri).get_run(args.run_id)
    except MlflowException:
        raise CliError(f"run {args.run_id!r} not found in {uri}") from None
    if run.data.tags.get("healsweep.role") != "trial":
        raise CliError(f"run {args.run_id!r} is not a trial run (tag healsweep.role != 'trial')")
    if run.info.status != "FINISHED":
        raise CliError(f"run {args.run_id!r} did not finish (status {run.info.status})")
    info = {**run.data.params, "run_id": args.run_id}
    try:
        paths = export_trial(run_dir / "trials" / run.data.tags["trial_id"], Path(args.out), info)
    except (FileNotFoundError, ValueError) as e:
        raise CliError(str(e)) from None
    for k, p in paths.items():
        print(f"{k}: {p}")
    return 0
