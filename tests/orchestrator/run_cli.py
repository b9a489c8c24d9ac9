"""Run the real ``healsweep`` console script (the one installed next to this interpreter) in a subprocess,
with this checkout first on PYTHONPATH, as a user would."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
HEALSWEEP = Path(sys.executable).with_name("healsweep")


def env(**extra: str) -> dict:
    e = dict(os.environ)
    e["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, [e.get("PYTHONPATH")])])
    e.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    e.update(extra)
    return e


def healsweep(*args: str, cwd: Path | str | None = None, timeout: float = 600, **extra_env: str):
    """-> CompletedProcess (text stdout/stderr) of ``healsweep ARGS``."""
    return subprocess.run([str(HEALSWEEP), *map(str, args)], cwd=cwd, env=env(**extra_env), capture_output=True,
                          text=True, timeout=timeout)


def shell(command: str, cwd: Path | str, timeout: float = 600, **extra_env: str):
    """Run one documented command line (README, docs/) through bash, with the venv's scripts first on PATH."""
    e = env(**extra_env)
    e["PATH"] = os.pathsep.join([str(HEALSWEEP.parent), e.get("PATH", "")])
    return subprocess.run(["bash", "-c", command], cwd=cwd, env=e, capture_output=True, text=True, timeout=timeout)


@contextmanager
def lock_held(run_dir: Path, role: str = ""):
    """Another live process holding ``run_dir``'s lock as a sweep's driver (``role`` ""), or as ``healsweep doctor
    --repair`` ("doctor"), does (orchestrator/rundir/files.py lock_run_dir); -> its Popen (killed on exit)."""
    code = ("import sys, time; from pathlib import Path; from orchestrator.rundir.files import lock_run_dir; "
            "lock_run_dir(Path(sys.argv[1]), role=sys.argv[2]); print('locked', flush=True); time.sleep(600)")
    holder = subprocess.Popen([sys.executable, "-c", code, str(run_dir), role], cwd=REPO, env=env(),
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        yield holder
    finally:
        os.kill(holder.pid, signal.SIGKILL)
        holder.wait()
        holder.stdout.close()
