"""Models: reference models the project trained itself (weights shipped in tasks/models/weights), external ones
(timm, torchvision, checkpoints), and the adapters that find blocks and prunable scopes in each architecture family.

Implementations register themselves on import; this package face imports every one of them.
"""
from tasks.models import cnn_adapters, vit_adapters  # noqa: F401 - register the architecture adapters
from tasks.models.adapter import (ADAPTERS, VIT_SCOPES, ModelAdapter, ScopeEntry, UnsupportedModelError, cnn_scope,
                                  get_adapter)
from tasks.models.base import (MODEL_SOURCES, MODELS, ExternalSource, LoadedModel, ModelRef, ModelSourceError,
                               ReferenceModel, TrainRecipe)
from tasks.models.checkpoint_file import file_digest
from tasks.models.external import build_untrained, load_external, parse_ref, too_few_outputs
from tasks.models.load import load_model, load_model_copy, load_model_shared
from tasks.models.reference import load_reference, train_reference

__all__ = ["ADAPTERS", "VIT_SCOPES", "ModelAdapter", "ScopeEntry", "UnsupportedModelError", "cnn_scope",
           "get_adapter", "MODEL_SOURCES", "MODELS", "ExternalSource", "LoadedModel", "ModelRef", "ModelSourceError",
           "ReferenceModel", "TrainRecipe", "build_untrained", "file_digest", "load_external", "parse_ref", "too_few_outputs",
           "load_model", "load_model_copy", "load_model_shared", "load_reference", "train_reference"]
