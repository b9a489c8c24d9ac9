"""Model sources beyond the embedded reference models: timm, torchvision (weight enums), local checkpoints.

A spec names a model either by a registered reference name (``vit_digits``) or by a mapping that becomes a
``ModelRef``. ``MODEL_SOURCES`` maps a source name to a ``ModelSource`` that can build the architecture
(randomly initialized, for validation), load it (pretrained weights, checkpoint), give a stable digest (content
keys), and give the model's preprocessing (timm data config or the torchvision weights' transforms).

Offline mode (``HF_HUB_OFFLINE=1``, ``ModelRef.offline``), or a download host that cannot be reached
(tasks/net.py): weights that are not in the local cache fail with a one-line ``ModelSourceError`` before
any download is tried.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable, Mapping

import torch
import torch.nn as nn

from tasks.data.splits import load_dataset
from tasks.models.base import (MODEL_SOURCES, MODELS, REF_KEYS, ExternalSource, LoadedModel, ModelRef, ModelSourceError,
                               timm_transform)
from tasks.models.checkpoint_file import check_sha256, file_digest, fit_problem, read_state_dict, safetensors_header
from tasks.net import hub_url, unreachable
from tasks.errors import first_line


def is_offline(ref: ModelRef) -> bool:
    return ref.offline or os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on")


def _builder_args(ref: ModelRef) -> dict:
    kw = dict(ref.model_args or {})
    if ref.num_classes is not None:
        kw["num_classes"] = ref.num_classes
    return kw


# --- timm ----------------------------------------------------------------------------------------------

def hf_hub_cache() -> str:
    """The Hugging Face hub cache directory as the environment says now (HF_HUB_CACHE, else HF_HOME/hub)."""
    home = os.environ.get("HF_HOME") or os.path.join(os.path.expanduser("~"), ".cache", "huggingface")
    return os.environ.get("HF_HUB_CACHE") or os.path.join(home, "hub")


def _timm_cached(ref: ModelRef) -> bool:
    """Whether timm's pretrained weights for ``ref`` are in the local Hugging Face or torch hub cache."""
    import timm
    from huggingface_hub import try_to_load_from_cache

    name = ref.builder + (f".{ref.weights}" if ref.weights else "")
    cfg = timm.models.get_pretrained_cfg(name, allow_unregistered=False)
    if cfg is None:
        raise ModelSourceError(f"model {ref.name!r}: timm has no pretrained weights {name!r}")
    if cfg.hf_hub_id:
        for fn in ("model.safetensors", "pytorch_model.bin", "open_clip_pytorch_model.bin"):
            if isinstance(try_to_load_from_cache(cfg.hf_hub_id, fn, cache_dir=hf_hub_cache()), str):
                return True
    if cfg.url:
        return (Path(torch.hub.get_dir()) / "checkpoints" / os.path.basename(cfg.url)).is_file()
    return False


def _timm_url(name: str) -> str:
    """Where timm would download the pretrained weights ``name`` from (the hub, or the config's URL)."""
    import timm

    cfg = timm.models.get_pretrained_cfg(name, allow_unregistered=False)
    return hub_url() if cfg is None or cfg.hf_hub_id or not cfg.url else cfg.url


@MODEL_SOURCES.register("timm")
class TimmSource(ExternalSource):
    kind = "timm"

    def check(self, ref: ModelRef) -> None:
        import timm

        if not timm.is_model(ref.builder):
            raise ModelSourceError(f"model {ref.name!r}: {ref.builder!r} is not a timm model name "
                                   f"(see timm.list_models(), e.g. deit_tiny_patch16_224, resnet18, vgg16_bn)")

    def build(self, ref: ModelRef, pretrained: bool) -> nn.Module:
        import timm

        self.check(ref)
        kw = _builder_args(ref)
        if "img_size" in kw and "pretrained_cfg_overlay" not in kw:  # preprocessing follows the input size
            size = kw["img_size"] if isinstance(kw["img_size"], (list, tuple)) else (kw["img_size"],) * 2
            kw["pretrained_cfg_overlay"] = {"input_size": (3, *size)}
        name = ref.builder + (f".{ref.weights}" if ref.weights else "")
        if pretrained and not _timm_cached(ref):
            why = "offline mode is on (HF_HUB_OFFLINE=1)" if is_offline(ref) else unreachable(_timm_url(name))
            if why:
                raise ModelSourceError(
                    f"model {ref.name!r}: pretrained timm weights {name!r} are not in the local cache "
                    f"({hf_hub_cache()}) and {why}; download them once online, or use source: checkpoint with a "
                    f"local file")
        try:
            return timm.create_model(name, pretrained=pretrained, **kw)
        except Exception as e:  # noqa: BLE001 - network/cache errors become one line
            msg = first_line(e)
            raise ModelSourceError(f"model {ref.name!r}: timm could not create {name!r}: {msg}") from None


