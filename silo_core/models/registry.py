"""The one registry every network comes from, and the conventions it applies once, for every model.

A model name resolves to a provider: a built-in (`register_model`), a library's network (`<prefix>/<name>`, a
`ModelProvider` registered with `register_provider`) or the user's own factory (`ModelSpec.factory`). The provider
is the one place that checks the name and options, builds the network and scales it; the registry then gives the
result the kit's normalisation (static BN, or group norm with `options.norm: group`) and, at config time, builds a
library's or a factory's network once on the meta device to refuse what cannot work before anything runs.
"""

from __future__ import annotations

import re
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

if TYPE_CHECKING:
    from silo_core.models.spec import ModelSpec

NORMS = ("batch", "group")
FACTORY = "factory"  # the key of the provider that builds ModelSpec.factory; never a name prefix
FROM_FILE = "nothing is downloaded; leave it out, and name a weights file in model.init_weights to start from one"


# ------------------------------------------------------------------------------ the conventions

def static_bn2d(channels: int) -> nn.BatchNorm2d:
    # momentum=None: cumulative average, so a stats pass over data gives their mean, not a decayed estimate.
    return nn.BatchNorm2d(channels, momentum=None, track_running_stats=True)


def norm2d(channels: int, norm: str = "batch") -> nn.Module:
    """Static batch norm, or group norm: batch norm mixes the samples of a batch, so per-sample gradients (DP-SGD,
    privacy.sample_dp) need a norm that sees one sample at a time."""
    if norm == "batch":
        return static_bn2d(channels)
    if norm == "group":
        groups = next(g for g in (8, 4, 2, 1) if channels % g == 0)
        return nn.GroupNorm(groups, channels)
    raise ValueError(f"unknown norm {norm!r}; choose one of {', '.join(NORMS)}")


def check_norm(spec: ModelSpec) -> None:
    if spec.norm not in NORMS:
        raise ValueError(f"unknown options.norm {spec.norm!r}; choose one of {', '.join(NORMS)}")


def adapt_stem(model: nn.Module, in_channels: int) -> nn.Module:
    """Give the network's stem (the first Conv2d in module order: resnet `conv1`, densenet `features.conv0`,
    efficientnet/mobilenet/convnext `features.0.0`, vit `conv_proj`) ``in_channels`` inputs. The new convolution
    has the same geometry and a fresh initialisation: the network is random anyway (nothing is downloaded)."""
    name, stem = next(((n, m) for n, m in model.named_modules() if isinstance(m, nn.Conv2d)), ("", None))
    if stem is None:
        raise ValueError(f"{type(model).__name__} has no convolution to take {in_channels} input channels")
    if stem.in_channels == in_channels:
        return model
    if stem.groups != 1:
        raise ValueError(f"the stem {name} of {type(model).__name__} is a grouped convolution; cannot change its "
                         "input channels")
    new = nn.Conv2d(in_channels, stem.out_channels, stem.kernel_size, stride=stem.stride, padding=stem.padding,
                    dilation=stem.dilation, bias=stem.bias is not None, padding_mode=stem.padding_mode,
                    device=stem.weight.device, dtype=stem.weight.dtype)
    parent, _, attr = name.rpartition(".")
    setattr(model.get_submodule(parent), attr, new)
    return model


def static_batchnorm(model: nn.Module) -> nn.Module:
    """Make every BatchNorm the kit's static BN (like `static_bn2d`): momentum=None, so a statistics pass averages
    over the data instead of decaying. Changed in place, not replaced: a library's subclass (timm's BatchNormAct2d
    carries its activation) keeps its behaviour, a zero-initialised gamma stays zero, and state-dict names stay."""
    for name, layer in model.named_modules():
        if isinstance(layer, nn.modules.batchnorm._BatchNorm):
            if not layer.track_running_stats:  # silo_core.sbn writes the global statistics into these buffers
                raise ValueError(f"batch norm {name} keeps no running statistics; static BN needs them")
            layer.momentum = None
    return model


def group_norms(model: nn.Module) -> nn.Module:
    """Replace every BatchNorm with group norm (`norm2d(..., "group")`), for per-sample gradients (DP-SGD)."""
    for name, layer in list(model.named_modules()):
        if isinstance(layer, nn.modules.batchnorm._BatchNorm):
            if type(layer) not in (nn.BatchNorm1d, nn.BatchNorm2d):  # e.g. timm's BatchNormAct2d: would lose its act
                raise ValueError(f"options.norm: group cannot replace {type(layer).__name__} ({name}); choose a model "
                                 "with plain BatchNorm2d layers or none")
            parent, _, attr = name.rpartition(".")
            setattr(model.get_submodule(parent), attr, norm2d(layer.num_features, "group"))
    return model


def apply_norm(model: nn.Module, norm: str) -> nn.Module:
    """The kit's normalisation on any network: group norm when asked for, else every BatchNorm made static."""
    return group_norms(model) if norm == "group" else static_batchnorm(model)


