"""Healed weights of a trial and their export: the healed model (safetensors), its mask, a model card.

``save_healed`` (called by ``run_trial``) keeps only what healing changed, the scoped parameters, in
``<run dir>/trials/<trial_id>/healed.safetensors`` next to ``trial.json`` (the trial's parameters and final
results). ``export_trial`` rebuilds the dense model from its source, puts the healed parameters in, checks the
mask, and writes ``model.safetensors`` (the full state dict), ``mask.safetensors``, ``model_card.json`` and
``model_card.md``. The card's code uses timm / torchvision / scikit-learn only (never this project): it rebuilds
the architecture, preprocesses the evaluation images as the trial did, and reproduces the logged accuracy.
Every exported file is world-readable (0644): an export is meant to be shared.
"""
from __future__ import annotations

import hashlib
import inspect
import json
import re
import shutil
import textwrap
from pathlib import Path
from typing import Any, Callable, Mapping

import torch
import torch.nn as nn
from safetensors.torch import load_file, save_file

from tasks.atomic import atomic_write
from tasks.errors import first_line
from tasks.healing.chain import resolve_healer
from tasks.model_card import card_markdown, parse_settings
from tasks.models.adapter import get_adapter
from tasks.models.base import MODEL_SOURCES, MODELS, ModelRef
from tasks.models.load import load_model
from tasks.pruning.base import achieved_sparsity, mask_digest, mask_violations
from tasks.saved_trial import HEALED, TRIAL_JSON, healed_problem
from tasks.store.masks import MaskStore

def _save_tensors(path: Path, tensors: Mapping[str, torch.Tensor], meta: Mapping[str, str] | None = None) -> None:
    data = {k: v.detach().to("cpu").contiguous() for k, v in tensors.items()}

    def write(tmp) -> None:
        save_file(data, tmp, metadata=dict(meta or {}))
        canonical_header(tmp)
    atomic_write(path, write)  # 0644: shared artefacts


