"""The trainable the driver hands to Ray Tune: a torch-free name for ``orchestrator.raytune.trainable.tune_trainable``.

Tune takes a function trainable by reference (its module and name), so the driver imports the module that defines
it. The trainable itself imports torch and the trial code (tasks.trial, tasks.healing) at its top; this entry
imports it where a trial starts, in the trial's actor (once per actor process, before its first trial, as before),
so a driver over a warm store and model cache never imports torch (issue #35)."""
from __future__ import annotations


def tune_trainable(config: dict) -> None:
    """One trial: ``orchestrator.raytune.trainable.tune_trainable`` (checkpoints, restarts, diverged trials)."""
    from orchestrator.raytune.trainable import tune_trainable as run  # torch and tasks/: in the trial's actor

    run(config)
