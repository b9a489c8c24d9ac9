"""The user-facing errors of tasks/ that a driver catches (a leaf, standard library only): a driver that never loads a
model or a dataset (a warm store and model cache) names them in its ``except`` clauses without importing
tasks.models or tasks.data, whose package faces import torch. Each is re-exported where it is raised."""
from __future__ import annotations

import re


class ModelSourceError(ValueError):
    """A user-facing, one-line error about a model source (unknown name, missing weights, offline cache miss).
    ``field``: the key of the spec's model entry it is about (``str(e)`` then reads ``field: message``), so that a
    spec check can name it as ``models[i].field`` like every other key."""

    def __init__(self, message: str, field: str | None = None):
        super().__init__(f"{field}: {message}" if field else message)
        self.field, self.message = field, message


class DatasetError(ValueError):
    """A user-facing, one-line error about a dataset's files (missing folder, table column or split, too few
    items, unreadable file): the CLI prints it as ``healsweep: error: ...`` (exit 2), never a traceback."""


class RunDirUnseen(RuntimeError):
    """A trial on a node that does not see the driver's run directory while its healed weights must go there (the
    store is not remote, so there is no ``healed/`` to put them in): it refuses to start, rather than heal and leave
    the weights on that node's own disk. The driver (orchestrator/raytune/trial_faults.py) takes it as a fault of
    the node: the node guard names and fences it, the trial runs again elsewhere."""


UNSEEN_NODE = "[node {}]"  # appended to a RunDirUnseen's message by the trainable: the Ray node id it happened on


def unseen_node(text: str) -> str | None:
    """The node id a RunDirUnseen's message names (``UNSEEN_NODE``), or None."""
    m = re.search(r"\[node ([0-9a-f]{8,})\]", text)
    return m.group(1) if m else None


def first_line(e: BaseException, limit: int = 200) -> str:
    """An exception's first non-blank line, stripped and cut to ``limit`` characters, or its type's name when its
    message is empty (``str(e).splitlines()[0]`` raised IndexError inside the very ``except`` that called it)."""
    for line in str(e).splitlines():
        if line.strip():
            return line.strip()[:limit]
    return type(e).__name__
