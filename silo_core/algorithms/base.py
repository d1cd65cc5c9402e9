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
from typing import Any, Literal

import torch
from pydantic import Field
from torch import nn

from silo_core.config_base import StrictConfig
from silo_core.data import Images
from silo_core.models import ModelSpec, load_weights
from silo_core.tensors import TensorSpec
from silo_core.training import OptimizerSettings, scheduled_lr


class SGDOptions(StrictConfig):
    """Local SGD knobs shared by FedSEAL, HASSLE and the baselines (each algorithm redeclares the defaults its
    paper uses). SemiFL keeps its own copy of these fields so its documented defaults never move."""

    lr: float = Field(0.03, gt=0.0, description="SGD learning rate of round 1 (hub and silos)")
    lr_schedule: Literal["cosine", "constant", "exponential"] = "cosine"
    lr_decay: float = Field(0.995, gt=0.0, le=1.0, description="per-round factor of the exponential schedule")
    momentum: float = Field(0.9, ge=0.0, lt=1.0)
    weight_decay: float = Field(5e-4, ge=0.0)
    nesterov: bool = True
    grad_clip: float = Field(1.0, ge=0.0, description="gradient-norm clip; 0 disables")
    flip: bool = Field(True, description="horizontal flips in augmentation (off for digits/text)")

    def optimizer(self) -> OptimizerSettings:
        return OptimizerSettings(self.lr, self.momentum, self.weight_decay, self.nesterov, self.grad_clip)

    def lr_at(self, round_number: int, total_rounds: int) -> float:
        return scheduled_lr(self.lr, round_number, total_rounds, self.lr_schedule, self.lr_decay)


class StrongAugmentOptions(StrictConfig):
    """RandAugment + Cutout, the strong view A(x) of FixMatch-style losses."""

    randaugment_ops: int = Field(2, ge=0, le=16)
    randaugment_magnitude: int = Field(10, ge=0, le=30)
    cutout: float = Field(0.5, ge=0.0, le=1.0, description="Cutout side as a fraction of the image side")


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
    # True when every silo must send weight exactly 1 (uniform averaging): the hub then refuses any other weight,
    # so no silo can buy a bigger share of the mean by claiming more images.
    unit_weight: bool = False

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
    """A site's local data: images (uint8 N x C x H x W, possibly none; in memory or files read batch by batch, see
    silo_core.data) and, where the site has them, a separate set of labeled images (HASSLE: any site may hold
    labeled data, unlabeled data, or both)."""

    images: Images
    labels: torch.Tensor | None = None  # labels of `images`, only where the site has them
    true_labels: torch.Tensor | None = None  # simulation only: the true labels of `images`
    state_dir: Path | None = None  # where a silo half may persist its own state across restarts
    silo_id: str = ""
    labeled_images: Images | None = None  # a site's labeled images (silo-client --labeled) ...
    labeled_labels: torch.Tensor | None = None  # ... and their labels
    run_id: str = ""  # the hub's run: state a silo half persists is kept per run

    @property
    def num_labeled(self) -> int:
        return 0 if self.labeled_images is None else int(self.labeled_images.shape[0])


@dataclass
class HubData:
    labeled_images: Images
    labeled_labels: torch.Tensor
    validation_images: Images | None = None
    validation_labels: torch.Tensor | None = None


class HubAlgorithm(ABC):
    name: str = ""
    needs_silos: bool = True
    needs_validation: bool = False  # the hub config must name a held-out labeled validation split

    def __init__(self, options: Any, model_spec: ModelSpec, data: HubData, device: torch.device, seed: int,
                 total_rounds: int):
        self.options = options
        self.model_spec = model_spec
        self.data = data
        self.device = device
        self.seed = seed
        self.total_rounds = total_rounds
        # The operator's starting weights (model.init_weights / init_from_run), read once by the hub app. Only the
        # hub half holds them: silos receive the resulting model over the wire, and never see the file.
        self.initial_weights: dict[str, torch.Tensor] | None = None

    def initial_model(self) -> nn.Module:
        """The network init_state starts from: the spec's fresh initialisation, with the initial weights loaded
        over it when there are any (a re-initialised classifier keeps its fresh values). The hub app has already
        loaded them once and logged the report."""
        model = self.model_spec.build()
        if self.initial_weights is not None:
            load_weights(model, self.initial_weights, self.model_spec.num_classes)
        return model

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

    # How the model card describes the served network's structure to whoever loads its weights.
    served_structure = "the named model"

    @classmethod
    def served_network(cls, spec: ModelSpec, options: Any) -> nn.Module:
        """A fresh network of the served model's structure, for loading its exported weights (silo-predict,
        silo-export read the card's algorithm and options): one network of the spec, unless the algorithm serves
        a combination of several."""
        return spec.build()

    def trusted_update(self, state: HubState) -> dict[str, torch.Tensor] | None:
        """FLTrust's root of trust (hub.yaml aggregation.rule: fltrust): the hub's own model change this round,
        trained on its labels from the model the silos received, named as the plan's expected tensors, weight 1.
        None where the algorithm does not compute one (the config then refuses fltrust)."""
        return None

    @classmethod
    def has_trusted_update(cls) -> bool:
        return cls.trusted_update is not HubAlgorithm.trusted_update

    def broadcasts_model(self) -> bool:
        """Whether every live silo left out of a round's sample receives the round's plan too, to use without
        training or uploading (SiloAlgorithm.receive_model). The round never waits for these silos; they cost the
        round one bundle download each (FedSEAL's ensemble_every_round: the paper's self-ensemble over every
        round)."""
        return False


