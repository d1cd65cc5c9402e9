"""Model factories for the tests: what a user's own package (`model.factory: "their_pkg.models:build"`) looks like.
Hub and silo processes started from the repository root can import it as tests.model_factories."""

from __future__ import annotations

from torch import nn

# A silo whose copy of the package differs from the hub's (another release, a local edit) builds another network
# under the same name; the tests change this to make one.
HIDDEN_WIDTH = 8


def tiny_net(num_classes: int, in_channels: int, image_size: int, width: int = 8) -> nn.Module:
    """A small convolutional network; `width` arrives from model.options."""
    return nn.Sequential(
        nn.Conv2d(in_channels, width, 3, padding=1), nn.BatchNorm2d(width), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(),
        nn.Linear(width, HIDDEN_WIDTH), nn.ReLU(), nn.Linear(HIDDEN_WIDTH, num_classes),
    )


def not_a_model(num_classes: int, in_channels: int, image_size: int) -> str:
    return "a string"


def wrong_output(num_classes: int, in_channels: int, image_size: int) -> nn.Module:
    return nn.Sequential(nn.Flatten(), nn.Linear(in_channels * image_size * image_size, num_classes + 1))


def widths_from_tensors(num_classes: int, in_channels: int, image_size: int) -> nn.Module:
    """Works out its width with tensor arithmetic, as torchvision's regnet does: no value on the meta device."""
    import torch

    width = int(torch.tensor(4.0).mul(2).item())
    return nn.Sequential(nn.Conv2d(in_channels, width, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
                         nn.Flatten(), nn.Linear(width, num_classes))


NOT_CALLABLE = 3