# --- torchvision ---------------------------------------------------------------------------------------

def _tv_weights(ref: ModelRef):
    from torchvision.models import get_weight

    if not ref.weights:
        return None
    try:
        return get_weight(ref.weights)
    except (ValueError, KeyError, AttributeError):
        raise ModelSourceError(f"model {ref.name!r}: unknown torchvision weights {ref.weights!r}; "
                               f"write e.g. ViT_B_16_Weights.IMAGENET1K_V1") from None


@MODEL_SOURCES.register("torchvision")
class TorchvisionSource(ExternalSource):
    kind = "torchvision"

    def check(self, ref: ModelRef) -> None:
        from torchvision.models import list_models

        if ref.builder not in list_models():
            raise ModelSourceError(f"model {ref.name!r}: {ref.builder!r} is not a torchvision model builder "
                                   f"(e.g. vit_b_16, vit_l_16, resnet18)")
        if _tv_weights(ref) is not None and ref.input_size is not None:
            raise ModelSourceError(f"model {ref.name!r}: input_size is set by the weights {ref.weights}' own "
                                   "preprocessing; input_size is for a builder without weights (or a checkpoint)")
        if ref.pretrained and not ref.weights:
            raise ModelSourceError(f"model {ref.name!r}: torchvision pretrained weights need `weights`, "
                                   f"e.g. ViT_B_16_Weights.IMAGENET1K_V1")

    def build(self, ref: ModelRef, pretrained: bool) -> nn.Module:
        from torchvision.models import get_model

        self.check(ref)
        w = _tv_weights(ref) if pretrained else None
        kw = _builder_args(ref)
        if w is not None:
            cached = (Path(torch.hub.get_dir()) / "checkpoints" / os.path.basename(w.url)).is_file()
            why = None if cached else "offline mode is on (HF_HUB_OFFLINE=1)" if is_offline(ref) else unreachable(w.url)
            if why:
                raise ModelSourceError(
                    f"model {ref.name!r}: torchvision weights {ref.weights} are not in the local cache "
                    f"({torch.hub.get_dir()}/checkpoints) and {why}; download them once online, or use source: "
                    f"checkpoint with a local file")
        try:
            return get_model(ref.builder, weights=w, **kw)
        except Exception as e:  # noqa: BLE001
            msg = first_line(e)
            raise ModelSourceError(f"model {ref.name!r}: torchvision could not build {ref.builder!r}: {msg}") from None

    def load(self, ref: ModelRef) -> nn.Module:
        torch.manual_seed(ref.init_seed)
        return self.build(ref, pretrained=bool(ref.weights)).eval()

    def transform(self, ref: ModelRef, model: nn.Module) -> tuple[Callable, str]:
        w = _tv_weights(ref)
        if w is None:  # no weights enum to say it: timm's eval transform (at input_size, else timm's 224 px)
            return timm_transform(model, ref.input_size)
        return w.transforms(), f"torchvision:{ref.weights}"


# --- local checkpoints ---------------------------------------------------------------------------------

