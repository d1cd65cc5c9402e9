"""The one registry that builds a network: models with static batch norm (sBN, SemiFL Appendix B), or group norm
for sample-level DP.

A spec names a built-in (`small_cnn`, `wrn28_2`; `register_model` adds one), a library's network by
`<prefix>/<name>` (`torchvision/resnet18`; with the `timm` extra `timm/resnet18`; with the `monai` extra
`monai/DenseNet121`), or the user's own factory (`factory: "their_pkg.models:build"`, a callable installed where it
runs; a silo builds one only when its own operator named it). Each is served by one provider
(`registry.ModelProvider`, one module each under `providers/`), the one place that checks its names and options,
builds and scales it. The registry applies the kit's conventions once, so no algorithm special-cases a network:
the class count, the input channels (a new stem where a library cannot take them) and static BN. Nothing is ever
downloaded: pretrained weights are refused; starting weights come from a file the operator names instead
(`read_weights`, `load_weights`: hub.yaml's model.init_weights and model.init_from_run).

Every BatchNorm normalises with the batch's own statistics while training and keeps no useful running estimate of
its own; the global statistics used for inference and pseudo-labelling are computed explicitly by `silo_core.sbn`
(hub data) and travel with the model as the BN buffers.
"""

from __future__ import annotations

import importlib

from silo_core.models.builtin import HEADS, SmallCNN, WideResNet
from silo_core.models.fingerprint import (
    TensorShape,
    architecture,
    architecture_difference,
    architecture_sha256,
    count_parameters,
    trainable_names,
)
from silo_core.models.providers.factory import load_factory
from silo_core.models.registry import (
    BUILT_INS,
    NORMS,
    PROVIDERS,
    ModelProvider,
    adapt_stem,
    group_norms,
    model_names,
    norm2d,
    register_model,
    register_provider,
    static_batchnorm,
    static_bn2d,
)
from silo_core.models.spec import ModelSpec
from silo_core.models.weights import (
    RUN_CARD,
    RUN_WEIGHTS,
    WeightsReport,
    head_names,
    load_weights,
    read_run_weights,
    read_weights,
    starting_weights,
)

# The library providers, each registering itself on import (an optional library is imported only when one of its
# models is built). A new provider is one module here.
PROVIDER_MODULES = ("torchvision", "timm", "monai")
for _module in PROVIDER_MODULES:
    importlib.import_module(f"silo_core.models.providers.{_module}")

# As shipped (model_names() and BUILT_INS see models registered later too).
MODEL_OPTIONS = {name: entry.options for name, entry in BUILT_INS.items()}
MODELS = tuple(MODEL_OPTIONS)
LIBRARIES = PROVIDER_MODULES

__all__ = [
    "BUILT_INS", "HEADS", "LIBRARIES", "MODELS", "MODEL_OPTIONS", "NORMS", "PROVIDERS", "RUN_CARD", "RUN_WEIGHTS",
    "ModelProvider", "ModelSpec", "SmallCNN", "TensorShape", "WeightsReport", "WideResNet", "adapt_stem",
    "architecture", "architecture_difference", "architecture_sha256", "count_parameters", "group_norms",
    "head_names", "load_factory", "load_weights", "model_names", "norm2d", "read_run_weights", "read_weights",
    "register_model", "register_provider", "starting_weights", "static_batchnorm", "static_bn2d", "trainable_names",
]
