"""A spec plugin (imported by the driver and every trial process) that kills the trial process in the middle of
its first write of healed weights: the project's real ``atomic_write`` has created its temporary file and written
part of it when the process gets SIGKILL, so the temporary file stays behind as after a real crash. Only the
first such write of a run directory is killed (a marker file in it); the retry writes normally."""
from __future__ import annotations

import os
import signal
from pathlib import Path

import tasks.export

_real = tasks.export.atomic_write


def _killing_write(path, write, *args, **kwargs):
    path = Path(path)
    marker = path.parents[2] / "killed-mid-write"  # <run dir>/trials/<trial id>/healed.safetensors
    if path.name != "healed.safetensors" or marker.exists():
        return _real(path, write, *args, **kwargs)
    marker.write_text(f"{os.getpid()}\n")

    def half_then_die(tmp: str) -> None:
        with open(tmp, "wb") as f:
            f.write(b"\0" * 65536)
            f.flush()
            os.fsync(f.fileno())
        os.kill(os.getpid(), signal.SIGKILL)
    return _real(path, half_then_die, *args, **kwargs)


tasks.export.atomic_write = _killing_write