@MODEL_SOURCES.register("checkpoint")
class CheckpointSource(ExternalSource):
    """``arch`` names the architecture (a timm name, or ``torchvision:<builder>``); ``path`` holds its weights."""

    kind = "checkpoint"

    def _arch(self, ref: ModelRef) -> tuple[ExternalSource, ModelRef]:
        if not ref.arch:
            raise ModelSourceError(f"model {ref.name!r}: source checkpoint needs `arch` (a timm model name or "
                                   f"torchvision:<builder>)")
        src, _, arch = ref.arch.rpartition(":")
        inner = ModelRef(ref.name, src or "timm", arch, False, None, None, ref.num_classes, ref.offline, ref.init_seed,
                         ref.model_args, input_size=ref.input_size)
        return MODEL_SOURCES.get(inner.source), inner

    def check(self, ref: ModelRef) -> None:
        if not ref.path:
            raise ModelSourceError(f"model {ref.name!r}: source checkpoint needs `path`")
        if not Path(ref.path).is_file():
            raise ModelSourceError(f"model {ref.name!r}: checkpoint file not found: {ref.path}")
        if Path(ref.path).suffix == ".safetensors":
            safetensors_header(ref.path)  # truncated / not safetensors: refused now, not in the models stage
        src, inner = self._arch(ref)
        src.check(inner)

    def build(self, ref: ModelRef, pretrained: bool) -> nn.Module:
        src, inner = self._arch(ref)
        model = src.build(inner, pretrained=False)
        if pretrained:
            self.check(ref)
            sd = read_state_dict(ref.path, ref.sha256)
            try:
                model.load_state_dict(sd, strict=True)
            except RuntimeError:
                raise ModelSourceError(f"model {ref.name!r}: checkpoint {ref.path} does not fit {ref.arch!r}: "
                                       f"{fit_problem(model.state_dict(), sd)[:400]}") from None
        return model

    def load(self, ref: ModelRef) -> nn.Module:
        torch.manual_seed(ref.init_seed)
        return self.build(ref, pretrained=True).eval()

    def digest(self, ref: ModelRef) -> str:
        """The file's sha256 (16 hex): its path and the entry's name play no part, so a copy of the same file
        shares every cache entry and two different files never do."""
        return file_digest(ref.path)

    def transform(self, ref: ModelRef, model: nn.Module) -> tuple[Callable, str]:
        src, inner = self._arch(ref)
        return src.transform(inner, model)


# --- spec entries --------------------------------------------------------------------------------------

def parse_ref(item: Any, offline: bool = False) -> ModelRef:
    """A spec ``models`` entry (a name or a mapping) -> ModelRef; one-line ModelSourceError when invalid."""
    if isinstance(item, str):
        import timm

        if item not in MODELS and not timm.is_model(item):
            raise ModelSourceError(f"unknown model {item!r}; allowed: {', '.join(MODELS.names())} (reference), "
                                   f"a timm model name, or a mapping with `source`")
        item = {"name": item, "source": "reference" if item in MODELS else "timm"}
    if not isinstance(item, Mapping):
        raise ModelSourceError(f"must be a model name or a mapping, got {item!r}")
    unknown = sorted(set(item) - set(REF_KEYS))
    if unknown:
        raise ModelSourceError(f"unknown key; allowed: {', '.join(REF_KEYS)}", field=unknown[0])
    if not isinstance(item.get("name"), str) or not item["name"]:
        raise ModelSourceError("required, a non-empty string", field="name")
    d = dict(item)
    d.setdefault("source", "reference" if d["name"] in MODELS else "timm")
    if d["source"] not in MODEL_SOURCES and d["source"] != "reference":
        raise ModelSourceError(f"unknown model source {d['source']!r}; allowed: reference, "
                               f"{', '.join(MODEL_SOURCES.names())}", field="source")
    for key, typ in (("pretrained", bool), ("offline", bool)):
        if key in d and not isinstance(d[key], typ):
            raise ModelSourceError(f"must be true or false, got {d[key]!r}", field=key)
    if d.get("model_args") is not None and not isinstance(d["model_args"], Mapping):
        raise ModelSourceError(f"must be a mapping of builder arguments, got {d['model_args']!r}",
                               field="model_args")
    nc = d.get("num_classes")
    if nc is not None and (not isinstance(nc, int) or isinstance(nc, bool) or nc < 1):
        raise ModelSourceError(f"must be a positive integer, got {nc!r}", field="num_classes")
    d["sha256"] = check_sha256(d.get("sha256"), "sha256")
    if d.get("input_size") is not None:
        d["input_size"] = check_input_size(d["input_size"])
    if d["sha256"] and not d.get("path"):
        raise ModelSourceError("pins the file given by `path`; give `path` too", field="sha256")
    d["offline"] = bool(d.get("offline", False) or offline)
    if d["source"] == "timm":
        d.setdefault("pretrained", True)  # a timm name means its pretrained weights unless `pretrained: false`
    ref = ModelRef(**d)
    if ref.source == "reference":
        if ref.name not in MODELS:
            raise ModelSourceError(f"unknown reference model {ref.name!r}; allowed: {', '.join(MODELS.names())}")
        extra = sorted(k for k in d if k not in ("name", "source", "offline", "path", "sha256"))
        if extra:
            raise ModelSourceError("not a setting of reference models (allowed: path, sha256)", field=extra[0])
        if ref.path is not None and (not isinstance(ref.path, str) or not ref.path):
            raise ModelSourceError(f"must be a checkpoint file, got {ref.path!r}", field="path")
    else:
        MODEL_SOURCES.get(ref.source).check(ref)
    return ref