def canonical_header(path) -> None:
    """Rewrite a safetensors file's JSON header with its keys sorted (in place, the same length): safetensors
    writes its metadata in hash-map order, which differs between processes, so two exports of one run differed
    in bytes. The data (and every offset into it) is unchanged."""
    with open(path, "r+b") as f:
        n = int.from_bytes(f.read(8), "little")
        head = json.loads(f.read(n))
        text = json.dumps(head, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()
        if len(text) > n:  # not safetensors' compact JSON: leave it as written
            return
        f.seek(8)
        f.write(text + b" " * (n - len(text)))  # safetensors pads its header with spaces too


def _save_text(path: Path, text: str) -> None:
    atomic_write(path, lambda tmp: Path(tmp).write_text(text))


def save_healed(trial_dir: Path, model: nn.Module, entries, params: Mapping[str, Any], final: Mapping[str, Any],
                extra: set[str] | frozenset = frozenset()) -> Path:
    """Write the healed scoped parameters, plus ``extra`` state the healer changed outside them (its ``may_change``:
    BatchNorm running statistics, folded biases), and trial.json; returns the weights path."""
    sd = model.state_dict()
    names = sorted({e.param for e in entries} | {n for n in extra if n in sd})
    _save_tensors(trial_dir / HEALED, {n: sd[n] for n in names}, {"format": "healsweep-healed/1"})
    _save_text(trial_dir / TRIAL_JSON, json.dumps({"params": dict(params), "final": dict(final)}, indent=1,
                                                  default=str, sort_keys=True))
    return trial_dir / HEALED


def _source(params: Mapping[str, Any]) -> dict | None:
    src = dict(params.get("load_kw") or {}).get("source")
    return src if src and src.get("source", "reference") != "reference" else None


def dense_model(params: Mapping[str, Any]) -> nn.Module:
    """The trial's dense model from its source (no dataset is loaded for timm/torchvision/checkpoint models)."""
    src = _source(params)
    if src:
        ref = ModelRef(**src)
        return MODEL_SOURCES.get(ref.source).load(ref)
    return load_model(params["model"], params["cache_dir"], data_seed=params.get("data_seed", 0), progress=False,
                      **dict(params.get("load_kw") or {})).model  # a reference model's checkpoint path, if any


def _function_code(fn: Callable, name: str) -> str:
    """The source of a self-contained function (imports inside it), renamed to ``name``."""
    code = textwrap.dedent(inspect.getsource(fn))
    return re.sub(rf"^def {re.escape(fn.__name__)}\(", f"def {name}(", code, count=1, flags=re.M)


def reload_recipe(params: Mapping[str, Any]) -> dict:
    """How to rebuild the architecture for the exported weights: library, arch, kwargs and plain code."""
    src = _source(params)
    if src:
        arch = src.get("arch") or src["name"]
        lib, _, arch = arch.rpartition(":") if src["source"] == "checkpoint" else (src["source"], "", arch)
        lib = lib or "timm"
        kw = dict(src.get("model_args") or {})
        if src.get("num_classes") is not None:
            kw["num_classes"] = src["num_classes"]
        code = (f"import timm\nmodel = timm.create_model({arch!r}, pretrained=False, **{kw!r})" if lib == "timm" else
                f"import torchvision\nmodel = torchvision.models.get_model({arch!r}, weights=None, **{kw!r})")
        return {"library": lib, "arch": arch, "kwargs": kw, "pretrained": False, "code": code}
    s = MODELS.get(params["model"])  # a reference model: its builder is plain timm code; the card carries it
    code = f"import torch.nn as nn\n\n\n{_function_code(s.build, 'build')}\n\nmodel = build({dict(s.arch)!r})"
    return {"library": "timm", "arch": params["model"], "kwargs": dict(s.arch), "code": code}


def preprocessing(params: Mapping[str, Any], model: nn.Module) -> dict:
    """The evaluation images as the trial saw them: for the digits, scikit-learn's images, the transform and the
    evaluation split's indices; for real models, the model's timm data config or torchvision weights' transforms."""
    src = _source(params)
    if src is None:
        from tasks.data.digits import DIGITS_TRANSFORM, digits_preprocess, load_digits

        data = load_digits(params.get("data_seed", 0))
        code = ("import numpy as np\nimport torch\nimport torch.nn.functional as F\nfrom sklearn.datasets import "
                f"load_digits\n\n\n{_function_code(digits_preprocess, 'preprocess')}\n\n"
                "digits = load_digits()  # scikit-learn's bundled 8x8 scans, grey levels 0..16\n"
                "idx = np.array(EVAL_INDICES)  # the evaluation split: indices into load_digits()\n"
                "images, labels = preprocess(digits.images[idx]), torch.from_numpy(digits.target[idx])")
        return {"transform": DIGITS_TRANSFORM, "code": code,
                "evaluation_indices": [int(i) for i in data["evaluation"].indices]}
    ref = ModelRef(**src)
    _, tid = MODEL_SOURCES.get(ref.source).transform(ref, model)
    kind, _, arg = tid.partition(":")
    if kind == "timm":
        cfg = {k: tuple(v) if isinstance(v, list) else v for k, v in json.loads(arg).items()}  # timm's own types
        code = (f"from timm.data import create_transform\ntransform = create_transform(**{cfg!r}, "
                f"is_training=False)  # the model's timm data config; apply to RGB PIL images")
    elif kind == "torchvision":
        code = (f"from torchvision.models import get_weight\ntransform = get_weight({arg!r}).transforms()"
                "  # apply to RGB PIL images")
    else:
        code = f"# preprocessing {tid!r}: see the sweep's dataset settings"
    return {"transform": tid, "code": code, "evaluation_indices": None}


def load_trial(trial_dir: Path) -> tuple[nn.Module, dict, dict, dict]:
    """-> (healed model, masks, trial params, final results) of a finished trial; checks the mask invariant."""
    if not (trial_dir / HEALED).is_file():
        raise FileNotFoundError(f"{trial_dir}: no {HEALED} (the trial did not finish, ran before healed weights "
                                f"were saved or on a node that does not share the run directory, or they were "
                                f"deleted since it was recorded: then healsweep doctor {trial_dir.parent.parent} "
                                f"--repair --rerun-lost-weights heals it again)")
    if why := healed_problem(trial_dir):  # a truncated file ended the export in safetensors' own traceback
        raise ValueError(f"{trial_dir}: {why}; healsweep doctor {trial_dir.parent.parent} --repair "
                         f"--rerun-lost-weights heals that trial again")
    try:
        rec = json.loads((trial_dir / TRIAL_JSON).read_text())
        params, final = rec["params"], rec["final"]
    except (KeyError, TypeError, ValueError) as e:  # JSONDecodeError is a ValueError
        raise ValueError(f"{trial_dir / TRIAL_JSON}: unreadable or incomplete ({type(e).__name__}: {first_line(e)})"
                         ) from None
    model = dense_model(params)
    healed = load_file(str(trial_dir / HEALED))
    missing = sorted(set(healed) - set(model.state_dict()))
    if missing:
        raise ValueError(f"{trial_dir}: healed parameter {missing[0]!r} is not in the rebuilt model")
    model.load_state_dict(healed, strict=False)
    try:
        masks = MaskStore(params["mask_root"]).load(params["mask_key"])
    except FileNotFoundError:
        raise FileNotFoundError(f"{trial_dir}: its mask {params['mask_key']} is gone from {params['mask_root']} "
                                "(healsweep store gc collects masks no kept run refers to); a sweep of the same spec "
                                "on that store computes it again (masks are deterministic)") from None
    except Exception as e:  # noqa: BLE001 - StoreError (another key's mask), safetensors' own (a truncated file)
        raise ValueError(f"{trial_dir}: its mask {params['mask_key']} in {params['mask_root']} is damaged "
                         f"({first_line(e)}); the next sweep that uses it computes it again") from None
    bad = mask_violations(model, masks)
    if bad:
        raise ValueError(f"{trial_dir}: {bad} masked weights are nonzero in the healed weights")
    return model, masks, params, final


def export_trial(trial_dir: Path, out: Path, run_info: Mapping[str, Any] | None = None) -> dict[str, Path]:
    """Rebuild the healed model of a finished trial and write it, its mask and a model card to ``out``.
    ``run_info``: the MLflow run's params, plus ``run_id``, ``metrics``, ``tags`` and ``report`` (the report's
    number for the run's cell: ``{"healed_acc", "run_ids"}``, or None)."""
    trial_dir, out = Path(trial_dir), Path(out)
    model, masks, params, final = load_trial(trial_dir)
    entries = get_adapter(model).scope(model, params["scope"])
    info, load_kw = dict(run_info or {}), dict(params.get("load_kw") or {})
    prep = preprocessing(params, model)
    card = {
        "format": "healsweep-model-card/3",
        **_origin(params, final, masks, info),
        "model": params["model"], "source": _source(params) or {"source": "reference"},
        "model_digest": final.get("model_digest"), "reload": reload_recipe(params),
        "pruner": info.get("pruner"), "pruner_settings": parse_settings(info.get("pruner_settings")),
        "scope": params["scope"], "sparsity": float(info["sparsity"]) if info.get("sparsity") is not None else None,
        "achieved_sparsity": achieved_sparsity(entries, masks),  # over the pruning scope
        "zero_fraction": zero_fraction(model),  # over the whole model's parameters
        "healer": params["healer"], "healer_settings": params.get("healer_settings"),
        "granularity": info.get("granularity"),  # what 'auto' resolved to for this model (the trial's MLflow param)
        **_training(params),
        "calib_size": params["calib_size"],
        "calib_digest": final.get("calib_digest"), "eval_digest": final.get("eval_digest"),
        "dataset": load_kw.get("dataset") or {"name": "digits"},
        "data_seed": params.get("data_seed", 0),
        "calib_seed": load_kw.get("calib_seed", 0),  # which draw of the calibration split
        "preprocessing": {"transform": prep["transform"], "code": prep["code"]},
        "evaluation": {"split": "evaluation", "digest": final.get("eval_digest"),
                       "indices": prep["evaluation_indices"]},
        "accuracy": {k: final.get(k) for k in ("dense_acc", "pruned_acc", "healed_acc", "retention")},
        "metrics": dict(sorted((info.get("metrics") or {}).items())),
        "report": info.get("report"),
    }
    return _write_export(out, model, masks, card)


def _origin(params: Mapping[str, Any], final: Mapping[str, Any], masks, info: Mapping[str, Any]) -> dict:
    """Which trial made the weights: trial.json's ids and seeds, the MLflow run's tags (cell, stage) and params
    (grid, Optuna trial), the mask's key and digest (checked against the one the trial logged)."""
    tags = dict(info.get("tags") or {})
    digest = mask_digest(masks)
    if final.get("mask_digest") and final["mask_digest"] != digest:
        raise ValueError(f"the mask {params['mask_key']} in {params['mask_root']} (digest {digest}) is not the one "
                         f"the trial healed (digest {final['mask_digest']})")
    heal_seed = params.get("heal_seed")
    return {"mlflow_run_id": info.get("run_id"),
            "trial_id": params.get("trial_id", params.get("trial_key")),  # trial_key: trial.json before the rename
            "sweep_id": params.get("sweep_id") or tags.get("sweep_id"), "grid": info.get("grid"),
            "cell_id": tags.get("cell_id"), "stage": tags.get("stage"),
            "optuna_trial": int(info["optuna_trial"]) if str(info.get("optuna_trial", "")).isdigit() else None,
            "seed": params.get("seed"), "heal_seed": heal_seed,
            "mask_key": params.get("mask_key"), "mask_digest": digest}


def _training(params: Mapping[str, Any]) -> dict:
    """lr, epochs and batch size of a gradient healer; a closed-form one (CR+BN, CORP, none) used none of them."""
    if resolve_healer(params["healer"], params.get("healer_settings")).trains:
        return {"closed_form": False, "lr": params["lr"], "epochs": params["epochs"],
                "batch_size": params["batch_size"], "steps": params.get("steps") or None}  # steps: a steps-based search
    return {"closed_form": True, "lr": None, "epochs": None, "batch_size": None, "steps": None}


@torch.no_grad()
def zero_fraction(model: nn.Module) -> float:
    """Fraction of the model's parameters (every tensor of ``named_parameters``) that are exactly zero: the whole
    model, where the card's sparsity is over the pruning scope only."""
    total = zeros = 0
    for p in model.parameters():
        total += p.numel()
        zeros += int((p == 0).sum())
    return zeros / total if total else 0.0


def _write_export(out: Path, model: nn.Module, masks: Mapping[str, torch.Tensor], card: dict) -> dict[str, Path]:
    """The four files, all or none: written into ``out/.export-staging`` first, then renamed into place, the card
    last (a full disk left model.safetensors alone in --out, and the retry was refused as another run's export;
    over an earlier export it would have mixed the two). Every file is a function of the run alone (sorted
    safetensors headers, the card's keys in a fixed order, no time): an export repeated is byte-identical. The
    card gives the sha256 of the weight files (both cards) and of model_card.md (the JSON card)."""
    names = {"model": "model.safetensors", "mask": "mask.safetensors", "card_md": "model_card.md",
             "card_json": "model_card.json"}
    stage = out / ".export-staging"
    shutil.rmtree(stage, ignore_errors=True)  # an export killed before its renames (one export at a time: locked)
    try:
        _save_tensors(stage / names["model"], model.state_dict(),
                      {"format": "pt", "healsweep": json.dumps(card["reload"], sort_keys=True)})
        _save_tensors(stage / names["mask"], {k: v.to(torch.uint8) for k, v in masks.items()},
                      {"format": "healsweep-mask/1"})
        card["files"] = {names[k]: sha256_file(stage / names[k]) for k in ("model", "mask")}
        _save_text(stage / names["card_md"], card_markdown(card))
        files = {**card["files"], names["card_md"]: sha256_file(stage / names["card_md"])}
        _save_text(stage / names["card_json"], json.dumps({**card, "files": files}, indent=1, default=str))
        for name in names.values():
            (stage / name).replace(out / name)
    finally:
        shutil.rmtree(stage, ignore_errors=True)
    return {k: out / n for k, n in names.items()}


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()