def options_error(spec: ModelSpec, err: Exception) -> ValueError:
    """One line naming the option a library's builder refused, or what went wrong."""
    unexpected = re.search(r"unexpected keyword argument '(\w+)'", str(err))
    if unexpected:
        return ValueError(f"unknown options.{unexpected.group(1)} for model {spec.name} ({err})")
    return ValueError(f"model {spec.name} cannot be built for {spec.in_channels}x{spec.image_size}x{spec.image_size} "
                      f"images with options {spec.options}: {type(err).__name__}: {err}")


def call_builder(spec: ModelSpec, build: Callable[[], nn.Module]) -> nn.Module:
    """Run a library's builder, turning whatever it raises for a bad option into one line naming the model.
    NotImplementedError passes through: code that cannot run on the meta device (see `probe`) is not the options'
    fault."""
    try:
        return build()
    except NotImplementedError:
        raise
    except Exception as err:
        raise options_error(spec, err) from err


def user_options(spec: ModelSpec) -> dict[str, Any]:
    """The options a builder gets: all of the user's but norm, which is the kit's (applied afterwards)."""
    return {k: v for k, v in spec.options.items() if k != "norm"}


# ------------------------------------------------------------------------------ providers

class ModelProvider(ABC):
    """One family of networks behind the registry: the one place that checks a name and its options, builds the
    network and scales it. The registry applies the norm afterwards, so `create` returns the network as built."""

    probe: bool = True  # build once on the meta device at config time: the only way to ask a foreign builder

    def check(self, spec: ModelSpec, name: str) -> None:
        """Refuse a name or option in one line, cheaply (no import of an optional package, no build)."""
        check_norm(spec)

    @abstractmethod
    def create(self, spec: ModelSpec, name: str) -> nn.Module:
        """The network for spec's class count, input channels and image size (before the kit's norm)."""

    def scaled_options(self, spec: ModelSpec, name: str, factor: float) -> dict[str, Any]:
        """spec's options for the same architecture with every channel count times ``factor``. A library's network
        has no single width to scale: only factor 1 (the same network) is possible."""
        if factor != 1:
            raise ValueError(f"model {spec.label} cannot be narrowed to {factor} of its width (only built-in models "
                             f"scale); for hassle set algorithm.options.residual_width: 1.0 (full-size residual "
                             f"models) or use small_cnn / wrn28_2")
        return dict(spec.options)


class LibraryProvider(ModelProvider):
    """A library's networks by name (`<prefix>/<name>`), with the options the kit sets itself or never allows."""

    prefix: str = ""
    example: str = ""  # a model of the library, named when the name is missing
    reserved: dict[str, str] = {}  # option -> what to do instead

    def check(self, spec: ModelSpec, name: str) -> None:
        if not name:
            raise ValueError(f"model {spec.name!r} names no {self.prefix} model, e.g. {self.prefix}/{self.example}")
        for key, instead in self.reserved.items():
            if key in spec.options:
                raise ValueError(f"options.{key} is not allowed for model {spec.name}: {instead}")
        check_norm(spec)


@dataclass(frozen=True)
class BuiltInModel:
    """A network that ships with the kit (or a test): its builder, its options and, optionally, their checks and
    how to scale its width."""

    name: str
    build: Callable[[ModelSpec], nn.Module]
    options: tuple[str, ...]
    check: Callable[[ModelSpec], None] | None = None
    scale: Callable[[dict[str, Any], float], dict[str, Any]] | None = None


BUILT_INS: dict[str, BuiltInModel] = {}
PROVIDERS: dict[str, ModelProvider] = {}


def register_model(name: str, *, options: tuple[str, ...] = (), check: Callable[[ModelSpec], None] | None = None,
                   scale: Callable[[dict[str, Any], float], dict[str, Any]] | None = None
                   ) -> Callable[[Callable[[ModelSpec], nn.Module]], Callable[[ModelSpec], nn.Module]]:
    """Decorator: `build(spec)` becomes the built-in model `name`. It builds for spec.num_classes,
    spec.in_channels and spec.image_size; `options` are the keys model.options may hold (any other is refused by
    name; `norm` is always allowed: the registry applies it); `check(spec)` refuses a bad value in one line;
    `scale(options, factor)` returns the options of a network `factor` times as wide (HASSLE's compact models),
    none: only factor 1. A name is never replaced silently."""
    if not name or "/" in name:
        raise ValueError(f"a built-in model name is one word without '/', got {name!r}")

    def register(build: Callable[[ModelSpec], nn.Module]) -> Callable[[ModelSpec], nn.Module]:
        if name in BUILT_INS:
            raise ValueError(f"a model named {name!r} is already registered")
        allowed = tuple(options) if "norm" in options else (*options, "norm")
        BUILT_INS[name] = BuiltInModel(name, build, allowed, check, scale)
        return build

    return register


