"""RR diagnostics as a cached stage (docs/methods.md#relative-repairability-crbn-rr): Ray tasks, one per prunable
layer, content-addressed Parquet.

A diagnostics table is computed only for cells whose pruner needs one (pruners with ``diagnostic_settings``:
raw_shift, repair_residual, rr), once per distinct identity (model digest, calibration digest, scope, grid,
images, τ rule), and reused by every later sweep on the same store:
``<store root>/diagnostics/<key>.parquet`` (``<store.uri>/diagnostics/`` when the store is remote, so every node
reads them without a shared file system) with columns ``tasks.pruning.rr.COLUMNS``; the Parquet metadata holds the
identity and the Ray node ids that computed it (``healsweep.nodes``). The sweep logs each table as an
artifact of its parent run (``diagnostics/<model>.parquet``) with the tag ``diagnostics_key.<model>``.
"""
from __future__ import annotations

import json
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

import pyarrow as pa
import pyarrow.parquet as pq
import ray

from orchestrator.raytune.resources import ray_task
from orchestrator.spec import registries
from orchestrator.spec.plan import DIAGNOSTICS_KIND, Cell
from tasks.store import KEY_RE, StoreError, content_key
from tasks.store.fs import StoreFS

SCHEMA = pa.schema([("model", pa.string()), ("layer", pa.string()), ("n_weights", pa.int64()),
                    ("shape", pa.string()), ("sparsity", pa.float64()), ("D_raw", pa.float64()),
                    ("D_repair", pa.float64()), ("R", pa.float64())])


@dataclass
class DiagnosticsResult:
    keys: dict[str, str] = field(default_factory=dict)  # cell_id -> diagnostics key
    models: dict[str, list[str]] = field(default_factory=dict)  # model -> keys (sweep order)
    computed_layers: int = 0  # layer tasks run by this call (0 when everything was cached)
    seconds: float = 0.0

    def tables(self, root: str | Path) -> dict[str, dict[str, list]]:
        """{cell_id: columnar table} for PruneContext.diagnostics."""
        cache: dict[str, dict] = {}
        return {cid: cache.setdefault(k, load_table(root, k)) for cid, k in self.keys.items()}


def table_name(key: str) -> str:
    if not KEY_RE.match(key):
        raise StoreError(f"invalid diagnostics key {key!r}")
    return f"{key}.parquet"


def table_path(root: Path, key: str) -> Path:
    """A table's path under a local root."""
    return Path(root) / table_name(key)


def _fs(root: str | Path) -> StoreFS:
    return StoreFS(root)


def has_table(root: str | Path, key: str) -> bool:
    return _fs(root).size(table_name(key)) is not None


def read_table(root: str | Path, key: str) -> pa.Table:
    raw = _fs(root).read_bytes(table_name(key))
    if raw is None:
        raise StoreError(f"diagnostics table {key} not found in {root}")
    return pq.read_table(pa.BufferReader(raw))


def load_table(root: str | Path, key: str) -> dict[str, list]:
    return read_table(root, key).to_pydict()


def diagnostics_identity(cell: Cell, model_digest: str, calib_digest: str) -> dict[str, Any] | None:
    """What determines a cell's diagnostics table, or None when its pruner reads none (no torch: the registries'
    table, orchestrator/spec/registries.py)."""
    settings = registries.diagnostic_settings(registries.get("pruner", cell.pruner), cell.pruner_settings)
    if settings is None:
        return None
    return {"kind": DIAGNOSTICS_KIND, "model": cell.model, "model_digest": model_digest,
            "calibration": calib_digest, "scope": cell.scope, **settings}


def diagnostics_layer(model: str, cache_dir: str, data_seed: int, scope: str, index: int, grid: list[float],
                      n_images: int, tau: str, threads: int, at: str = "conv", load_kw: dict | None = None
                      ) -> list[dict]:
    """One Ray task: every candidate sparsity of one prunable layer (layer input captured once). Each row carries
    the Ray node id that computed it (``node_id``, dropped before writing; recorded in the table's metadata)."""
    import torch

    from tasks.models import get_adapter, load_model
    from tasks.pruning.rr import layer_diagnostics

    torch.set_num_threads(max(1, threads))
    lm = load_model(model, cache_dir, data_seed=data_seed, progress=False, **(load_kw or {}))
    entry = get_adapter(lm.model).scope(lm.model, scope)[index]
    images = lm.dataset["calibration"].images[:n_images]
    rows = layer_diagnostics(lm.model, entry, images, grid, tau=tau, at=at)
    node = ray.get_runtime_context().get_node_id()
    return [dict(r, model=model, node_id=node) for r in rows]


