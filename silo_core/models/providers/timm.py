"""`timm/<name>` with the `timm` extra: timm builds for the class count and input channels itself
(pretrained=False always: nothing is downloaded)."""

from __future__ import annotations

import difflib
import importlib
from typing import TYPE_CHECKING, Any

from torch import nn

from silo_core.models.registry import (
    FROM_FILE,
    LibraryProvider,
    call_builder,
    register_provider,
    user_options,
)

if TYPE_CHECKING:
    from silo_core.models.spec import ModelSpec


def _import_timm() -> Any:
    try:
        return importlib.import_module("timm")
    except ImportError:
        raise ValueError('timm/<name> models need timm: pip install "silokit[timm]"') from None


class TimmProvider(LibraryProvider):
    prefix, example = "timm", "resnet18"
    reserved = {"pretrained": FROM_FILE,
                "pretrained_cfg": "nothing is downloaded; leave it out",
                "pretrained_cfg_overlay": "nothing is downloaded",
                "checkpoint_path": "name the checkpoint in model.init_weights instead (only the hub reads it)",
                "num_classes": "the class count comes from the hub's labeled data",
                "in_chans": "set model.in_channels", "img_size": "set model.image_size"}

    def create(self, spec: ModelSpec, name: str) -> nn.Module:
        timm = _import_timm()
        if not timm.is_model(name):
            near = difflib.get_close_matches(name, timm.list_models(), n=4, cutoff=0.6)
            raise ValueError(f"unknown timm model {name!r}; " + (f"did you mean {', '.join(near)}? " if near else "")
                             + "timm.list_models() lists them all")
        args = dict(pretrained=False, num_classes=spec.num_classes, in_chans=spec.in_channels, **user_options(spec))

        def create() -> nn.Module:
            try:  # transformers need the image size (img_size); a convolutional net's class refuses the keyword
                return timm.create_model(name, img_size=spec.image_size, **args)
            except TypeError as err:
                if "img_size" not in str(err):
                    raise
                return timm.create_model(name, **args)

        return call_builder(spec, create)


register_provider("timm", TimmProvider())
