"""The one registry that builds a network: models with static batch norm (sBN, SemiFL Appendix B), or group norm
for sample-level DP.

A spec names a built-in (`small_cnn`, `wrn28_2`), a torchvision classification builder (`torchvision/resnet18`),
with the `timm` extra a timm model (`timm/resnet18`), or the user's own factory (`factory: "their_pkg.models:build"`,
a callable installed where it runs; a silo builds one only when its own operator named it). The registry applies the kit's conventions once, so no
algorithm special-cases a network: the class count, the input channels (a new stem) and static BN. Nothing is ever
downloaded: pretrained weights are refused; starting weights come from a file the operator names instead
(`read_weights`, `load_weights`: hub.yaml's model.init_weights and model.init_from_run).

Every BatchNorm normalises with the batch's own statistics while training and keeps no useful running estimate of
its own; the global statistics used for inference and pseudo-labelling are computed explicitly by `silo_core.sbn`
(hub data) and travel with the model as the BN buffers.
"""

from __future__ import annotations

import difflib
import hashlib
import importlib
import inspect
import json
import re
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file
from torch import nn

NORMS = ("batch", "group")


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


HEADS = ("pool", "flatten")


class SmallCNN(nn.Module):
    """A compact CNN for 28x28 (or 32x32) images. It pools early because convolutions at full resolution dominate
    the cost on a CPU: about 3.7M multiply-adds per 28x28 image at width 16.

    ``head`` "pool" averages the last feature maps over the image; "flatten" gives the classifier every position
    of them (7x7 for 28 px images), so it can tell where a feature is (a collar, a sleeve), for 31k more weights
    and almost no compute."""

    def __init__(self, in_channels: int = 1, num_classes: int = 10, width: int = 16, norm: str = "batch",
                 head: str = "pool", image_size: int = 28):
        super().__init__()
        if head not in HEADS:
            raise ValueError(f"unknown small_cnn head {head!r}; choose one of {', '.join(HEADS)}")

        def block(cin: int, cout: int) -> list[nn.Module]:
            return [nn.Conv2d(cin, cout, 3, padding=1, bias=False), norm2d(cout, norm), nn.ReLU()]

        self.features = nn.Sequential(
            *block(in_channels, width),
            nn.MaxPool2d(2),
            *block(width, 2 * width),
            *block(2 * width, 2 * width),
            nn.MaxPool2d(2),
            *block(2 * width, 4 * width),
        )
        side = image_size // 2 // 2  # after the two 2x2 max-pools
        self.pool = nn.AdaptiveAvgPool2d(1) if head == "pool" else nn.Identity()
        self.classifier = nn.Linear(4 * width * (1 if head == "pool" else side * side), num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(torch.flatten(self.pool(self.features(x)), 1))


class _WideBasic(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int, norm: str = "batch"):
        super().__init__()
        self.bn1 = norm2d(cin, norm)
        self.conv1 = nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False)
        self.bn2 = norm2d(cout, norm)
        self.conv2 = nn.Conv2d(cout, cout, 3, stride=1, padding=1, bias=False)
        self.shortcut = None
        if stride != 1 or cin != cout:
            self.shortcut = nn.Conv2d(cin, cout, 1, stride=stride, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.relu(self.bn1(x))
        skip = x if self.shortcut is None else self.shortcut(out)
        out = self.conv1(out)
        out = self.conv2(torch.relu(self.bn2(out)))
        return out + skip


class WideResNet(nn.Module):
    """WRN-depth-k (Zagoruyko & Komodakis); WRN-28-2 has about 1.47M parameters, the SemiFL paper's model."""

    def __init__(self, in_channels: int = 3, num_classes: int = 10, depth: int = 28, widen: int = 2,
                 scale: float = 1.0, norm: str = "batch"):
        super().__init__()
        if (depth - 4) % 6 != 0:
            raise ValueError(f"WideResNet depth must be 6n+4, got {depth}")
        if scale <= 0:
            raise ValueError(f"WideResNet scale must be positive, got {scale}")
        n = (depth - 4) // 6
        # `scale` multiplies every channel count (HASSLE's compact residual models use 1/4 of the channels).
        widths = [max(1, round(c * scale)) for c in (16, 16 * widen, 32 * widen, 64 * widen)]
        self.conv = nn.Conv2d(in_channels, widths[0], 3, padding=1, bias=False)
        layers: list[nn.Module] = []
        cin = widths[0]
        for stage, cout in enumerate(widths[1:]):
            for i in range(n):
                layers.append(_WideBasic(cin, cout, stride=(2 if stage > 0 and i == 0 else 1), norm=norm))
                cin = cout
        self.blocks = nn.Sequential(*layers)
        self.bn = norm2d(cin, norm)
        self.fc = nn.Linear(cin, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.relu(self.bn(self.blocks(self.conv(x))))
        out = torch.flatten(nn.functional.adaptive_avg_pool2d(out, 1), 1)
        return self.fc(out)


MODEL_OPTIONS = {"small_cnn": ("width", "norm", "head"), "wrn28_2": ("widen", "scale", "norm")}  # each model's options
MODELS = tuple(MODEL_OPTIONS)
LIBRARIES = ("torchvision", "timm")  # `<library>/<name>` builds that library's classification network

# Options the kit sets itself (from the hub's data and the model section) or never allows (nothing downloads:
# pretrained weights come from a file, model.init_weights), per library, with what to do instead.
_FROM_FILE = "nothing is downloaded; leave it out, and name a weights file in model.init_weights to start from one"
_RESERVED = {
    "torchvision": {"weights": _FROM_FILE,
                    "weights_backbone": _FROM_FILE,
                    "num_classes": "the class count comes from the hub's labeled data",
                    "image_size": "set model.image_size", "input_size": "set model.image_size"},
    "timm": {"pretrained": _FROM_FILE,
             "pretrained_cfg": "nothing is downloaded; leave it out", "pretrained_cfg_overlay": "nothing is downloaded",
             "checkpoint_path": "name the checkpoint in model.init_weights instead (only the hub reads it)",
             "num_classes": "the class count comes from the hub's labeled data",
             "in_chans": "set model.in_channels", "img_size": "set model.image_size"},
}
# Builder defaults that differ from torchvision's: the kit trains on one tensor of logits, so no auxiliary heads;
# init_weights=True is torchvision's own behaviour, said out loud to silence its FutureWarning.
_TORCHVISION_DEFAULTS = {"googlenet": {"aux_logits": False, "init_weights": True},
                         "inception_v3": {"aux_logits": False, "init_weights": True}}
_EXAMPLES = ("resnet18", "resnet50", "densenet121", "efficientnet_b0", "mobilenet_v3_small", "convnext_tiny",
             "regnet_y_400mf", "vit_b_16")


def _library(name: str) -> tuple[str, str] | None:
    """('torchvision', 'resnet18') for 'torchvision/resnet18'; None for a built-in name."""
    library, slash, model = name.partition("/")
    return (library, model) if slash and library in LIBRARIES else None


def _import_timm() -> Any:
    try:
        return importlib.import_module("timm")
    except ImportError:
        raise ValueError('timm/<name> models need timm: pip install "silokit[timm]"') from None


def _torchvision_builder(name: str) -> Callable[..., nn.Module]:
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


def _library_builder(library: str, name: str, spec: ModelSpec) -> Callable[[], nn.Module]:
    """A call that builds the library's own network for spec: its class count, input size and the user's options
    (less ours). The name is checked here; the options only when the builder runs."""
    options = {k: v for k, v in spec.options.items() if k != "norm"}  # norm is ours: applied afterwards
    if library == "torchvision":
        builder = _torchvision_builder(name)
        # Transformers fix their input size at build time (vit: image_size, maxvit: input_size); the rest pool
        # adaptively. The builders take **kwargs, so the network class they return says which it accepts.
        accepts = inspect.signature(typing.get_type_hints(builder)["return"].__init__).parameters
        size: dict[str, Any] = {"image_size": spec.image_size} if "image_size" in accepts else {}
        if "input_size" in accepts:
            size["input_size"] = (spec.image_size, spec.image_size)
        kwargs = {**_TORCHVISION_DEFAULTS.get(name, {}), **size, **options}
        return lambda: builder(weights=None, num_classes=spec.num_classes, **kwargs)
    timm = _import_timm()
    if not timm.is_model(name):
        near = difflib.get_close_matches(name, timm.list_models(), n=4, cutoff=0.6)
        raise ValueError(f"unknown timm model {name!r}; " + (f"did you mean {', '.join(near)}? " if near else "")
                         + "timm.list_models() lists them all")
    args = dict(pretrained=False, num_classes=spec.num_classes, in_chans=spec.in_channels, **options)

    def create() -> nn.Module:
        try:  # transformers need the image size (img_size); a convolutional net's class refuses the keyword
            return timm.create_model(name, img_size=spec.image_size, **args)
        except TypeError as err:
            if "img_size" not in str(err):
                raise
            return timm.create_model(name, **args)

    return create


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


def _options_error(spec: ModelSpec, err: Exception) -> ValueError:
    """One line naming the option a library's builder refused, or what went wrong."""
    unexpected = re.search(r"unexpected keyword argument '(\w+)'", str(err))
    if unexpected:
        return ValueError(f"unknown options.{unexpected.group(1)} for model {spec.name} ({err})")
    return ValueError(f"model {spec.name} cannot be built for {spec.in_channels}x{spec.image_size}x{spec.image_size} "
                      f"images with options {spec.options}: {type(err).__name__}: {err}")


def _external_model(spec: ModelSpec, library: str, name: str) -> nn.Module:
    build = _library_builder(library, name, spec)
    try:
        model = build()
    except NotImplementedError:  # not the options' fault: see _probe
        raise
    except Exception as err:  # whatever a builder raises for a bad option, said in one line naming the model
        raise _options_error(spec, err) from err
    if library == "torchvision":  # timm takes in_chans itself
        adapt_stem(model, spec.in_channels)
    return group_norms(model) if spec.norm == "group" else static_batchnorm(model)


# ------------------------------------------------------------------------------ the user's own factory

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


def _factory_model(spec: ModelSpec) -> nn.Module:
    """The factory's network for spec: called with the class count, input channels, image size and the user's
    options (less norm, which is ours), then given the kit's static BN (or group norm) like every other model."""
    build = load_factory(str(spec.factory))
    options = {k: v for k, v in spec.options.items() if k != "norm"}
    try:
        model = build(num_classes=spec.num_classes, in_channels=spec.in_channels, image_size=spec.image_size,
                      **options)
    except Exception as err:
        raise ValueError(f"model factory {spec.factory} failed for {spec.num_classes} classes, "
                         f"{spec.in_channels}x{spec.image_size}x{spec.image_size} images and options {options}: "
                         f"{type(err).__name__}: {err}") from err
    if not isinstance(model, nn.Module):
        raise ValueError(f"model factory {spec.factory} returned a {type(model).__name__}, not a torch.nn.Module")
    return group_norms(model) if spec.norm == "group" else static_batchnorm(model)


# ------------------------------------------------------------------------------ the architecture's fingerprint

@dataclass(frozen=True)
class TensorShape:
    """One parameter or buffer of a network: what the hub sends so a silo can tell its build is the same."""

    name: str
    shape: tuple[int, ...]
    dtype: str


def architecture(model: nn.Module) -> list[TensorShape]:
    """Names, shapes and dtypes of every parameter and buffer, in state-dict order."""
    return [TensorShape(name, tuple(t.shape), str(t.dtype).removeprefix("torch."))
            for name, t in model.state_dict().items()]


def architecture_sha256(shapes: list[TensorShape]) -> str:
    """One hex digest of an architecture, for the model card and logs."""
    text = json.dumps([[t.name, list(t.shape), t.dtype] for t in shapes], separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


def architecture_difference(expected: list[TensorShape], built: list[TensorShape]) -> str | None:
    """None when ``built`` matches ``expected`` exactly; else one line naming the first tensor that differs."""
    theirs = {t.name: t for t in expected}
    ours = {t.name: t for t in built}
    for t in expected:
        mine = ours.get(t.name)
        if mine is None:
            return f"the hub's model has {t.name} {list(t.shape)} {t.dtype}, which this build lacks"
        if mine != t:
            return (f"{t.name} is {list(mine.shape)} {mine.dtype} here but {list(t.shape)} {t.dtype} at the hub")
    extra = next((t for t in built if t.name not in theirs), None)
    if extra is not None:
        return f"this build has {extra.name} {list(extra.shape)} {extra.dtype}, which the hub's model lacks"
    return None


def _probe(spec: ModelSpec, library: str, name: str) -> None:
    """Build spec's network and run one training-mode batch through it on the meta device (shapes only, no
    memory, no arithmetic): a bad option, a stem that cannot change or an image size the network cannot take fails
    here, at config time, with one line."""
    make = (lambda: _factory_model(spec)) if library == "factory" else (lambda: _external_model(spec, library, name))
    try:
        with torch.device("meta"):
            model = make()
    except (NotImplementedError, RuntimeError):  # code that computes with tensors (regnet's widths) cannot run on meta
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


@dataclass
class ModelSpec:
    """Everything both sides need to build the same network and feed it the same way."""

    name: str = "small_cnn"
    num_classes: int = 10
    in_channels: int = 1
    image_size: int = 28
    mean: list[float] = field(default_factory=lambda: [0.5])
    std: list[float] = field(default_factory=lambda: [0.5])
    options: dict[str, Any] = field(default_factory=dict)
    factory: str | None = None  # "package.module:callable" building the network; then name is only a label

    @property
    def norm(self) -> str:
        return str(self.options.get("norm", "batch"))

    @property
    def label(self) -> str:
        """What to call the network in logs and errors."""
        return f"factory {self.factory}" if self.factory else self.name

    def build(self) -> nn.Module:
        if self.factory:
            if self.norm not in NORMS:
                raise ValueError(f"unknown options.norm {self.norm!r}; choose one of {', '.join(NORMS)}")
            return _factory_model(self)
        external = _library(self.name)
        if external:
            self._check_library_options(*external)
            return _external_model(self, *external)
        self.check_options()
        if self.name == "small_cnn":
            return SmallCNN(self.in_channels, self.num_classes, width=int(self.options.get("width", 16)),
                            norm=self.norm, head=str(self.options.get("head", "pool")), image_size=self.image_size)
        if self.name == "wrn28_2":
            return WideResNet(self.in_channels, self.num_classes, depth=28, widen=int(self.options.get("widen", 2)),
                              scale=float(self.options.get("scale", 1.0)), norm=self.norm)
        raise AssertionError(self.name)  # check_options refused every other name

    def check_options(self) -> None:
        """Refuse an option this model does not have (a typo would otherwise be ignored) or a value it cannot take.
        A library's network is built once on the meta device to ask its builder (no memory, no arithmetic); so is
        a factory's, which imports its package."""
        if self.factory:
            if self.norm not in NORMS:
                raise ValueError(f"unknown options.norm {self.norm!r}; choose one of {', '.join(NORMS)}")
            _probe(self, "factory", self.factory)
            return
        external = _library(self.name)
        if external:
            self._check_library_options(*external)
            _probe(self, *external)
            return
        if self.name not in MODEL_OPTIONS:
            raise ValueError(f"unknown model {self.name!r}; choose one of "
                             f"{', '.join(MODELS)}, {', '.join(lib + '/<name>' for lib in LIBRARIES)}")
        allowed = MODEL_OPTIONS[self.name]
        unknown = sorted(set(self.options) - set(allowed))
        if unknown:
            raise ValueError(f"unknown options.{unknown[0]} for model {self.name}; its options are "
                             f"{', '.join(allowed)}")
        if self.norm not in NORMS:
            raise ValueError(f"unknown options.norm {self.norm!r}; choose one of {', '.join(NORMS)}")
        if self.options.get("head", "pool") not in HEADS:
            raise ValueError(f"unknown options.head {self.options['head']!r}; choose one of {', '.join(HEADS)}")
        # Upper bounds far above any useful network: a typo (width 16000) fails here, not as memory exhausted.
        for key, most in (("width", 4096), ("widen", 64)):
            value = self.options.get(key, 1)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"options.{key} must be a positive whole number, got {value!r}")
            if value > most:
                raise ValueError(f"options.{key} must be at most {most}, got {value!r}")
        scale = self.options.get("scale", 1.0)
        if isinstance(scale, bool) or not isinstance(scale, int | float) or not scale > 0:
            raise ValueError(f"options.scale must be a positive number, got {scale!r}")
        if not scale <= 64:  # also refuses inf
            raise ValueError(f"options.scale must be a finite number up to 64, got {scale!r}")

    def _check_library_options(self, library: str, name: str) -> None:
        """Our own checks before the library's builder sees the options."""
        if not name:
            raise ValueError(f"model {self.name!r} names no {library} model, e.g. {library}/resnet18")
        for key, instead in _RESERVED[library].items():
            if key in self.options:
                raise ValueError(f"options.{key} is not allowed for model {self.name}: {instead}")
        if self.norm not in NORMS:
            raise ValueError(f"unknown options.norm {self.norm!r}; choose one of {', '.join(NORMS)}")

    def scaled(self, factor: float) -> ModelSpec:
        """The same architecture with every channel count multiplied by ``factor`` (e.g. 0.25 for a compact
        residual model); inputs, classes and normalisation unchanged. A library's network has no single width to
        scale: only factor 1 (the same network) is possible for it."""
        if factor <= 0:
            raise ValueError(f"a width factor must be positive, got {factor}")
        if (self.factory or _library(self.name)) and factor != 1:
            raise ValueError(f"model {self.label} cannot be narrowed to {factor} of its width (only built-in models "
                             f"scale); for hassle set algorithm.options.residual_width: 1.0 (full-size residual "
                             f"models) or use small_cnn / wrn28_2")
        options = dict(self.options)
        if self.factory or _library(self.name):
            pass  # factor 1: the same network
        elif self.name == "small_cnn":
            options["width"] = max(1, round(int(options.get("width", 16)) * factor))
        else:
            options["scale"] = float(options.get("scale", 1.0)) * factor
        return ModelSpec(self.name, self.num_classes, self.in_channels, self.image_size, list(self.mean),
                         list(self.std), options, self.factory)


def trainable_names(model: nn.Module) -> list[str]:
    return [name for name, p in model.named_parameters() if p.requires_grad]


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


# ------------------------------------------------------------------------------ initial weights from a file

RUN_WEIGHTS, RUN_CARD = "model.safetensors", "model_card.json"  # what a finished run leaves in its state folder
_WRAPPERS = ("state_dict", "model_state_dict", "model")  # where training scripts nest the weights in a checkpoint
_PREFIXES = ("module.", "_orig_mod.")  # added by DataParallel/DistributedDataParallel and by torch.compile
_BN_STATS = ("running_mean", "running_var", "num_batches_tracked")


@dataclass
class WeightsReport:
    """What `load_weights` did to each of the model's tensors, for the hub's log and `silo-server --check`."""

    source: str
    loaded: list[str] = field(default_factory=list)
    summed_stem: list[str] = field(default_factory=list)  # 3-channel convolutions summed into a 1-channel one
    head: list[str] = field(default_factory=list)  # the classifier, left as initialised: another class count
    head_classes: tuple[int, int] = (0, 0)  # (in the file, here)
    missing: list[str] = field(default_factory=list)  # the model's tensors the file lacks: left as initialised
    unexpected: list[str] = field(default_factory=list)  # the file's tensors the model lacks: ignored

    @property
    def missing_weights(self) -> list[str]:
        """Missing tensors that matter: BN running statistics are recomputed from the hub's data (static BN)."""
        return [n for n in self.missing if n.rpartition(".")[2] not in _BN_STATS]

    @property
    def worrying(self) -> bool:
        """Missing weights or unexpected tensors: the file may be another architecture's, mostly left unused."""
        return bool(self.missing_weights or self.unexpected)

    def summary(self) -> str:
        total = len(self.loaded) + len(self.summed_stem) + len(self.head) + len(self.missing)
        parts = [f"initial weights from {self.source}: {len(self.loaded) + len(self.summed_stem)} of {total} "
                 "tensors loaded"]
        if self.summed_stem:
            parts.append(f"{', '.join(self.summed_stem)} summed over 3 colour channels for 1-channel images")
        if self.head:
            parts.append(f"classifier {', '.join(self.head)} re-initialised ({self.head_classes[0]} classes in the "
                         f"file, {self.head_classes[1]} here)")
        if self.missing:
            stats = len(self.missing) - len(self.missing_weights)
            parts.append(f"{len(self.missing)} missing" + (f" ({stats} BN statistics, recomputed)" if stats else ""))
        if self.unexpected:
            parts.append(f"{len(self.unexpected)} unexpected (ignored)")
        return "; ".join(parts)

    def lines(self) -> list[str]:
        """The summary, then the first few names of what was missing or unexpected."""
        def first(names: list[str]) -> str:
            return ", ".join(names[:5]) + (f", ... ({len(names) - 5} more)" if len(names) > 5 else "")

        lines = [self.summary()]
        if self.missing_weights:
            lines.append(f"missing from the file, left as initialised: {first(self.missing_weights)}")
        if self.unexpected:
            lines.append(f"in the file but not in the model, ignored: {first(self.unexpected)}")
        return lines


def read_weights(path: Path | str) -> dict[str, torch.Tensor]:
    """A file's tensors by name: safetensors, or a PyTorch checkpoint read with weights_only=True (a checkpoint can
    carry code to run; weights_only refuses anything but tensors and plain containers). The weights may be nested
    under `state_dict`, `model_state_dict` or `model`, with DataParallel's `module.` prefix: both undone here."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            head = f.read(9)
        # A safetensors file opens with its header's length (8 bytes) and the header's JSON '{'; torch writes a zip.
        if len(head) == 9 and head[8:] == b"{":
            raw: Any = load_file(str(path))
        else:
            raw = torch.load(path, map_location="cpu", weights_only=True)
    except OSError as err:
        raise ValueError(f"cannot read initial weights {path}: {err}") from None
    except Exception as err:  # safetensors' and unpickling's own errors, of several types
        why = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ValueError(f"{path} is not a safetensors file or a PyTorch checkpoint that loads with "
                         f"weights_only=True: {why}") from None
    # A training checkpoint keeps other things beside the weights (epoch, optimizer, even a tensor best_acc1).
    while isinstance(raw, dict) and (inner := next((raw[k] for k in _WRAPPERS if isinstance(raw.get(k), dict)),
                                                   None)) is not None:
        raw = inner
    tensors = {str(k): v for k, v in raw.items() if isinstance(v, torch.Tensor)} if isinstance(raw, dict) else {}
    if not tensors:
        keys = ", ".join(map(str, list(raw)[:8])) if isinstance(raw, dict) else type(raw).__name__
        raise ValueError(f"{path} holds no tensors by name (found: {keys}); save model.state_dict()")
    for prefix in _PREFIXES:  # only when every name has it: a model may have a submodule called `module`
        if all(k.startswith(prefix) for k in tensors):
            tensors = {k[len(prefix):]: v for k, v in tensors.items()}
    for name, t in tensors.items():
        if t.is_floating_point() and not torch.isfinite(t).all():
            raise ValueError(f"{path} holds NaN or infinite values in {name}")
    return tensors


def read_run_weights(directory: Path | str, spec: ModelSpec) -> dict[str, torch.Tensor]:
    """An earlier run's final model (its state folder's model.safetensors), to warm-start from. The model card,
    when there is one, must describe the same network: to start from another run's weights with another class
    count, name its model.safetensors in model.init_weights instead (the classifier is then re-initialised)."""
    directory = Path(directory)
    card_path = directory / RUN_CARD
    if card_path.is_file():
        try:
            card = json.loads(card_path.read_text())["model"]
            theirs = {key: card.get(key) for key in ("name", "factory", "in_channels", "num_classes")}
        except (OSError, ValueError, KeyError, TypeError) as err:
            raise ValueError(f"{card_path} is not a silokit model card ({type(err).__name__}: {err})") from None
        ours = {"name": spec.name, "factory": spec.factory, "in_channels": spec.in_channels,
                "num_classes": spec.num_classes}
        wrong = [key for key in ours if theirs[key] != ours[key]]
        if wrong:
            said = ", ".join(f"{k} {theirs[k]!r} there, {ours[k]!r} here" for k in wrong)
            raise ValueError(f"model.init_from_run: the run in {directory} trained another model ({said}); "
                             f"match model.name/in_channels to it, or start from its weights with model.init_weights: "
                             f"{directory / RUN_WEIGHTS} (a different class count re-initialises the classifier)")
    return read_weights(directory / RUN_WEIGHTS)


def _head_names(model: nn.Module, num_classes: int) -> set[str]:
    """The classifier's tensors: those of the last Linear or Conv2d with num_classes outputs (resnet `fc`, vit
    `heads.head`, squeezenet's final convolution), or of the last Linear when none has."""
    layers = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Linear | nn.Conv2d)]
    outputs = [(n, m) for n, m in layers if (m.out_features if isinstance(m, nn.Linear) else m.out_channels)
               == num_classes]
    linear = [(n, m) for n, m in layers if isinstance(m, nn.Linear)]
    chosen = (outputs or linear)[-1:] if layers else []
    return {f"{n}.{p}" if n else p for n, m in chosen for p, _ in m.named_parameters(recurse=False)}


