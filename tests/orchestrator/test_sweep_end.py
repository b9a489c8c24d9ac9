"""The end of a sweep: the report thread's failure reaches the caller, the console script's fast exit keeps
buffered output, atexit handlers and the exit code, and Ray's shutdown survives Ray objects freed meanwhile."""
from __future__ import annotations

import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def test_report_written_in_the_background_raises_its_error_on_join(tmp_path):
    from orchestrator.sweep.console import StageClock
    from orchestrator.sweep.end import start_report

    clock = StageClock(enabled=False)
    join = start_report(tmp_path, clock)  # no sweep.json: write_report fails in the thread
    with pytest.raises(FileNotFoundError):
        join()
    assert "report" in clock.seconds  # the failed stage is still timed


def test_exit_now_flushes_output_runs_atexit_and_keeps_the_code(tmp_path):
    marker = tmp_path / "atexit.txt"
    code = textwrap.dedent(f"""
        import atexit, sys
        from orchestrator.cli import exit_now
        atexit.register(lambda: open({str(marker)!r}, "w").write("ran"))
        print("x" * 5000)  # stdout is a pipe: block-buffered, lost without a flush
        print("on stderr", file=sys.stderr)
        exit_now(3)
        print("never")
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=60)
    assert proc.returncode == 3
    assert proc.stdout == "x" * 5000 + "\n"
    assert proc.stderr == "on stderr\n"
    assert marker.read_text() == "ran"


RELEASE_DURING_SHUTDOWN = textwrap.dedent("""
    import gc, sys, threading, time
    import ray
    ray.init(address="local", num_cpus=1, include_dashboard=False, log_to_driver=False)

    class Cycle:  # cyclic garbage holding an ObjectRef, as a finished Tune fit leaves behind
        def __init__(self, ref):
            self.ref, self.me = ref, self

    refs = [ray.put(i) for i in range(20000)]
    gc.set_threshold(5, 1, 1)  # frequent automatic collections, like a thread busy with pandas and matplotlib

    def report_thread():  # young ObjectRef cycles become garbage while Ray shuts down; the collector frees them
        while refs:
            Cycle(refs.pop())
            [[] for _ in range(10)]
            time.sleep(0.0001)

    threading.Thread(target=report_thread, daemon=True).start()
    time.sleep(0.1)
    if sys.argv[1] == "ray.shutdown":
        ray.shutdown()
    else:
        from orchestrator.sweep.end import shutdown_ray
        shutdown_ray()
    print("shut down", len(refs) > 0, flush=True)
""")


@pytest.mark.e2e
@pytest.mark.timeout(300)
def test_shutdown_ray_survives_ray_objects_freed_by_another_thread():
    """The mechanism behind sweeps that ended with 'The core worker has already been shutdown' and no report:
    an ObjectRef freed by another thread's garbage collection while ``ray.shutdown()`` tears the core worker
    down ends the process (exit 1). ``sweep_end.shutdown_ray`` collects first and keeps the collector off until
    the shutdown returns. The plain call is run too, to show the script does hit the window."""
    import os

    env = dict(os.environ, PYTHONPATH=str(REPO), RAY_USAGE_STATS_ENABLED="0")
    runs = {how: subprocess.run([sys.executable, "-c", RELEASE_DURING_SHUTDOWN, how], capture_output=True,
                                text=True, cwd=REPO, timeout=240, env=env)
            for how in ("ray.shutdown", "shutdown_ray")}
    plain, ours = runs["ray.shutdown"], runs["shutdown_ray"]
    assert plain.returncode == 1 and "already been shutdown" in plain.stderr, (plain.returncode, plain.stderr[-800:])
    assert "shut down" not in plain.stdout
    assert ours.returncode == 0, ours.stderr[-2000:]
    assert ours.stdout == "shut down True\n"  # still releasing ObjectRefs when the shutdown returned
    assert "already been shutdown" not in ours.stderr


def test_first_signal_stops_the_sweep_second_one_gets_the_previous_handler():
    """orchestrator/rundir/interrupt.py: before the trials a signal raises SweepInterrupted where the driver is; during
    the trials it is only recorded (Tune's stopper reads it); a second signal gets the handler from before."""
    import os
    import signal

    from orchestrator.rundir import interrupt

    seen = []
    previous = signal.signal(signal.SIGTERM, lambda s, f: seen.append(s))
    before_int = signal.getsignal(signal.SIGINT)  # Python's default_int_handler, or SIG_IGN when started in the background
    try:
        with interrupt.catching():
            assert os.environ["TUNE_DISABLE_SIGINT_HANDLER"] == "1" and interrupt.received() is None
            with pytest.raises(interrupt.SweepInterrupted) as e, interrupt.raising():
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(1)  # the handler runs in this thread before the sleep returns
            assert e.value.signum == signal.SIGTERM and interrupt.received() == signal.SIGTERM
            os.kill(os.getpid(), signal.SIGTERM)  # the second one: the handler from before, not ours
            time.sleep(0.2)
            assert seen == [signal.SIGTERM]
            with pytest.raises(interrupt.SweepInterrupted):  # stages entered after the signal do not run
                with interrupt.raising():
                    pytest.fail("ran a stage after the interrupt")
        assert signal.getsignal(signal.SIGINT) is before_int  # restored as it was
        with interrupt.catching():  # a new sweep starts uninterrupted; a signal outside raising() is recorded
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.2)
            assert interrupt.received() == signal.SIGINT
        assert interrupt.received() is None  # the next sweep (e.g. a widening round) starts uninterrupted
        assert (interrupt.exit_code(signal.SIGINT), interrupt.exit_code(signal.SIGTERM)) == (130, 143)
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_a_command_holding_the_signals_over_several_sweeps_keeps_one_between_them():
    """``run`` with widening rounds holds ``catching`` over its sweeps: a SIGINT between two of them is recorded
    (it raised a KeyboardInterrupt wherever it landed), the next sweep's stages do not start, a handler installed
    meanwhile (ray.init's SIGTERM) is what a second signal gets, and only the outermost exit restores and resets."""
    import os
    import signal

    from orchestrator.rundir import interrupt

    seen = []
    before_int, before_term = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    try:
        with interrupt.catching():
            with interrupt.catching():  # the sweep
                pass
            assert signal.getsignal(signal.SIGINT) is not before_int  # still held between the sweeps
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.2)
            assert interrupt.received() == signal.SIGINT
            signal.signal(signal.SIGTERM, lambda s, f: seen.append(s))  # ray.init of the next round
            with interrupt.catching():  # the widening round: the signal is kept, its stages abandoned
                assert interrupt.received() == signal.SIGINT
                with pytest.raises(interrupt.SweepInterrupted), interrupt.raising():
                    pytest.fail("a stage ran after the interrupt")
            assert interrupt.received() == signal.SIGINT
        assert interrupt.received() is None and signal.getsignal(signal.SIGINT) is before_int
        with interrupt.catching():
            signal.signal(signal.SIGTERM, lambda s, f: seen.append(-s))  # Ray's, installed before the inner one
            with interrupt.catching():
                os.kill(os.getpid(), signal.SIGTERM)  # ours: recorded
                time.sleep(0.2)
                os.kill(os.getpid(), signal.SIGTERM)  # the second: Ray's
                time.sleep(0.2)
        assert seen == [-signal.SIGTERM]
    finally:
        signal.signal(signal.SIGINT, before_int)
        signal.signal(signal.SIGTERM, before_term)


