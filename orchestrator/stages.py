"""Stages that run before the trials: reference models, the sharded dense pass (orchestrator.dense), masks."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

from orchestrator.dense import dense_stage  # noqa: F401  (re-exported: the sharded dense stage)
from orchestrator.plan import Cell, targets_identity
from orchestrator.spec import SweepSpec
from tasks.healing import LOGITS
from tasks.models import get_adapter, load_model
from tasks.pruning import MaskStore, PruneContext, make_masks
from tasks.store import content_key


@dataclass(frozen=True)
class ModelInfo:
    name: str
    digest: str
    dense_acc: float
    scope: str
    blocks: tuple[str, ...]
    targets_key: str
    calib_digest: str


def prepare_models(spec: SweepSpec, cache_dir: Path, progress: bool = True) -> dict[str, ModelInfo]:
    """Load (training on first use) every model of the sweep in the driver; derive its target-store key."""
    out = {}
    for name in spec.models:
        lm = load_model(name, cache_dir, data_seed=spec.data_seed, progress=progress, **spec.load_kwargs(name))
        adapter = get_adapter(lm.model)
        blocks = [b for b, _ in adapter.blocks(lm.model)] + [LOGITS]
        calib_digest = lm.dataset.split_digest("calibration")
        key = content_key(targets_identity(name, lm.digest, lm.dataset.digest, calib_digest, blocks, spec.store.dtype))
        out[name] = ModelInfo(name, lm.digest, float(lm.info["dense_eval_acc"]),
                              spec.scope.get(name, adapter.default_scope), tuple(blocks), key, calib_digest)
    return out


def mask_stage(cells: list[Cell], models: Mapping[str, ModelInfo], mask_root: Path, cache_dir: Path,
               data_seed: int, diagnostics: Mapping[str, Mapping] | None = None,
               load_kw: Mapping[str, dict] | None = None) -> dict[str, str]:
    """Compute each distinct mask once (content-addressed); return {cell_id: mask_key}.
    ``diagnostics``: {cell_id: RR diagnostics table} from orchestrator.diagnostics, for the pruners that read one;
    ``load_kw``: {model: load_model kwargs} for non-reference model sources."""
    masks = MaskStore(mask_root)
    out: dict[str, str] = {}
    loaded = {}
    for c in cells:
        ident = c.mask_identity(models[c.model].digest, models[c.model].calib_digest)
        key = content_key(ident)
        out[c.cell_id] = key
        if masks.has(key):
            continue
        if c.model not in loaded:
            loaded[c.model] = load_model(c.model, cache_dir, data_seed=data_seed, progress=False,
                                         **(load_kw or {}).get(c.model, {}))
        lm = loaded[c.model]
        adapter = get_adapter(lm.model)
        entries = adapter.scope(lm.model, c.scope)
        diag = {"rr": diagnostics[c.cell_id]} if diagnostics and c.cell_id in diagnostics else {}
        diag["ranking_dir"] = (str(Path(cache_dir) / "rankings") if "://" in str(mask_root)  # [cluster] local
                               else str(Path(mask_root).parent / "rankings"))  # cached elastic rankings (snapvit)
        ctx = PruneContext(lm.model, adapter, entries, calib_images=lm.dataset["calibration"].images[: c.calib_size],
                           diagnostics=diag)
        m = make_masks(lm.model, entries, c.pruner, c.sparsity, seed=c.seed, settings=c.pruner_settings, ctx=ctx)
        masks.save(key, m, ident)
    return out


def background(fn, *args):
    """Run ``fn(*args)`` in a thread while the next stages run; the returned callable joins it and returns
    its result (re-raising its error)."""
    import threading

    box: dict = {}

    def target():
        try:
            box["value"] = fn(*args)
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread by join()
            box["error"] = e

    th = threading.Thread(target=target, name="healsweep-prepare", daemon=True)
    th.start()

    def join():
        th.join()
        if "error" in box:
            raise box["error"]
        return box["value"]
    return join


def open_tracking(uri: str, experiment: str):
    """The MLflow client with its experiment ready (a new SQLite store creates its tables: seconds), opened
    while the models, dense and mask stages run."""
    from mlflow import MlflowClient

    from orchestrator.tracking import experiment_id

    client = MlflowClient(uri)
    experiment_id(client, experiment)
    return client


def warm_workers(n: int, cpus: float) -> list:
    """``n`` Ray tasks that import the trial code (torch, timm, tasks.*) in pooled worker processes while the
    driver runs its stages; Tune's trial actors then start in warm processes. -> refs to wait on."""
    import ray

    @ray.remote
    def warm() -> bool:
        import orchestrator.trainable  # noqa: F401

        return True

    return [warm.options(num_cpus=cpus).remote() for _ in range(n)]
