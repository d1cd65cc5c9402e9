"""model.factory: the user's own network, "package.module:callable", called with the class count, input channels,
image size and model.options. Importing runs the package's code: a silo builds one only when its own operator
named it (silo-client --model-factory), never because the hub did."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from torch import nn

from silo_core.models.registry import FACTORY, ModelProvider, register_provider, user_options

if TYPE_CHECKING:
    from silo_core.models.spec import ModelSpec


def load_factory(path: str) -> Callable[..., nn.Module]:
    """The callable named "package.module:attribute" (the attribute may be dotted: "pkg.mod:Builders.resnet").
    Importing runs the package's code: only ever call this for a name this process's own operator gave."""
    module_name, colon, attribute = path.partition(":")
    if not colon or not module_name or not attribute:
        raise ValueError(f"model factory {path!r} must be written package.module:callable, e.g. my_models.chest:build")
    try:
        target: Any = importlib.import_module(module_name)
    except ImportError as err:
        raise ValueError(f"model factory {path}: cannot import {module_name} ({err}); install the package that "
                         f"provides it on this machine, or correct the name") from None
    for part in attribute.split("."):
        if not hasattr(target, part):
            raise ValueError(f"model factory {path}: {module_name} has no {attribute}; correct the name")
        target = getattr(target, part)
    if not callable(target):
        raise ValueError(f"model factory {path} is a {type(target).__name__}, not a callable that returns a model")
    return target


class FactoryProvider(ModelProvider):
    """Checks nothing but the norm before the build: the options are the factory's own, and it says which it
    refuses when called (at config time, on the meta device)."""

    def create(self, spec: ModelSpec, name: str) -> nn.Module:
        build = load_factory(name)
        options = user_options(spec)
        try:
            model = build(num_classes=spec.num_classes, in_channels=spec.in_channels, image_size=spec.image_size,
                          **options)
        except Exception as err:
            raise ValueError(f"model factory {name} failed for {spec.num_classes} classes, "
                             f"{spec.in_channels}x{spec.image_size}x{spec.image_size} images and options {options}: "
                             f"{type(err).__name__}: {err}") from err
        if not isinstance(model, nn.Module):
            raise ValueError(f"model factory {name} returned a {type(model).__name__}, not a torch.nn.Module")
        return model


register_provider(FACTORY, FactoryProvider())
