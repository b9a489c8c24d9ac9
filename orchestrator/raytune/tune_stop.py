"""The Tune stopper of an interrupted sweep (orchestrator/rundir/interrupt.py): a module of its own because it imports
Ray Tune at the top (Tune pickles its stopper with the experiment: the class must be importable by name)."""
from __future__ import annotations

from ray import tune

from orchestrator.rundir import faults, interrupt


class InterruptStopper(tune.Stopper):
    """Ends the whole experiment once the driver received SIGINT/SIGTERM, or met a fault it cannot go on with (a
    trial record that could not be written: orchestrator/rundir/faults.py): Tune suggests no new trial and stops the
    running ones (their trials stay untold in the journal, so a resume runs them again)."""

    def __call__(self, trial_id, result) -> bool:
        return False

    def stop_all(self) -> bool:
        return interrupt.received() is not None or faults.stopped() is not None
