"""Content-addressed, sharded target store for dense block targets.

A *key* (``content_key`` of whatever determines the targets) names one directory under the store root::

    <root>/<key>/shard-00000.arrow   Arrow IPC file: one column per block, FixedSizeList<uint16>[prod(shape)]
    <root>/<key>/shard-00000.json    sidecar: the shard info, written right after the shard (used for resume)
    <root>/<key>/manifest.json       written LAST: schema, block names/shapes, dtype, row count, calibration
                                     rows, shards (row ranges, bytes, sha256), producer versions
    <root>/<key>/verified.json       the last passing check of each shard (sha, size, mtime): a record only
    <root>/<key>/last_use            ISO time of the latest open (``healsweep store ls`` / ``gc``)
    <root>/<key>/lock                writer lock (fcntl, local filesystems)

Row ``i`` is calibration item ``i``; each shard holds a contiguous row range; a larger calibration size
appends shards. Values are the raw 16-bit patterns of float16 / bfloat16 tensors, so round trips are
bit-exact. Files are written under a temporary name and moved into place. The root is a local directory
or any ``pyarrow.fs`` URI / FileSystem. No pickle anywhere.

Integrity policy (no shortcuts): every ``open`` (one per trial) and every dense stage (``ensure_targets``) hashes
the sha256 of each shard it will read; a size/mtime match is never trusted (bit rot keeps both). A manifest must
be readable and its shards must tile exactly [0, num_rows). A damaged shard or manifest found by the dense stage
is moved to ``<root>/.quarantine/`` and recomputed (an integrity event for MLflow); ``healsweep store verify``
runs the same checks over every key. A reader also refuses an epoch that streams fewer rows than it was opened
for (``TargetReader.rows_streamed`` records each epoch's count).

This face imports no torch: keys, checks, verification and ``ensure_targets`` on a complete key need none, so a
driver over a warm store stays light. Torch is imported where values are: ``TargetStore.write_shard`` and
``TargetStore.open`` (its ``tasks.store.reader.TargetReader`` hands out tensors; ``tasks.store.codec``).
"""
from tasks.store.build import EnsureResult, ensure_targets
from tasks.store.core import TargetStore
from tasks.store.format import FORMAT, KEY_RE, StoreError, canonical_json, content_key, producer_versions
from tasks.store.masks import MaskStore

__all__ = ["FORMAT", "KEY_RE", "canonical_json", "content_key", "producer_versions", "StoreError", "TargetStore",
           "EnsureResult", "ensure_targets", "MaskStore"]