class SiloAlgorithm(ABC):
    name: str = ""
    trains_on_labeled: bool = False  # uses a site's labeled images (SiloData.labeled_images)
    trains_on_unlabeled: bool = True  # uses a site's unlabeled images (SiloData.images)
    needs_true_labels: bool = False  # simulation-only ceilings that train on the silos' true labels
    supports_sample_dp: bool = False  # can train with DP-SGD (silo_core/dp_sgd.py) when the plan asks for it
    # The clear per-silo metrics this half reports in SiloResult.metrics (names, or fnmatch patterns): what a hub
    # may ask for in its run's privacy terms. A silo sends only those the terms ask for and its policy allows.
    clear_metrics: tuple[str, ...] = ("pl_total", "pl_selected", "pl_correct", "train_loss", "train_steps")

    def __init__(self, options: Any, model_spec: ModelSpec, device: torch.device):
        self.options = options
        self.model_spec = model_spec
        self.device = device
        self.sample_dp_ledgers: dict[str, Any] = {}  # (silo, run) -> SampleDPLedger, under privacy.sample_dp

    @abstractmethod
    def local_update(self, plan: RoundPlan, data: SiloData) -> SiloResult: ...

    def receive_model(self, plan: RoundPlan, data: SiloData) -> None:
        """A round's plan for a silo that was not sampled, when the hub half broadcasts (HubAlgorithm.
        broadcasts_model): the silo may use it (FedSEAL folds it into its self-ensemble) but sends nothing back."""
        return None  # an algorithm whose hub half never broadcasts has no use for it

    def result_groups(self, expected: Mapping[str, TensorSpec]) -> dict[str, list[str]]:
        """The groups of a plan's expected tensors, as the hub half declares them (RoundPlan.groups). The wire
        carries only `expected`; both halves derive the same groups from it with the algorithm's own code."""
        return {}


def load_model(spec: ModelSpec, tensors: Mapping[str, torch.Tensor], prefix: str = "model/") -> nn.Module:
    """Build spec's network and load the tensors stored under prefix (parameters and BN buffers)."""
    model = spec.build()
    state = {k[len(prefix) :]: v for k, v in tensors.items() if k.startswith(prefix)}
    model.load_state_dict(state, strict=True)
    return model


def model_tensors(model: nn.Module, prefix: str = "model/") -> dict[str, torch.Tensor]:
    # contiguous_format: a model trained channels_last on CUDA still hands over plain row-major tensors
    return {prefix + k: v.detach().cpu().clone(memory_format=torch.contiguous_format)
            for k, v in model.state_dict().items()}


def weighted_delta(model: nn.Module, start: Mapping[str, torch.Tensor], weight: float,
                   prefix: str = "delta/") -> dict[str, torch.Tensor]:
    """weight * (trained - received) for every parameter: what a site sends so the hub needs only sums."""
    return {f"{prefix}{n}": ((p.detach().cpu() - start[n].cpu()) * weight).contiguous()
            for n, p in model.named_parameters()}


@torch.no_grad()
def apply_mean_delta(model: nn.Module, summed: Mapping[str, torch.Tensor], total_weight: float,
                     prefix: str = "delta/") -> None:
    """w <- w + sum_k(n_k * delta_k) / sum_k(n_k): the weighted mean of the sites' models, from sums alone."""
    if total_weight <= 0:
        return
    for name, param in model.named_parameters():
        param.add_(summed[f"{prefix}{name}"].to(param.device, param.dtype) / total_weight)


def delta_specs(model: nn.Module, prefix: str = "delta/") -> dict[str, TensorSpec]:
    return {f"{prefix}{n}": TensorSpec.of(p.detach()) for n, p in model.named_parameters()}


def groups_by_prefix(expected: Mapping[str, TensorSpec]) -> dict[str, list[str]]:
    """Group names by their first path component ("S/delta/conv.weight" -> group "S")."""
    groups: dict[str, list[str]] = {}
    for name in expected:
        groups.setdefault(name.split("/", 1)[0], []).append(name)
    return groups
