"""`torchvision/<name>`: any torchvision classification builder, randomly initialised (nothing is downloaded), with
the class count from the data and a new stem for model.in_channels."""

from __future__ import annotations

import difflib
import inspect
import typing
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from torch import nn

from silo_core.models.registry import (
    FROM_FILE,
    LibraryProvider,
    adapt_stem,
    call_builder,
    register_provider,
    user_options,
)

if TYPE_CHECKING:
    from silo_core.models.spec import ModelSpec

# Builder defaults that differ from torchvision's: the kit trains on one tensor of logits, so no auxiliary heads;
# init_weights=True is torchvision's own behaviour, said out loud to silence its FutureWarning.
_DEFAULTS = {"googlenet": {"aux_logits": False, "init_weights": True},
             "inception_v3": {"aux_logits": False, "init_weights": True}}
_EXAMPLES = ("resnet18", "resnet50", "densenet121", "efficientnet_b0", "mobilenet_v3_small", "convnext_tiny",
             "regnet_y_400mf", "vit_b_16")


def _builder(name: str) -> Callable[..., nn.Module]:
    from torchvision import models

    classification = models.list_models(module=models)  # the classification builders only
    if name in classification:
        return models.get_model_builder(name)
    if name in models.list_models():
        raise ValueError(f"torchvision/{name} is not a classification model (detection, segmentation, video and "
                         f"optical-flow models do not fit here); e.g. {', '.join(_EXAMPLES)}")
    near = difflib.get_close_matches(name, classification, n=4, cutoff=0.6)
    hint = f"did you mean {', '.join(near)}?" if near else f"e.g. {', '.join(_EXAMPLES)}"
    raise ValueError(f"unknown torchvision model {name!r}; {hint} (torchvision.models.list_models() lists them all)")


class TorchvisionProvider(LibraryProvider):
    prefix, example = "torchvision", "resnet18"
    reserved = {"weights": FROM_FILE,
                "weights_backbone": FROM_FILE,
                "num_classes": "the class count comes from the hub's labeled data",
                "image_size": "set model.image_size", "input_size": "set model.image_size"}

    def create(self, spec: ModelSpec, name: str) -> nn.Module:
        builder = _builder(name)
        # Transformers fix their input size at build time (vit: image_size, maxvit: input_size); the rest pool
        # adaptively. The builders take **kwargs, so the network class they return says which it accepts.
        accepts = inspect.signature(typing.get_type_hints(builder)["return"].__init__).parameters
        size: dict[str, Any] = {"image_size": spec.image_size} if "image_size" in accepts else {}
        if "input_size" in accepts:
            size["input_size"] = (spec.image_size, spec.image_size)
        kwargs = {**_DEFAULTS.get(name, {}), **size, **user_options(spec)}
        model = call_builder(spec, lambda: builder(weights=None, num_classes=spec.num_classes, **kwargs))
        return adapt_stem(model, spec.in_channels)  # torchvision's networks all take 3 channels


register_provider("torchvision", TorchvisionProvider())
