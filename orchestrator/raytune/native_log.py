"""Ray's C++ core logs to the driver's file descriptor 2 while ``ray.init`` attaches to a cluster: a refused token
or a GCS that does not answer prints one ``[2026-11-30 22:31:03,781 W 28682 28682] gcs_client.cc:210: ...`` line
per retry (~20 over ~21 s) before healsweep's one-line error, with ``--quiet`` too. Python's logging settings do not
reach them (the core writes to the descriptor), so :func:`held_native_lines` points descriptor 2 at a temporary
file for the attach and, afterwards, writes back every line that is not such a core line (what another thread of
the driver printed meanwhile: stage lines, notes) in its order. Only for attaching: ``ray.init`` of a local
instance starts the GCS and raylet, which would inherit the temporary file as their stderr.
"""
from __future__ import annotations

import contextlib
import os
import re
import sys
import tempfile
from typing import Iterator

# '[2026-11-30 22:31:03,781 W 28682 28682] gcs_client.cc:210: ...': Ray's C++ log prefix (time, level, pid, tid)
NATIVE_LINE = re.compile(rb"^\[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} [DIWEF] \d+ \d+\] ")


def kept_lines(held: bytes) -> bytes:
    """The bytes of ``held`` minus Ray's C++ log lines (a last line without its newline is kept as it is)."""
    return b"".join(ln for ln in held.splitlines(keepends=True) if not NATIVE_LINE.match(ln))


@contextlib.contextmanager
def held_native_lines(enabled: bool = True) -> Iterator[None]:
    """Descriptor 2 into a temporary file while the block runs; then everything but Ray's C++ log lines written
    back to the real stderr. A no-op when not ``enabled`` (``--verbose``) or when stderr has no descriptor."""
    try:
        fd = sys.stderr.fileno() if enabled else -1
    except (AttributeError, OSError, ValueError):  # a stderr replaced by an object without a descriptor
        fd = -1
    if fd != 2:
        yield
        return
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as tmp:
        os.dup2(tmp.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            tmp.seek(0)
            rest = kept_lines(tmp.read())
            if rest:
                os.write(2, rest)
