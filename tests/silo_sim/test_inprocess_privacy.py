"""The in-process transport has the wire's privacy path: each silo's own privacy layer (silo_client/privacy.py) and
the hub's (silo_server/rounds/privacy.py) run in the one round loop, so a private benchmark's numbers are a deployment's."""

from __future__ import annotations

import pytest
import torch

from security.dp import DPConfig, per_silo_std
from security.secagg import SecAggParams
from silo_core.accounting import PrivacyAccountant
from silo_core.algorithms.base import HubData, SiloData
from silo_core.models import ModelSpec
from silo_server.rounds.privacy import HubPrivacy, PrivacySection
from silo_sim.inprocess import run_inprocess
from tests.silo_core.test_algorithm_registry import NudgeHub, NudgeOptions, NudgeSilo

SPEC = ModelSpec(num_classes=10, in_channels=1, image_size=28)
IMAGES = torch.zeros((4, 1, 28, 28), dtype=torch.uint8)


def run(privacy: PrivacySection | None, rounds: int = 2, state_dir=None):
    hub = NudgeHub(NudgeOptions(step=0.25), SPEC, HubData(IMAGES, torch.zeros(4, dtype=torch.int64)),
                   torch.device("cpu"), 0, rounds)
    silos = [SiloData(images=IMAGES, silo_id=f"s{i}") for i in range(4)]
    state, history = run_inprocess(hub, NudgeSilo(NudgeOptions(), SPEC, torch.device("cpu")), silos, rounds,
                                   privacy=HubPrivacy(privacy, seed=0) if privacy is not None else None,
                                   state_dir=state_dir)
    return hub.init_state(), state, history


def test_secure_aggregation_in_process_gives_the_plain_sum_within_its_quantization():
    start, plain, _ = run(None)
    _, masked, history = run(PrivacySection(secure_aggregation=SecAggParams(enabled=True, dropouts=0)))
    assert all(r.secagg is not None and r.secagg.u3 == 4 and r.secagg.consistency == 4 for r in history)
    for name, value in plain.tensors.items():
        if value.is_floating_point():
            # the default rules: deltas in [-1, 1] and the weight in [-1024, 1024], 20 bits each, 4 silos a round
            weight_step = 2 * 1024 / (2**20 - 1)
            assert torch.allclose(masked.tensors[name], value, atol=2 * 0.25 * 4 * weight_step / 4 + 1e-5)
            assert not torch.equal(value, start.tensors[name])  # the silos moved it


def test_distributed_dp_in_process_charges_what_the_hub_accountant_charges():
    section = PrivacySection(secure_aggregation=SecAggParams(enabled=True, dropouts=0),
                             dp=DPConfig(enabled=True, noise_multiplier=1.0, clip_norm=1000.0, noise="distributed"))
    _, _, history = run(section)
    expected = PrivacyAccountant("rdp", 1e-5)
    expected.step(1.0, 1.0, 2)  # every silo in every round: q = 1
    assert [r.dp is not None for r in history] == [True, True]
    assert history[-1].dp.epsilon == pytest.approx(expected.epsilon())


def test_an_in_process_run_resumed_from_its_state_dir_goes_on_with_the_epsilon_it_spent(tmp_path):
    section = PrivacySection(secure_aggregation=SecAggParams(enabled=True, dropouts=0),
                             dp=DPConfig(enabled=True, noise_multiplier=1.0, clip_norm=1000.0, noise="distributed"))
    run(section, rounds=2, state_dir=tmp_path)
    _, _, history = run(section, rounds=3, state_dir=tmp_path)  # resumes after round 2: one more round
    expected = PrivacyAccountant("rdp", 1e-5)
    expected.step(1.0, 1.0, 3)
    assert [r.round for r in history] == [1, 2, 3]
    assert history[-1].dp.epsilon == pytest.approx(expected.epsilon())  # not one round's: the count went on


@pytest.mark.parametrize(("quorum", "planned_for"), [(1.0, 4), (0.5, 2)])
def test_distributed_noise_is_split_over_the_quorum_a_hub_with_that_quorum_plans_for(quorum, planned_for):
    # Every silo reports in process, yet each must add the noise the wire's hub would ask of it: a hub at its
    # default quorum 0.5 splits the noise over half the sampled silos, not all of them (once always 1.0 here).
    section = PrivacySection(secure_aggregation=SecAggParams(enabled=True, dropouts=0),
                             dp=DPConfig(enabled=True, noise_multiplier=1.0, clip_norm=2.0, noise="distributed"))
    asked: list[float] = []

    class Recording(HubPrivacy):
        def begin(self, *args, **kwargs):
            planned = super().begin(*args, **kwargs)
            asked.append(planned.instructions.noise_std)
            return planned

    hub = NudgeHub(NudgeOptions(step=0.25), SPEC, HubData(IMAGES, torch.zeros(4, dtype=torch.int64)),
                   torch.device("cpu"), 0, 1)
    silos = [SiloData(images=IMAGES, silo_id=f"s{i}") for i in range(4)]
    run_inprocess(hub, NudgeSilo(NudgeOptions(), SPEC, torch.device("cpu")), silos, 1,
                  privacy=Recording(section, seed=0), quorum=quorum)
    assert asked == [pytest.approx(per_silo_std(1.0 * 2.0, planned_for))]