def _write(root: str | Path, key: str, rows: list[dict], ident: Mapping[str, Any]) -> None:
    nodes = sorted({r.pop("node_id", None) or "" for r in rows} - {""})
    table = pa.Table.from_pylist(rows, schema=SCHEMA).replace_schema_metadata(
        {"healsweep.identity": json.dumps(ident, sort_keys=True), "healsweep.nodes": json.dumps(nodes)})
    buf = pa.BufferOutputStream()
    pq.write_table(table, buf)
    _fs(root).write_atomic(table_name(key), buf.getvalue())  # atomic: a table is complete or absent


def _layer_count(model: str, scope: str, load_kw: Mapping[str, Any]) -> int:
    """Prunable layers of ``model``'s ``scope``, from its architecture on the meta device (no weights, no download:
    a timm, torchvision or checkpoint model too; it asked the reference registry for every model)."""
    from tasks.models import ModelRef, build_untrained, get_adapter

    ref = ModelRef(**(load_kw.get("source") or {"name": model}))
    skeleton = build_untrained(ref, device="meta")
    return len(get_adapter(skeleton).scope(skeleton, scope))


def diagnostics_stage(cells: list[Cell], models: Mapping[str, Any], root: str | Path, cache_dir: str | Path,
                      data_seed: int, threads: int = 1, gpus: float = 0.0,
                      load_kw: Mapping[str, dict] | None = None) -> DiagnosticsResult:
    """Make sure every diagnostics table the cells need exists under ``root`` (a directory or a store URI);
    compute only missing ones, one Ray task per layer (``gpus`` per task: placement only, the layer statistics
    are computed on the CPU). ``load_kw``: {model: load_model kwargs} (a reference model's checkpoint path).
    Tables already there are found without torch; a model skeleton is built only for a missing one."""
    t0 = time.perf_counter()
    res = DiagnosticsResult()
    idents: dict[str, tuple[Cell, dict]] = {}
    for c in cells:
        ident = diagnostics_identity(c, models[c.model].digest, models[c.model].calib_digest)
        if ident is None:
            continue
        key = content_key(ident)
        res.keys[c.cell_id] = key
        if key not in idents:
            idents[key] = (c, ident)
            res.models.setdefault(c.model, []).append(key)
    jobs: dict[Any, str] = {}
    for key, (c, ident) in idents.items():
        if has_table(root, key):
            continue
        for i in range(_layer_count(c.model, c.scope, (load_kw or {}).get(c.model, {}))):
            ref = ray_task(diagnostics_layer, threads, gpus).remote(
                c.model, str(cache_dir), data_seed, c.scope, i, ident["grid"], ident["diag_images"], ident["tau"],
                threads, ident["at"], dict((load_kw or {}).get(c.model, {})))
            jobs[ref] = key
    rows: dict[str, list[list[dict]]] = {}
    order = list(jobs)
    for ref, out in zip(order, ray.get(order) if order else []):  # re-raises a task's error; keeps layer order
        rows.setdefault(jobs[ref], []).append(out)
    for key, parts in rows.items():
        _write(root, key, [r for part in parts for r in part], idents[key][1])
    res.computed_layers = len(jobs)
    res.seconds = time.perf_counter() - t0
    return res


def log_diagnostics(client, parent_run_id: str, root: Path, res: DiagnosticsResult) -> None:
    """Parent-run artifacts ``diagnostics/<model>.parquet`` (suffix ``-<key[:8]>`` from a model's second
    table on) and tags ``diagnostics_key.<model>`` (comma-separated keys when a model has several)."""
    for model, keys in res.models.items():
        client.set_tag(parent_run_id, f"diagnostics_key.{model}", ",".join(keys))
        for i, key in enumerate(keys):
            with tempfile.TemporaryDirectory() as d:
                name = f"{model}.parquet" if i == 0 else f"{model}-{key[:8]}.parquet"
                dst = Path(d) / name
                dst.write_bytes(_fs(root).read_bytes(table_name(key)))
                client.log_artifact(parent_run_id, str(dst), "diagnostics")


def log_lamp_allocations(client, parent_run_id: str, root: Path, res: DiagnosticsResult, weights_of,
                         targets) -> None:
    """Parent-run artifacts ``diagnostics/<model>.lamp.json``: {target: {layer: sparsity}} of LAMP over the layers
    of the model's diagnostics table. The analysis side never loads weights, so LAMP (which needs them) is
    computed here once and read back by the report's CTS section. ``weights_of(model) -> {param: tensor}``."""

    from tasks.pruning.allocation_math import lamp_sparsities

    for model, keys in res.models.items():
        layers = list(dict.fromkeys(load_table(root, keys[0])["layer"]))
        params = weights_of(model)
        w = {ly: params[ly] for ly in layers}
        alloc = {f"{t:.4f}": lamp_sparsities(w, float(t)) for t in targets}
        with tempfile.TemporaryDirectory() as d:
            dst = Path(d) / f"{model}.lamp.json"
            dst.write_text(json.dumps(alloc, sort_keys=True))
            client.log_artifact(parent_run_id, str(dst), "diagnostics")