def check_input_size(v: Any) -> int | list[int]:
    """A model entry's ``input_size``: N or [H, W], each in [8, 4096] pixels."""
    sizes = [v] if not isinstance(v, (list, tuple)) else list(v)
    ok = len(sizes) in ((1,) if not isinstance(v, (list, tuple)) else (2,))
    if not ok or not all(isinstance(x, int) and not isinstance(x, bool) and 8 <= x <= 4096 for x in sizes):
        raise ModelSourceError(f"must be N or [H, W] pixels, each an integer in [8, 4096], got {v!r}",
                               field="input_size")
    return v if isinstance(v, int) else sizes


def build_untrained(ref: ModelRef, device: str = "cpu") -> nn.Module:
    """The architecture with random weights (spec validation, adapters): never downloads, never trains.
    ``device="meta"``: structure and shapes only (fast validation of large models; no forward pass)."""
    torch.manual_seed(0)
    with torch.device(device):
        if ref.source == "reference":
            src = MODELS.get(ref.name)
            return src.build(src.arch).eval()
        src = MODEL_SOURCES.get(ref.source)
        if isinstance(src, CheckpointSource):
            src, ref = src._arch(ref)
        return src.build(ref, pretrained=False).eval()


def load_external(source: Mapping[str, Any], dataset: Mapping[str, Any], data_seed: int = 0):
    """A timm / torchvision / checkpoint model with its dataset preprocessed the model's way -> LoadedModel."""
    ref = ModelRef(**source)
    src = MODEL_SOURCES.get(ref.source)
    model = src.load(ref)
    transform, transform_id = src.transform(ref, model)
    settings = {k: v for k, v in dataset.items() if k != "name"}
    data = load_dataset(dataset["name"], seed=data_seed, transform=transform, transform_id=transform_id, **settings)
    short = too_few_outputs(ref.name, model, dataset["name"], data.num_classes)
    if short:  # labels past the logits: every trial would fail
        raise ModelSourceError(short)
    if bad := forward_problem(ref.name, model, data["evaluation"].images[:1]):  # e.g. another input size
        raise ModelSourceError(bad)
    info = {"model": ref.name, "source": ref.source, "arch": ref.builder, "weights": ref.weights,
            "dense_eval_acc": float("nan"), "transform": transform_id}  # dense accuracy: measured by each trial
    return LoadedModel(ref.name, model, src.digest(ref), data, info)


def too_few_outputs(name: str, model: nn.Module, dataset: str, classes: int) -> str:
    """'' when ``model`` predicts at least ``classes`` classes (or says nothing of its outputs), else the one-line
    refusal (the models stage's and the spec check's: orchestrator/spec/compat.py)."""
    outputs = num_outputs(model)
    if outputs is None or classes <= outputs:
        return ""
    return (f"model {name!r} has {outputs} outputs but dataset {dataset!r} has {classes} classes; "
            f"set num_classes: {classes} on the model entry")


def forward_problem(name: str, model: nn.Module, x: torch.Tensor) -> str:
    """'' when ``model`` takes the preprocessed images ``x`` (1, C, H, W), else the one-line refusal: an input size
    the model does not take ended the dense stage in a traceback (timm's "Input height (48) doesn't match model")."""
    try:
        with torch.no_grad():
            model(x)
    except Exception as e:  # noqa: BLE001 - whatever the architecture raises on an input it does not take
        why = first_line(e, 200)
        return (f"model {name!r}: a forward pass on one preprocessed image {list(x.shape[1:])} fails ({why}); the "
                "preprocessing size must be one the model takes (the model entry's input_size; for timm also "
                "model_args img_size)")
    return ""


def num_outputs(model: nn.Module) -> int | None:
    """Classes a classifier predicts: timm's ``num_classes``, else its last linear layer's width (torchvision's
    ``fc`` / ``heads.head`` / ``classifier``); None when neither says."""
    n = getattr(model, "num_classes", None)
    if isinstance(n, int) and not isinstance(n, bool):
        return n
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    return linears[-1].out_features if linears else None