@torch.no_grad()
def load_weights(model: nn.Module, weights: dict[str, torch.Tensor], num_classes: int,
                 source: str = "a file") -> WeightsReport:
    """Copy a file's weights (`read_weights`) into a freshly built model, in place, and say what happened.

    - A tensor of the same name and shape is copied (cast to the model's dtype).
    - A 3-channel stem (a 4-D convolution weight (out, 3, k, k)) going into a 1-channel model (out, 1, k, k) is
      summed over colour: grayscale images then give the first layer what the colour network saw for gray pixels.
    - The classifier (`_head_names`) stays as initialised when its shape differs: another class count.
    - Any other shape difference is a ValueError naming the tensor and both shapes: a different architecture.
    - The model's tensors that the file lacks stay as initialised and are listed: BN running statistics are
      harmless (static BN recomputes them from the hub's data), missing weights are reported as a warning, not an
      error, since a file may leave out parts on purpose (an extra layer, a new block). A file of which nothing
      matches is a ValueError: it is surely another network's.
    - The file's tensors that the model lacks are listed and ignored."""
    report = WeightsReport(source)
    state = model.state_dict()
    head = _head_names(model, num_classes)
    for name, target in state.items():
        if name not in weights:
            report.missing.append(name)
            continue
        value = weights[name]
        if value.shape == target.shape:
            report.loaded.append(name)
        elif value.dim() == 4 and value.shape[1] == 3 and target.shape == (value.shape[0], 1, *value.shape[2:]):
            value = value.sum(dim=1, keepdim=True)
            report.summed_stem.append(name)
        elif name in head and value.dim() == target.dim() and value.shape[1:] == target.shape[1:]:
            report.head.append(name)
            report.head_classes = (int(value.shape[0]), int(target.shape[0]))
            continue
        else:
            hint = (" (set model.in_channels to the file's channel count)" if value.dim() == 4
                    and value.shape[0] == target.shape[0] and value.shape[2:] == target.shape[2:] else "")
            raise ValueError(f"initial weights from {source}: {name} has shape {tuple(value.shape)} in the file but "
                             f"{tuple(target.shape)} in model{hint}; the file is another architecture's or built "
                             "with other options")
        target.copy_(value.to(target.dtype))
    report.unexpected = [name for name in weights if name not in state]
    if not report.loaded and not report.summed_stem:
        raise ValueError(f"initial weights from {source}: no tensor name matches the model's (the file has e.g. "
                         f"{', '.join(list(weights)[:3])}; the model {', '.join(list(state)[:3])})")
    return report
