"""Local work in steps as well as epochs (algorithm option local_steps): exactly that many SGD steps a round,
passes over the data repeating as needed, in every algorithm with a silo half."""

import pytest
import torch

from silo_core.algorithms import get_algorithm
from silo_core.algorithms.base import HubData, SiloData
from silo_core.models import ModelSpec
from silo_core.training import LocalWork

SPEC = ModelSpec(options={"width": 4})
CPU = torch.device("cpu")


def test_local_work_counts_epochs_or_steps_across_passes() -> None:
    by_epochs = LocalWork(epochs=2)
    assert [(p, [by_epochs.step() for _ in range(3)]) for p in by_epochs.passes()] == [
        (0, [False] * 3), (1, [False] * 3)]
    by_steps, taken = LocalWork(epochs=1, steps=7), []
    for number in by_steps.passes():  # 3 batches a pass: 3 + 3 + 1
        for _ in range(3):
            taken.append(number)
            if by_steps.step():
                break
    assert taken == [0, 0, 0, 1, 1, 1, 2] and by_steps.taken == 7
    empty = LocalWork(epochs=1, steps=5)
    assert list(empty.passes()) == [0]  # a pass without a usable batch ends the work instead of looping


def images(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 256, (n, 1, 28, 28), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("algorithm, steps_per_step", [("semifl", 1), ("fedseal", 1), ("fedavg-fixmatch", 1),
                                                       ("supervised", 1), ("hassle", 4)])
def test_every_algorithm_takes_exactly_local_steps_steps(algorithm, steps_per_step, monkeypatch) -> None:
    entry = get_algorithm(algorithm)
    # tau 0 and 4-image batches over 8 images: 2 steps a pass, so 5 steps need 3 passes (the last cut short).
    given = {"local_epochs": 1, "local_steps": 5, "tau": 0.0, "silo_batch_size": 4, "batch_size": 4,
             "hub_epochs": 1, "init_epochs": 1, "hub_warmup_epochs": 1, "lr": 0.01, "threshold_min": 0.0}
    options = entry.options.model_validate({k: v for k, v in given.items() if k in entry.options.model_fields})
    assert options.local_steps == 5
    labels = torch.arange(12) % 10
    hub_data = HubData(images(12, 0), labels, images(12, 1), labels)
    hub = entry.hub(options, SPEC, hub_data, CPU, 0, 2)
    plan = hub.begin_round(hub.init_state())
    silo = entry.silo(options, SPEC, CPU)
    data = SiloData(images=images(8, 2), true_labels=torch.arange(8) % 10, silo_id="a",
                    labeled_images=images(8, 3) if algorithm == "hassle" else None,
                    labeled_labels=torch.arange(8) % 10 if algorithm == "hassle" else None)
    steps = []
    real_step = torch.optim.SGD.step
    monkeypatch.setattr(torch.optim.SGD, "step", lambda self, *a, **k: (steps.append(1), real_step(self, *a, **k))[1])
    result = silo.local_update(plan, data)
    assert not result.skipped
    # HASSLE, at a site with labeled and unlabeled images, trains two pairs (S with r_US on the labels, U with r_SU
    # on the rest), each pair stepping its model and its residual together: 5 steps each.
    assert len(steps) == 5 * steps_per_step
    if "train_steps" in result.metrics:
        assert result.metrics["train_steps"] == 5


def test_sample_dp_refuses_local_steps_at_the_hub_config() -> None:
    from silo_server.config import parse_config

    config = {"algorithm": {"name": "semifl", "options": {"local_steps": 10}},
              "model": {"name": "small_cnn", "options": {"norm": "group"}},
              "privacy": {"sample_dp": {"enabled": True}}, "data": {"labeled": {"kind": "demo"}}}
    with pytest.raises(Exception, match="remove algorithm.options.local_steps"):
        parse_config(config, source="hub.yaml")
