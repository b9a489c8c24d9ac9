"""Ctrl-C (SIGINT) and SIGTERM on a sweep's driver: the sweep stops, says so and stays resumable.

The first signal asks the sweep to stop. Before the trials start it raises ``SweepInterrupted`` where the driver
is (the stage is abandoned, like a KeyboardInterrupt); once the trials run it only records the signal: Ray Tune
then stops through ``orchestrator.raytune.tune_stop.InterruptStopper`` (no new trial; running ones are stopped, untold, and run again from
scratch by ``healsweep run --resume``), and the sweep still writes its MLflow summary and its report, both
marked partial, before it exits with 128 + the signal number (130 for SIGINT, 143 for SIGTERM). A second signal
gets the handler that was there before (Python's KeyboardInterrupt, Ray's SIGTERM handler): it ends at once.

Tune's own SIGINT handler is switched off (``TUNE_DISABLE_SIGINT_HANDLER``): it would replace ours during
``fit`` and let the sweep end as if complete. The state is module-level so the stopper, which Tune pickles with
its experiment, needs no reference to it (this module imports neither Ray nor Tune).
"""
from __future__ import annotations

import os
import signal
import threading
from contextlib import contextmanager

SIGNALS = (signal.SIGINT, signal.SIGTERM)
_state: dict = {"signum": None, "raising": False, "previous": {}, "run_dir": None, "continue": None, "depth": 0}


class SweepInterrupted(KeyboardInterrupt):
    """Raised in the driver's main thread by the first SIGINT/SIGTERM that arrives before the trials start."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def received() -> int | None:
    """The signal that interrupted the running sweep (None: not interrupted; reset when the outermost ``catching``
    ends)."""
    return _state["signum"]


def record(signum: int) -> None:
    """Note ``signum`` as the sweep's interrupt unless a signal is recorded already."""
    if _state["signum"] is None:
        _state["signum"] = signum


def exit_code(signum: int) -> int:
    """The shell's convention for a process ended by ``signum``: 130 for SIGINT, 143 for SIGTERM."""
    return 128 + int(signum)


def _handle(signum, frame) -> None:
    _state["signum"] = signum
    for sig, prev in _state["previous"].items():  # a second signal ends the process the usual way
        signal.signal(sig, prev)
    if _state["raising"]:
        raise SweepInterrupted(signum)


@contextmanager
def catching():
    """Hold the SIGINT/SIGTERM handlers for a sweep (main thread only; elsewhere a no-op) and restore the previous
    ones on exit. Inside, ``raising()`` marks the stages a signal abandons.

    Nested: a command that runs several sweeps (``run`` with widening rounds) holds them over all of them, so a
    signal between two sweeps is recorded like one during a sweep (the next sweep then ends at once, marked
    partial), not a KeyboardInterrupt wherever it lands. Each sweep's own ``catching`` (after ``ray.init``, which
    installs Ray's SIGTERM handler) installs ours again and keeps the outer one's state; only the outermost resets
    it on exit."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    outer = _state["depth"] == 0
    if outer:
        os.environ["TUNE_DISABLE_SIGINT_HANDLER"] = "1"  # read by Tune at each fit()
        _state.update(signum=None, raising=False, previous={})
    if _state["signum"] is None:  # (after a first signal the previous handlers are in place: a second one ends it)
        for sig in SIGNALS:
            if (held := signal.getsignal(sig)) is not _handle:  # the caller's, or one installed since (Ray's)
                _state["previous"][sig] = held
            signal.signal(sig, _handle)
    _state["depth"] += 1
    try:
        yield
    finally:
        _state["depth"] -= 1
        if outer:
            for sig, prev in _state["previous"].items():
                if prev is not None:
                    signal.signal(sig, prev)
            _state.update(signum=None, raising=False, previous={})  # the sweep's result holds the signal


@contextmanager
def raising():
    """A signal inside raises ``SweepInterrupted`` (one that came earlier raises on entry)."""
    if _state["signum"] is not None:
        raise SweepInterrupted(_state["signum"])
    _state["raising"] = True
    try:
        yield
    finally:
        _state["raising"] = False


def opened(run_dir, command: str | None = None) -> None:
    """A sweep recorded itself in ``run_dir`` (sweep.json): an interrupt that escapes the sweep's own handling from
    here on (Ctrl-C while Ray starts for ``refine``, a KeyboardInterrupt raised inside Ray) names how to go on:
    ``command`` (a refine round: ``healsweep refine DIR``), else ``healsweep run --resume DIR``."""
    _state["run_dir"], _state["continue"] = run_dir, command


def escaped_line() -> str:
    """The CLI's line for a KeyboardInterrupt no sweep handled: with the resume command once a sweep was opened."""
    if _state["run_dir"] is None:
        return "healsweep: interrupted"
    how = _state["continue"] or f"healsweep run --resume {_state['run_dir']}"
    return f"healsweep: interrupted; {'continue' if _state['continue'] else 'resume'} with {how}"


def line(finished: int, planned: int | None, failed: int, run_dir) -> str:
    """The one line an interrupted sweep prints (``planned`` 0/None: it stopped before its trials were planned)."""
    extra = f" ({failed} failed)" if failed else ""
    resume = f"resume with healsweep run --resume {run_dir}"
    if not planned:
        return f"interrupted before the trials started ({finished} finished earlier{extra}); {resume}"
    return f"interrupted: {finished} of {planned} trials finished{extra}; {resume}"