def register_provider(prefix: str, provider: ModelProvider) -> ModelProvider:
    """Serve `<prefix>/<name>` models from ``provider`` (refused when the prefix is taken)."""
    if prefix in PROVIDERS:
        raise ValueError(f"a model provider for {prefix!r} is already registered")
    PROVIDERS[prefix] = provider
    return provider


class BuiltInProvider(ModelProvider):
    """The registered built-ins: the kit's own code, so no meta-device probe at config time."""

    probe = False

    def check(self, spec: ModelSpec, name: str) -> None:
        entry = BUILT_INS[name]
        unknown = sorted(set(spec.options) - set(entry.options))
        if unknown:
            raise ValueError(f"unknown options.{unknown[0]} for model {name}; its options are "
                             f"{', '.join(entry.options)}")
        check_norm(spec)
        if entry.check is not None:
            entry.check(spec)

    def create(self, spec: ModelSpec, name: str) -> nn.Module:
        return BUILT_INS[name].build(spec)

    def scaled_options(self, spec: ModelSpec, name: str, factor: float) -> dict[str, Any]:
        scale = BUILT_INS[name].scale
        if scale is None:
            if factor != 1:
                raise ValueError(f"model {name} cannot be narrowed to {factor} of its width (it has no width to "
                                 "scale); for hassle set algorithm.options.residual_width: 1.0 (full-size residual "
                                 "models) or use small_cnn / wrn28_2")
            return dict(spec.options)
        return scale(dict(spec.options), factor)


BUILT_IN = BuiltInProvider()


def model_names() -> list[str]:
    """What model.name may say: every built-in, then `<prefix>/<name>` per provider."""
    return [*BUILT_INS, *(f"{prefix}/<name>" for prefix in PROVIDERS if prefix != FACTORY)]


def resolve(spec: ModelSpec) -> tuple[ModelProvider, str]:
    """The provider of spec's network and the name it knows it by."""
    if spec.factory:
        return PROVIDERS[FACTORY], spec.factory
    prefix, slash, name = spec.name.partition("/")
    if slash and prefix in PROVIDERS and prefix != FACTORY:
        return PROVIDERS[prefix], name
    if spec.name in BUILT_INS:
        return BUILT_IN, spec.name
    raise ValueError(f"unknown model {spec.name!r}; choose one of {', '.join(model_names())}")


def build_model(spec: ModelSpec) -> nn.Module:
    provider, name = resolve(spec)
    provider.check(spec, name)
    return apply_norm(provider.create(spec, name), spec.norm)


def check_model(spec: ModelSpec) -> None:
    provider, name = resolve(spec)
    provider.check(spec, name)
    if provider.probe:
        probe(spec, provider, name)


def _meta_trouble(err: BaseException) -> bool:
    """Whether a build failed only for being on the meta device (itself, or as the cause a provider wrapped: a user
    factory's builder calling .item() raises a RuntimeError, which its provider reports as a ValueError)."""
    for e in (err, err.__cause__):
        if isinstance(e, NotImplementedError) or (isinstance(e, RuntimeError) and "meta" in str(e)):
            return True
    return False


def probe(spec: ModelSpec, provider: ModelProvider, name: str) -> None:
    """Build spec's network and run one training-mode batch through it on the meta device (shapes only, no
    memory, no arithmetic): a bad option, a stem that cannot change or an image size the network cannot take fails
    here, at config time, with one line."""
    def make() -> nn.Module:
        return apply_norm(provider.create(spec, name), spec.norm)

    try:
        with torch.device("meta"):
            model = make()
    except Exception as err:  # code that computes with tensors (regnet's widths) cannot run on meta: build on the CPU
        if not _meta_trouble(err):
            raise
        model = make().to("meta")
    for layer in model.modules():  # a meta tensor has no value for static BN's 1/num_batches_tracked; same shapes
        if isinstance(layer, nn.modules.batchnorm._BatchNorm):
            layer.momentum = 0.1
    x = torch.zeros(2, spec.in_channels, spec.image_size, spec.image_size, device="meta")
    try:
        with torch.no_grad():
            out = model.train()(x)
    except Exception as err:  # e.g. too small for alexnet's pooling, not a multiple of vit's patch size
        raise ValueError(f"model {spec.label} cannot take {spec.in_channels}x{spec.image_size}x{spec.image_size} "
                         f"images: {err}") from err
    if not isinstance(out, torch.Tensor) or tuple(out.shape) != (2, spec.num_classes):
        shape = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
        raise ValueError(f"model {spec.label} returns {shape} while training, not (batch, {spec.num_classes}) logits")


def scaled_options(spec: ModelSpec, factor: float) -> dict[str, Any]:
    if factor <= 0:
        raise ValueError(f"a width factor must be positive, got {factor}")
    provider, name = resolve(spec)
    return provider.scaled_options(spec, name, factor)
