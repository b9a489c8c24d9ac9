"""The Ray Tune function trainable around ``tasks.trial.run_trial``: per-epoch checkpoints, restart from
the last checkpoint after a failure (Tune ``FailureConfig.max_failures``), and diverged trials ended cleanly.

Checkpoints are written only as often as retries need: at most one per ``HEALSWEEP_CHECKPOINT_INTERVAL_S``
seconds of the trial (default 10; 0: after every epoch), so a retry repeats at most that much healing and a
short trial writes none (each one costs a ``torch.save``, Tune's copy into the run directory and an
experiment-state snapshot).

Results go to Tune only when something needs them: the final result, a checkpoint, or every epoch when a
scheduler decides on intermediate results (ASHA: ``epoch_selection``). A function trainable's report blocks
until the driver's controller loop has taken the result (Ray 2.60: ``synchronous_result_reporting``), so a
report per epoch cost a driver round trip per epoch (a 64-step trial on 64 images has 32 epochs). The epochs in
between travel with the next report as ``epoch_history`` (numeric metrics per epoch), and the MLflow callback
logs them at their epoch steps as before.

A checkpoint is one ``state.pt`` (``torch.save``; read back with ``weights_only=True``) holding the healed
prunable weights, the healer loop state (optimizer, cosine schedule, epoch, losses) and that epoch's metrics.
A trial whose loss or weights become NaN/Inf (``HealingDiverged``) is deterministic: retrying it would diverge
again, so it is not raised to Tune (which would retry it) but reported as a last result with ``final``,
``diverged`` and ``failure_reason``; the driver marks its MLflow run FAILED and tells Optuna FAIL. A full disk
(ENOSPC) is not the trial's fault: it is reported as a last result with ``disk_full`` (the path and bytes needed),
the driver stops the sweep in one line and leaves the trial untold, so ``--resume`` runs it again.
"""
from __future__ import annotations

import importlib
import os
import tempfile
import time
from pathlib import Path
from typing import Callable

import torch

from tasks.atomic import DiskFullError, is_disk_full
from tasks.errors import UNSEEN_NODE, RunDirUnseen
from tasks.healing import HealingDiverged
from tasks.trial import TrialParams, run_trial, weights_home

STATE_FILE = "state.pt"
DEFAULT_CHECKPOINT_INTERVAL_S = 10.0


def checkpoint_interval() -> float:
    return float(os.environ.get("HEALSWEEP_CHECKPOINT_INTERVAL_S", DEFAULT_CHECKPOINT_INTERVAL_S))


def _checkpoint_home(tune) -> str:
    """Where Tune persists this trial's checkpoints: its directory in the run's Tune storage (DIR/tune/NAME/TRIAL;
    Ray's StorageContext, a developer API), else the trial's local directory."""
    try:
        return tune.get_context().get_storage().trial_fs_path
    except Exception:  # noqa: BLE001 - only names the path in the full disk's line
        return tune.get_context().get_trial_dir()


def _send_checkpoint(tune, send: Callable, metrics: dict, state: dict) -> None:
    """``send`` with ``state`` as a Tune checkpoint, which Tune copies into the trial's directory under the run
    directory (DIR/tune/...); a full disk there names that directory (Tune's error names no path)."""
    with tempfile.TemporaryDirectory(prefix="healsweep-ckpt-") as d:
        torch.save(state, Path(d) / STATE_FILE)
        try:
            send(metrics, checkpoint=tune.Checkpoint.from_directory(d))
        except Exception as e:  # noqa: BLE001 - a full disk gets its line; anything else is raised again
            if not is_disk_full(e):
                raise
            size = (Path(d) / STATE_FILE).stat().st_size
            raise DiskFullError(_checkpoint_home(tune), size, "a trial's Tune checkpoint") from e


def tune_trainable(config: dict) -> None:
    import ray
    from ray import tune

    for module in config.get("plugins", ()):  # registers the spec's custom pruners/healers in this worker
        importlib.import_module(module)
    fields = TrialParams.__dataclass_fields__
    params = TrialParams(**{k: v for k, v in config.items() if k in fields})
    node = ray.get_runtime_context().get_node_id()
    try:
        weights_home(params)  # before its checkpoint is read: a node that could not keep the weights refuses it
    except RunDirUnseen as e:  # the node's id, for the driver's node guard (orchestrator/raytune/trial_faults.py)
        raise RunDirUnseen(f"{e} {UNSEEN_NODE.format(node)}") from None
    start = None
    ckpt = tune.get_checkpoint()
    if ckpt is not None:
        with ckpt.as_directory() as d:
            start = torch.load(Path(d) / STATE_FILE, map_location="cpu", weights_only=True)
    last = {"epoch": int(start["last"]["epoch"]) if start else 0,
            "selection_acc": float(start["last"].get("selection_acc", 0.0)) if start else 0.0}

    history: list[dict] = []  # epochs not yet sent to Tune (module docstring: one round trip per trial)

    def send(metrics: dict, **kw) -> None:
        done = {"finished_at": time.time()} if metrics.get("final") else {}  # node clock, s: when it ended there
        tune.report({**metrics, **done, "epoch_history": list(history), "resumed_from_epoch": last_start,
                     "node_id": node}, **kw)
        history.clear()

    def report(metrics: dict) -> None:
        last.update({k: metrics[k] for k in last if k in metrics})
        if metrics.get("final") or params.epoch_selection:  # a scheduler (ASHA) decides on every epoch's result
            send(metrics)
        else:
            history.append({k: v for k, v in metrics.items() if isinstance(v, (int, float))})

    interval, since = checkpoint_interval(), [time.monotonic()]

    def checkpoint(metrics: dict, state: dict) -> None:
        if time.monotonic() - since[0] < interval:  # not due yet: a plain report
            report(metrics)
            return
        since[0] = time.monotonic()
        last.update({k: metrics[k] for k in last if k in metrics})
        _send_checkpoint(tune, send, metrics, state)

    last_start = last["epoch"]
    try:
        run_trial(params, report, start=start, checkpoint=checkpoint)
    except HealingDiverged as e:
        # selection_acc/epoch repeat the last reported values: Tune requires the metric in every result.
        send({**last, "final": True, "diverged": True, "failure_reason": f"HealingDiverged: {e}"})
    except Exception as e:  # noqa: BLE001 - a full disk (module docstring); anything else is raised again
        if not is_disk_full(e):
            raise
        send({**last, "final": True, "disk_full": str(e), "failure_reason": f"disk full: {e}",
              "disk_full_path": getattr(e, "path", None) or getattr(e, "filename", None) or "",
              "disk_full_needed": getattr(e, "needed", 0) or 0, "disk_full_what": getattr(e, "what", None) or ""})
