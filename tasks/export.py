"""Healed weights of a trial and their export: the healed model (safetensors), its mask, a model card.

``save_healed`` (called by ``run_trial``) keeps only what healing changed, the scoped parameters, in
``<run dir>/trials/<trial_key>/healed.safetensors`` next to ``trial.json`` (the trial's parameters and final
results). ``export_trial`` rebuilds the dense model from its source, puts the healed parameters in, checks the
mask, and writes ``model.safetensors`` (the full state dict: loadable by ``timm.create_model(...,
pretrained=False)`` + ``load_state_dict``), ``mask.safetensors``, ``model_card.json`` and ``model_card.md``.
"""
from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any, Mapping

import torch
import torch.nn as nn
from safetensors.torch import load_file, save_file

from tasks.models.adapter import get_adapter
from tasks.models.base import MODEL_SOURCES, MODELS, ModelRef
from tasks.models.load import load_model
from tasks.pruning.base import achieved_sparsity, mask_violations
from tasks.pruning.masks import MaskStore

HEALED = "healed.safetensors"
TRIAL_JSON = "trial.json"


def _atomic(path: Path, write) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
    os.close(fd)
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        Path(tmp).unlink(missing_ok=True)


def _save_tensors(path: Path, tensors: Mapping[str, torch.Tensor], meta: Mapping[str, str] | None = None) -> None:
    data = {k: v.detach().to("cpu").contiguous() for k, v in tensors.items()}
    _atomic(path, lambda tmp: save_file(data, tmp, metadata=dict(meta or {})))


def _save_text(path: Path, text: str) -> None:
    _atomic(path, lambda tmp: Path(tmp).write_text(text))


def save_healed(trial_dir: Path, model: nn.Module, entries, params: Mapping[str, Any], final: Mapping[str, Any]) -> Path:
    """Write the healed scoped parameters and trial.json; returns the weights path."""
    sd = model.state_dict()
    names = sorted({e.param for e in entries})
    _save_tensors(trial_dir / HEALED, {n: sd[n] for n in names}, {"format": "healsweep-healed/1"})
    _save_text(trial_dir / TRIAL_JSON, json.dumps({"params": dict(params), "final": dict(final)}, indent=1,
                                                  default=str, sort_keys=True))
    return trial_dir / HEALED


def dense_model(params: Mapping[str, Any]) -> nn.Module:
    """The trial's dense model from its source (no dataset is loaded for timm/torchvision/checkpoint models)."""
    src = dict(params.get("load_kw") or {}).get("source")
    if src and src.get("source", "reference") != "reference":
        ref = ModelRef(**src)
        return MODEL_SOURCES.get(ref.source).load(ref)

    return load_model(params["model"], params["cache_dir"], data_seed=params.get("data_seed", 0), progress=False).model


def reload_recipe(params: Mapping[str, Any]) -> dict:
    """How to rebuild the architecture for the exported weights (timm / torchvision / reference class)."""
    src = dict(params.get("load_kw") or {}).get("source")
    if src and src.get("source") != "reference":
        arch = src.get("arch") or src["name"]
        lib, _, arch = arch.rpartition(":") if src["source"] == "checkpoint" else (src["source"], "", arch)
        kw = dict(src.get("model_args") or {})
        if src.get("num_classes") is not None:
            kw["num_classes"] = src["num_classes"]
        return {"library": lib or "timm", "arch": arch, "kwargs": kw, "pretrained": False}

    s = MODELS.get(params["model"])
    return {"library": "healsweep-reference", "arch": params["model"], "kwargs": dict(s.arch),
            "builder": f"{s.build.__module__}.{s.build.__name__}"}


