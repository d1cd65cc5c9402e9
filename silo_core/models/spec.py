"""`ModelSpec`: everything both sides need to build the same network and feed it the same way. It is made in two
places only: from hub.yaml's model section at the hub (`from_config`) and from the run description a silo
receives (`from_run`), so the hub and every silo read the same fields the same way."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

import numpy as np
from torch import nn

from silo_core.models import registry


class ModelConfig(Protocol):
    """hub.yaml's model section (silo_server.config.ModelSection), as far as a spec needs it."""

    name: str
    factory: str | None
    in_channels: int
    image_size: int
    mean: list[float] | None
    std: list[float] | None
    options: dict[str, Any]


class RunModel(Protocol):
    """The model fields of the wire's RunDescription (silo.v1), as far as a spec needs them."""

    model: str
    num_classes: int
    in_channels: int
    image_size: int
    normalize_mean: Sequence[float]
    normalize_std: Sequence[float]
    model_options_json: str
    model_factory: str


def _from_float32(values: Sequence[float]) -> list[float]:
    """The wire carries the normalisation as float32: read each value back as the shortest decimal that float32
    stands for (0.485, not 0.48500001430511475), which is what hub.yaml wrote, so a silo normalises with the
    hub's own numbers."""
    return [float(str(np.float32(v))) for v in values]


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

    @classmethod
    def from_config(cls, model: ModelConfig, num_classes: int) -> ModelSpec:
        """The hub's spec: hub.yaml's model section, with the class count of the hub's labeled data. A factory's
        network is named by its factory; the normalisation defaults to 0.5 per channel."""
        channels = model.in_channels
        return cls(name=model.factory or model.name, num_classes=num_classes, in_channels=channels,
                   image_size=model.image_size, mean=list(model.mean or [0.5] * channels),
                   std=list(model.std or [0.5] * channels), options=dict(model.options), factory=model.factory)

    @classmethod
    def from_run(cls, run: RunModel) -> ModelSpec:
        """A silo's spec: the run description the hub sent (`from_config`'s spec, over the wire)."""
        options = json.loads(run.model_options_json or "{}")
        if not isinstance(options, dict):
            raise ValueError(f"the run's model options are not a JSON object: {run.model_options_json[:80]}")
        return cls(name=run.model, num_classes=run.num_classes, in_channels=run.in_channels,
                   image_size=run.image_size, mean=_from_float32(run.normalize_mean),
                   std=_from_float32(run.normalize_std), options=options, factory=run.model_factory or None)

    @property
    def norm(self) -> str:
        return str(self.options.get("norm", "batch"))

    @property
    def label(self) -> str:
        """What to call the network in logs and errors."""
        return f"factory {self.factory}" if self.factory else self.name

    def build(self) -> nn.Module:
        """The network, from its provider (silo_core/models/registry.py), with the kit's static BN or group norm."""
        return registry.build_model(self)

    def check_options(self) -> None:
        """Refuse an option this model does not have (a typo would otherwise be ignored) or a value it cannot take.
        A library's network is built once on the meta device to ask its builder (no memory, no arithmetic); so is
        a factory's, which imports its package."""
        registry.check_model(self)

    def scaled(self, factor: float) -> ModelSpec:
        """The same architecture with every channel count multiplied by ``factor`` (e.g. 0.25 for a compact
        residual model); inputs, classes and normalisation unchanged. A library's network has no single width to
        scale: only factor 1 (the same network) is possible for it."""
        options = registry.scaled_options(self, factor)
        return replace(self, mean=list(self.mean), std=list(self.std), options=options)