def test_interrupted_line():
    from orchestrator.rundir.interrupt import line

    assert line(15, 24, 0, "/r/tiny") == "interrupted: 15 of 24 trials finished; resume with healsweep run --resume /r/tiny"
    assert line(15, 24, 2, "d") == "interrupted: 15 of 24 trials finished (2 failed); resume with healsweep run --resume d"
    assert line(3, 0, 0, "d") == "interrupted before the trials started (3 finished earlier); resume with healsweep run --resume d"


def test_ctrl_c_outside_a_sweep_is_one_line_and_130(capsys, monkeypatch):
    """A KeyboardInterrupt before a sweep's own handling (spec check, Ray start-up): one line, exit 130."""
    import argparse

    from orchestrator import cli

    def interrupted(args):
        raise KeyboardInterrupt

    parser = argparse.ArgumentParser()
    parser.set_defaults(func=interrupted)
    monkeypatch.setattr(cli, "build_parser", lambda: parser)
    assert cli.main([]) == 130
    assert capsys.readouterr().err == "healsweep: interrupted\n"


def test_ctrl_c_after_a_sweep_recorded_itself_names_the_resume(capsys, monkeypatch, tmp_path):
    """Once a sweep wrote sweep.json (orchestrator/sweep/run.py open_sweep), a KeyboardInterrupt that escapes its
    own handling (Ctrl-C while Ray starts for refine) says how to continue; the next command starts without it."""
    import argparse

    from orchestrator import cli
    from orchestrator.rundir import interrupt

    def opened_then_interrupted(args):
        interrupt.opened(tmp_path / "run")
        raise KeyboardInterrupt

    parser = argparse.ArgumentParser()
    parser.set_defaults(func=opened_then_interrupted)
    monkeypatch.setattr(cli, "build_parser", lambda: parser)
    assert cli.main([]) == 130
    assert capsys.readouterr().err == f"healsweep: interrupted; resume with healsweep run --resume {tmp_path / 'run'}\n"

    def interrupted(args):
        raise KeyboardInterrupt

    parser.set_defaults(func=interrupted)
    assert cli.main([]) == 130
    assert capsys.readouterr().err == "healsweep: interrupted\n"

    def refine_opened_then_interrupted(args):  # a refine round: refine continues it (run --resume would not)
        interrupt.opened(tmp_path / "run", f"healsweep refine {tmp_path / 'run'}")
        raise KeyboardInterrupt

    parser.set_defaults(func=refine_opened_then_interrupted)
    assert cli.main([]) == 130
    assert capsys.readouterr().err == f"healsweep: interrupted; continue with healsweep refine {tmp_path / 'run'}\n"
