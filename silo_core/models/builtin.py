"""The built-in networks, registered by name: `small_cnn` (28x28 or 32x32 images, cheap on a CPU) and `wrn28_2`
(WRN-28-2, the SemiFL paper's model). Both take the kit's norm themselves (`norm2d`) and scale their width for
HASSLE's compact residual models."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from silo_core.models.registry import norm2d, register_model

if TYPE_CHECKING:
    from silo_core.models.spec import ModelSpec

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


# ------------------------------------------------------------------------------ their options, checked by hand

def _whole(options: dict[str, Any], key: str, most: int) -> None:
    """A positive whole number up to ``most``: far above any useful network, so that a typo (width 16000) fails
    here, not as memory exhausted."""
    value = options.get(key, 1)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"options.{key} must be a positive whole number, got {value!r}")
    if value > most:
        raise ValueError(f"options.{key} must be at most {most}, got {value!r}")


def _check_small_cnn(spec: ModelSpec) -> None:
    if spec.options.get("head", "pool") not in HEADS:
        raise ValueError(f"unknown options.head {spec.options['head']!r}; choose one of {', '.join(HEADS)}")
    _whole(spec.options, "width", 4096)


def _check_wrn(spec: ModelSpec) -> None:
    _whole(spec.options, "widen", 64)
    scale = spec.options.get("scale", 1.0)
    if isinstance(scale, bool) or not isinstance(scale, int | float) or not scale > 0:
        raise ValueError(f"options.scale must be a positive number, got {scale!r}")
    if not scale <= 64:  # also refuses inf
        raise ValueError(f"options.scale must be a finite number up to 64, got {scale!r}")


def _scale_small_cnn(options: dict[str, Any], factor: float) -> dict[str, Any]:
    return {**options, "width": max(1, round(int(options.get("width", 16)) * factor))}


def _scale_wrn(options: dict[str, Any], factor: float) -> dict[str, Any]:
    return {**options, "scale": float(options.get("scale", 1.0)) * factor}


@register_model("small_cnn", options=("width", "norm", "head"), check=_check_small_cnn, scale=_scale_small_cnn)
def small_cnn(spec: ModelSpec) -> nn.Module:
    return SmallCNN(spec.in_channels, spec.num_classes, width=int(spec.options.get("width", 16)), norm=spec.norm,
                    head=str(spec.options.get("head", "pool")), image_size=spec.image_size)


@register_model("wrn28_2", options=("widen", "scale", "norm"), check=_check_wrn, scale=_scale_wrn)
def wrn28_2(spec: ModelSpec) -> nn.Module:
    return WideResNet(spec.in_channels, spec.num_classes, depth=28, widen=int(spec.options.get("widen", 2)),
                      scale=float(spec.options.get("scale", 1.0)), norm=spec.norm)
