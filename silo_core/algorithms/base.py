"""The algorithm interface: a hub half and a silo half that know nothing of transport.

Hub half:  init_state() -> HubState;  begin_round(state) -> RoundPlan;  finish_round(state, summed) -> HubState.
Silo half: local_update(plan, data) -> SiloResult.

A silo returns only tensors meant to be SUMMED over silos (weighted deltas and their weights, counts, BN sums),
so the hub needs nothing but their sums, and secure aggregation composes with every algorithm. The same objects run
in-process (benchmarks) and behind gRPC (deployment).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from silo_core.models import ModelSpec
from silo_core.tensors import TensorSpec


@dataclass
class HubState:
    """Everything needed to resume: tensors go to safetensors, meta must be JSON-serialisable."""

    round: int  # rounds completed
    tensors: dict[str, torch.Tensor]
    meta: dict[str, Any] = field(default_factory=dict)


@dataclass
class RoundPlan:
    """What every sampled silo receives for one round."""

    round: int
    tensors: dict[str, torch.Tensor]
    hyperparameters: dict[str, Any]
    expected: dict[str, TensorSpec]  # what the hub accepts back: exact names, shapes and dtypes
    class_thresholds: list[float] = field(default_factory=list)
    # Optional partition of `expected` into groups (group -> names). When set, a result may hold any non-empty set
    # of whole groups (a site uploads only the models it trained); when empty, exactly `expected`.
    groups: dict[str, list[str]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.groups:
            named = [n for names in self.groups.values() for n in names]
            if sorted(named) != sorted(self.expected):
                raise ValueError("RoundPlan.groups must partition the expected tensors: every name in exactly one group")


@dataclass
class SiloResult:
    tensors: dict[str, torch.Tensor]  # summable contributions, exactly plan.expected
    metrics: dict[str, float] = field(default_factory=dict)  # small, clear, summable counts
    skipped: bool = False  # nothing to contribute this round


@dataclass
class SiloData:
    """A silo's local images (uint8 N x C x H x W); labels only where the site has them."""

    images: torch.Tensor
    labels: torch.Tensor | None = None
    true_labels: torch.Tensor | None = None  # simulation only: to report pseudo-label accuracy
    state_dir: Path | None = None  # where a silo half may persist its own state across restarts
    silo_id: str = ""


@dataclass
class HubData:
    labeled_images: torch.Tensor
    labeled_labels: torch.Tensor
    validation_images: torch.Tensor | None = None
    validation_labels: torch.Tensor | None = None


class HubAlgorithm(ABC):
    name: str = ""
    needs_silos: bool = True

    def __init__(self, options: Any, model_spec: ModelSpec, data: HubData, device: torch.device, seed: int,
                 total_rounds: int):
        self.options = options
        self.model_spec = model_spec
        self.data = data
        self.device = device
        self.seed = seed
        self.total_rounds = total_rounds

    @abstractmethod
    def init_state(self) -> HubState: ...

    @abstractmethod
    def begin_round(self, state: HubState) -> RoundPlan: ...

    @abstractmethod
    def finish_round(
        self, state: HubState, summed: Mapping[str, torch.Tensor], summed_metrics: Mapping[str, float]
    ) -> tuple[HubState, dict[str, float]]:
        """Fold the silos' summed contributions into the state; return it with derived round metrics."""

    @abstractmethod
    def served_model(self, state: HubState) -> nn.Module:
        """The model the hub serves and evaluates (eval-ready: static BN statistics in place)."""


class SiloAlgorithm(ABC):
    name: str = ""

    def __init__(self, options: Any, model_spec: ModelSpec, device: torch.device):
        self.options = options
        self.model_spec = model_spec
        self.device = device

    @abstractmethod
    def local_update(self, plan: RoundPlan, data: SiloData) -> SiloResult: ...


def load_model(spec: ModelSpec, tensors: Mapping[str, torch.Tensor], prefix: str = "model/") -> nn.Module:
    """Build spec's network and load the tensors stored under prefix (parameters and BN buffers)."""
    model = spec.build()
    state = {k[len(prefix) :]: v for k, v in tensors.items() if k.startswith(prefix)}
    model.load_state_dict(state, strict=True)
    return model


def model_tensors(model: nn.Module, prefix: str = "model/") -> dict[str, torch.Tensor]:
    return {prefix + k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
