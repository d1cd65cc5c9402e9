"""`monai/<name>` with the `monai` extra: a network of `monai.networks.nets` (DenseNet121, SEResNet50,
EfficientNetBN, resnet18, ...) for 2-D images, e.g. `model: {name: monai/DenseNet121, options: {spatial_dims: 2}}`.

MONAI's builders name their geometry in several ways; this module maps the kit's conventions onto whichever a
builder takes: the class count (`num_classes` or `out_channels`), the input channels (`in_channels` or
`n_input_channels`, else a new stem), `spatial_dims` 2 and the image size (`img_size`, transformers). Every
download switch is turned off (`pretrained=False`, `weights=None`): nothing is downloaded, ever."""

from __future__ import annotations

import difflib
import importlib
import inspect
import typing
from collections.abc import Callable
from types import ModuleType
from typing import TYPE_CHECKING, Any

import torch
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

_CLASSES = ("num_classes", "out_channels")  # the keyword a builder takes the class count by, in this order
_CHANNELS = ("in_channels", "n_input_channels")
_CLASS_COUNT = "the class count comes from the hub's labeled data"
_EXAMPLES = ("DenseNet121", "SEResNet50", "EfficientNetBN", "resnet18")


def _import_nets() -> ModuleType:
    try:
        # Imported on the CPU even when the registry builds on the meta device: a module-level tensor made during
        # the import must not be a meta tensor forever after.
        with torch.device("cpu"):
            return importlib.import_module("monai.networks.nets")
    except ModuleNotFoundError as err:
        if (err.name or "").partition(".")[0] != "monai":
            raise ValueError(f"monai/<name> models: MONAI is installed but cannot be imported ({err})") from None
        raise ValueError('monai/<name> models need MONAI: pip install "silokit[monai]"') from None
    except ImportError as err:
        raise ValueError(f"monai/<name> models: MONAI is installed but cannot be imported ({err})") from None


def _returns(function: Callable[..., Any]) -> Any:
    """The class a builder function says it returns (resnet18 -> ResNet), or None."""
    try:
        return typing.get_type_hints(function).get("return")
    except Exception:  # an annotation naming something not importable here
        return None


def _is_network(cls: Any) -> bool:
    return inspect.isclass(cls) and issubclass(cls, nn.Module) and cls is not nn.Module


def _is_builder(target: Any) -> bool:
    return _is_network(target) or (inspect.isfunction(target) and _is_network(_returns(target)))


def _builder(nets: ModuleType, name: str) -> Callable[..., nn.Module]:
    target = getattr(nets, name, None) if not name.startswith("_") else None
    if _is_builder(target):
        return target
    names = [n for n in dir(nets) if not n.startswith("_") and _is_builder(getattr(nets, n))]
    near = difflib.get_close_matches(name, names, n=4, cutoff=0.6)
    hint = f"did you mean {', '.join(near)}?" if near else f"e.g. {', '.join(_EXAMPLES)}"
    raise ValueError(f"unknown monai model {name!r}; {hint} (the networks of monai.networks.nets)")


def _keywords(builder: Callable[..., nn.Module]) -> set[str]:
    """The keywords a builder takes: its own and, where it hands **kwargs on, those of the network it builds
    (DenseNet121 -> DenseNet, SEResNet50 -> SENet, resnet18() -> ResNet)."""
    names: set[str] = set()
    target: Any = builder
    while target is not None:
        parameters = inspect.signature(target.__init__ if inspect.isclass(target) else target).parameters
        names |= {n for n, p in parameters.items() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
        if not any(p.kind is p.VAR_KEYWORD for p in parameters.values()):
            break
        if inspect.isclass(target):
            target = next((base for base in target.__mro__[1:] if _is_network(base)), None)
        else:
            target = _returns(target) if _is_network(_returns(target)) else None
    return names - {"self"}


class MonaiProvider(LibraryProvider):
    prefix, example = "monai", "DenseNet121"
    reserved = {"pretrained": FROM_FILE, "weights": FROM_FILE, "progress": "nothing is downloaded; leave it out",
                "num_classes": _CLASS_COUNT, "out_channels": _CLASS_COUNT,
                "in_channels": "set model.in_channels", "n_input_channels": "set model.in_channels",
                "img_size": "set model.image_size"}

    def check(self, spec: ModelSpec, name: str) -> None:
        super().check(spec, name)
        dims = spec.options.get("spatial_dims", 2)
        if isinstance(dims, bool) or dims != 2:
            raise ValueError(f"options.spatial_dims must be 2 for model {spec.name}, got {dims!r}: the kit trains "
                             "on 2-D images")

    def create(self, spec: ModelSpec, name: str) -> nn.Module:
        builder = _builder(_import_nets(), name)
        takes = _keywords(builder)
        classes = next((k for k in _CLASSES if k in takes), None)
        if classes is None:
            raise ValueError(f"model {spec.name} takes no class count (num_classes or out_channels); choose a "
                             f"network that classifies, e.g. {', '.join(_EXAMPLES)}")
        ours: dict[str, Any] = {classes: spec.num_classes}
        channels = next((k for k in _CHANNELS if k in takes), None)
        if channels:
            ours[channels] = spec.in_channels
        # The kit's values, and the download switches off, whatever the builder's defaults (EfficientNetBN and
        # MILModel default to pretrained=True).
        for key, value in (("spatial_dims", 2), ("img_size", spec.image_size), ("pretrained", False),
                           ("weights", None)):
            if key in takes:
                ours[key] = value
        kwargs = {**user_options(spec), **ours}
        model = call_builder(spec, lambda: builder(**kwargs))
        return model if channels else adapt_stem(model, spec.in_channels)


register_provider("monai", MonaiProvider())