def export_trial(trial_dir: Path, out: Path, run_info: Mapping[str, Any] | None = None) -> dict[str, Path]:
    """Rebuild the healed model of a finished trial and write it, its mask and a model card to ``out``."""
    trial_dir, out = Path(trial_dir), Path(out)
    if not (trial_dir / HEALED).is_file():
        raise FileNotFoundError(f"{trial_dir}: no {HEALED} (the trial did not finish, or ran before healed "
                                f"weights were saved)")
    rec = json.loads((trial_dir / TRIAL_JSON).read_text())
    params, final = rec["params"], rec["final"]
    model = dense_model(params)
    healed = load_file(str(trial_dir / HEALED))
    missing = sorted(set(healed) - set(model.state_dict()))
    if missing:
        raise ValueError(f"{trial_dir}: healed parameter {missing[0]!r} is not in the rebuilt model")
    model.load_state_dict(healed, strict=False)
    masks = MaskStore(params["mask_root"]).load(params["mask_key"])
    bad = mask_violations(model, masks)
    if bad:
        raise ValueError(f"{trial_dir}: {bad} masked weights are nonzero in the healed weights")

    entries = get_adapter(model).scope(model, params["scope"])
    info = dict(run_info or {})
    card = {
        "format": "healsweep-model-card/1",
        "model": params["model"], "source": dict(params.get("load_kw") or {}).get("source") or {"source": "reference"},
        "model_digest": final.get("model_digest"), "reload": reload_recipe(params),
        "pruner": info.get("pruner"), "pruner_settings": info.get("pruner_settings"), "scope": params["scope"],
        "sparsity": float(info["sparsity"]) if info.get("sparsity") is not None else None,
        "achieved_sparsity": achieved_sparsity(entries, masks),
        "healer": params["healer"], "healer_settings": params.get("healer_settings"), "lr": params["lr"],
        "epochs": params["epochs"], "batch_size": params["batch_size"], "calib_size": params["calib_size"],
        "calib_digest": final.get("calib_digest"), "eval_digest": final.get("eval_digest"),
        "dataset": dict(params.get("load_kw") or {}).get("dataset") or {"name": "digits"},
        "accuracy": {k: final.get(k) for k in ("dense_acc", "pruned_acc", "healed_acc", "retention")},
        "mlflow_run_id": info.get("run_id"), "trial_key": params.get("trial_key"),
    }
    out.mkdir(parents=True, exist_ok=True)
    paths = {"model": out / "model.safetensors", "mask": out / "mask.safetensors", "card_json": out / "model_card.json",
             "card_md": out / "model_card.md"}
    _save_tensors(paths["model"], model.state_dict(), {"format": "pt", "healsweep": json.dumps(card["reload"])})
    _save_tensors(paths["mask"], {k: v.to(torch.uint8) for k, v in masks.items()}, {"format": "healsweep-mask/1"})
    _save_text(paths["card_json"], json.dumps(card, indent=1, default=str))
    _save_text(paths["card_md"], card_markdown(card))
    return paths


def card_markdown(card: Mapping[str, Any]) -> str:
    acc = card["accuracy"]
    pct = lambda v: "n/a" if v is None else f"{100 * float(v):.2f}%"  # noqa: E731
    r = card["reload"]
    lines = [
        f"# {card['model']}: pruned with {card['pruner']}, healed with {card['healer']}", "",
        f"- source: `{json.dumps(card['source'], default=str)}` (weights digest `{card['model_digest']}`)",
        f"- pruner: {card['pruner']} {card['pruner_settings'] or ''}, scope {card['scope']}, sparsity "
        f"{card['sparsity']} (achieved {card['achieved_sparsity']:.4f})",
        f"- healer: {card['healer']} {card['healer_settings'] or ''}, lr {card['lr']:.3g}, {card['epochs']} epochs, "
        f"batch {card['batch_size']}",
        f"- calibration: {card['calib_size']} images, digest `{card['calib_digest']}`; evaluation digest "
        f"`{card['eval_digest']}`; dataset `{json.dumps(card['dataset'], default=str)}`",
        f"- accuracy (evaluation split): dense {pct(acc['dense_acc'])}, pruned {pct(acc['pruned_acc'])}, healed "
        f"{pct(acc['healed_acc'])}, retention {pct(acc['retention'])}",
        f"- MLflow run `{card['mlflow_run_id']}`, trial `{card['trial_key']}`", "",
        "## Load", "", "```python",
        "from safetensors.torch import load_file",
    ]
    if r["library"] == "timm":
        lines += ["import timm", f"model = timm.create_model({r['arch']!r}, pretrained=False, **{r['kwargs']!r})"]
    elif r["library"] == "torchvision":
        lines += ["import torchvision", f"model = torchvision.models.get_model({r['arch']!r}, weights=None, **{r['kwargs']!r})"]
    else:
        lines += [f"from {r['builder'].rsplit('.', 1)[0]} import {r['builder'].rsplit('.', 1)[1]}",
                  f"model = {r['builder'].rsplit('.', 1)[1]}({r['kwargs']!r})"]
    lines += ['model.load_state_dict(load_file("model.safetensors"))', "```", ""]
    return "\n".join(lines)
