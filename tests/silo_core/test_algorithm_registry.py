"""How to add an algorithm: one options model, a hub half and a silo half, registered by name, and the one round
loop runs it (here in process, as the benchmarks do) without a change anywhere else."""

from __future__ import annotations

from collections.abc import Mapping

import pytest
import torch
from torch import nn

from silo_core.algorithms import ALGORITHMS, get_algorithm, register_algorithm
from silo_core.algorithms.base import (
    HubAlgorithm,
    HubData,
    HubState,
    RoundPlan,
    SiloAlgorithm,
    SiloData,
    SiloResult,
    load_model,
    model_tensors,
)
from silo_core.config_base import StrictConfig
from silo_core.models import ModelSpec
from silo_core.tensors import TensorSpec
from silo_sim.inprocess import run_inprocess


class NudgeOptions(StrictConfig):
    step: float = 0.1


class NudgeHub(HubAlgorithm):
    """x <- x + mean over silos of their nudge (a toy FedAvg on the model's parameters)."""

    name = "nudge"

    def init_state(self) -> HubState:
        with torch.random.fork_rng():
            torch.manual_seed(self.seed)  # the same start every time (the test compares with it)
            return HubState(0, model_tensors(self.initial_model()))

    def begin_round(self, state: HubState) -> RoundPlan:
        expected = {f"delta/{k}": TensorSpec(tuple(v.shape), "float32") for k, v in state.tensors.items()
                    if v.is_floating_point()}
        return RoundPlan(state.round + 1, dict(state.tensors), {"step": self.options.step},
                         {**expected, "weight": TensorSpec((1,), "float32")}, unit_weight=True)

    def finish_round(self, state: HubState, summed: Mapping[str, torch.Tensor], metrics: Mapping[str, float]
                     ) -> tuple[HubState, dict[str, float]]:
        n = float(summed["weight"].sum())
        tensors = {k: v + (summed[f"delta/{k}"] / n).to(v.dtype) if f"delta/{k}" in summed else v
                   for k, v in state.tensors.items()}
        return HubState(state.round + 1, tensors), {"silos": n}

    def served_model(self, state: HubState) -> nn.Module:
        return load_model(self.model_spec, state.tensors).eval()


class NudgeSilo(SiloAlgorithm):
    name = "nudge"

    def local_update(self, plan: RoundPlan, data: SiloData) -> SiloResult:
        step = plan.hyperparameters["step"]
        tensors = {n: torch.full(s.shape, step) for n, s in plan.expected.items() if n.startswith("delta/")}
        return SiloResult({**tensors, "weight": torch.ones(1)}, {})


@pytest.fixture
def nudge():
    entry = register_algorithm("nudge", NudgeOptions, NudgeHub, NudgeSilo)
    yield entry
    ALGORITHMS.pop("nudge")


def test_a_new_algorithm_registers_and_runs_through_the_one_round_loop(nudge):
    assert get_algorithm("nudge") is nudge
    spec = ModelSpec(num_classes=10, in_channels=1, image_size=28)
    images = torch.zeros((4, 1, 28, 28), dtype=torch.uint8)
    hub = NudgeHub(NudgeOptions(step=0.25), spec, HubData(images, torch.zeros(4, dtype=torch.int64)),
                   torch.device("cpu"), 0, 2)
    start = hub.init_state()
    silos = [SiloData(images=images, silo_id=f"s{i}") for i in range(3)]
    state, history = run_inprocess(hub, NudgeSilo(NudgeOptions(), spec, torch.device("cpu")), silos, rounds=2)
    assert [r.round for r in history] == [1, 2] and all(r.algorithm["silos"] == 3.0 for r in history)
    name = next(k for k, v in start.tensors.items() if v.is_floating_point())
    assert torch.allclose(state.tensors[name], start.tensors[name] + 0.5)  # two rounds of +0.25


def test_a_taken_name_or_a_hub_needing_silos_without_a_silo_half_is_refused(nudge):
    with pytest.raises(ValueError, match="already registered"):
        register_algorithm("nudge", NudgeOptions, NudgeHub, NudgeSilo)
    with pytest.raises(ValueError, match="needs silos .* but has no silo half"):
        register_algorithm("nudge-2", NudgeOptions, NudgeHub, None)
