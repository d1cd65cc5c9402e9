"""Models with static batch norm (sBN, SemiFL Appendix B), or group norm for sample-level DP.

Every BatchNorm here normalises with the batch's own statistics while training and keeps no useful running
estimate of its own; the global statistics used for inference and pseudo-labelling are computed explicitly by
`silo_core.sbn` (hub data) and travel with the model as the BN buffers.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
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

    @property
    def norm(self) -> str:
        return str(self.options.get("norm", "batch"))

    def build(self) -> nn.Module:
        self.check_options()
        if self.name == "small_cnn":
            return SmallCNN(self.in_channels, self.num_classes, width=int(self.options.get("width", 16)),
                            norm=self.norm, head=str(self.options.get("head", "pool")), image_size=self.image_size)
        if self.name == "wrn28_2":
            return WideResNet(self.in_channels, self.num_classes, depth=28, widen=int(self.options.get("widen", 2)),
                              scale=float(self.options.get("scale", 1.0)), norm=self.norm)
        raise AssertionError(self.name)  # check_options refused every other name

    def check_options(self) -> None:
        """Refuse an option this model does not have (a typo would otherwise be ignored) or a value it cannot take."""
        if self.name not in MODEL_OPTIONS:
            raise ValueError(f"unknown model {self.name!r}; choose one of {', '.join(MODELS)}")
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

    def scaled(self, factor: float) -> ModelSpec:
        """The same architecture with every channel count multiplied by ``factor`` (e.g. 0.25 for a compact
        residual model); inputs, classes and normalisation unchanged."""
        if factor <= 0:
            raise ValueError(f"a width factor must be positive, got {factor}")
        options = dict(self.options)
        if self.name == "small_cnn":
            options["width"] = max(1, round(int(options.get("width", 16)) * factor))
        else:
            options["scale"] = float(options.get("scale", 1.0)) * factor
        return ModelSpec(self.name, self.num_classes, self.in_channels, self.image_size, list(self.mean),
                         list(self.std), options)


def trainable_names(model: nn.Module) -> list[str]:
    return [name for name, p in model.named_parameters() if p.requires_grad]


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
