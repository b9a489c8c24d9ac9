"""A spec plugin (imported by the driver and every trial process) under which the first trial of a run directory
that writes its healed weights raises a plain Python exception there instead (a marker file in the run directory);
the retry writes normally. What a user's own bug in a healer or a plugin looks like to the sweep."""
from __future__ import annotations

from pathlib import Path

import tasks.export

_real = tasks.export.atomic_write
MESSAGE = "planned failure of the first attempt"


def _raising_write(path, write, *args, **kwargs):
    path = Path(path)
    marker = path.parents[2] / "raised-once"  # <run dir>/trials/<trial id>/healed.safetensors
    if path.name != "healed.safetensors" or marker.exists():
        return _real(path, write, *args, **kwargs)
    marker.write_text("1\n")
    raise RuntimeError(MESSAGE)


tasks.export.atomic_write = _raising_write
