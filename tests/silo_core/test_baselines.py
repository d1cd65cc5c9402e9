"""The baselines: FedAvg+FixMatch's masked loss, the hub as one more FedAvg participant, the supervised ceiling."""

import zlib

import pytest
import torch
from torch.nn import functional as F

from silo_core.algorithms.base import HubData, SiloData, load_model, weighted_delta
from silo_core.algorithms.fedavg_fixmatch import (
    FedAvgFixMatchHub,
    FedAvgFixMatchOptions,
    FedAvgFixMatchSilo,
    fixmatch_loss,
)
from silo_core.algorithms.supervised import SupervisedHub, SupervisedOptions, SupervisedSilo
from silo_core.models import ModelSpec
from silo_core.training import seeded_generator, train_supervised

SPEC = ModelSpec(options={"width": 4})
CPU = torch.device("cpu")


def hub_data():
    g = torch.Generator().manual_seed(0)
    return HubData(torch.randint(0, 256, (12, 1, 28, 28), dtype=torch.uint8, generator=g), torch.arange(12) % 10)


def test_fixmatch_loss_masks_by_confidence_of_the_weak_view_and_averages_over_the_whole_batch():
    weak = torch.tensor([[4.0, 0.0, 0.0], [0.2, 0.1, 0.0], [0.0, 0.0, 5.0]])  # confident, unsure, confident
    strong = torch.tensor([[1.0, 2.0, 0.0], [0.0, 3.0, 0.0], [0.5, 0.5, 0.5]])
    loss, pseudo, mask = fixmatch_loss(weak, strong, tau=0.9)
    assert pseudo.tolist() == [0, 0, 2] and mask.tolist() == [True, False, True]
    ce = F.cross_entropy(strong, pseudo, reduction="none")
    assert float(loss) == pytest.approx(float((ce[0] + ce[2]) / 3), rel=1e-6)
    strong.requires_grad_(True)
    weak.requires_grad_(True)
    loss, _, _ = fixmatch_loss(weak, strong, tau=0.9)
    loss.backward()
    assert weak.grad is None and float(strong.grad[1].abs().sum()) == 0.0  # no gradient via the weak view


@pytest.mark.parametrize("aggregation, expected", [("uniform", (3 * 1 + 9 * 1 + 1 * 1) / 3),
                                                   ("samples", (3 * 10 + 9 * 30 + 1 * 12) / 52)])
def test_hub_is_one_more_participant_of_a_weighted_mean(aggregation, expected, monkeypatch):
    opts = FedAvgFixMatchOptions(hub_epochs=1, aggregation=aggregation)
    hub = FedAvgFixMatchHub(opts, SPEC, hub_data(), CPU, seed=0, total_rounds=2)
    state = hub.init_state()
    names = [n for n, _ in load_model(SPEC, state.tensors).named_parameters()]

    def hub_moves_by_one(model, round_number, epochs):  # stands in for the hub's SGD: every weight + 1
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)
        return 0.0

    monkeypatch.setattr(hub, "_train_hub", hub_moves_by_one)
    # Two silos: deltas 3 and 9 with weights (1, 1) uniform or (10, 30) samples; the hub (delta 1) weighs 1 or 12.
    w1, w2 = (1.0, 1.0) if aggregation == "uniform" else (10.0, 30.0)
    summed = {f"delta/{n}": torch.full_like(state.tensors[f"model/{n}"], 3.0 * w1 + 9.0 * w2) for n in names}
    summed["weight"] = torch.tensor([w1 + w2])
    new, metrics = hub.finish_round(state, summed, {})
    assert metrics["aggregated_weight"] == w1 + w2
    for n in names:
        assert torch.allclose(new.tensors[f"model/{n}"], state.tensors[f"model/{n}"] + expected, atol=1e-5)
    # Static BN statistics were recomputed on the hub's images for the new weights (they differ from before).
    bn = [k for k in new.tensors if k.endswith("running_mean")]
    assert bn and not torch.allclose(new.tensors[bn[0]], state.tensors[bn[0]])


def test_fixmatch_silo_pseudo_labels_every_batch_and_sends_a_weighted_delta():
    hub = FedAvgFixMatchHub(FedAvgFixMatchOptions(init_epochs=1), SPEC, hub_data(), CPU, seed=0, total_rounds=2)
    plan = hub.begin_round(hub.init_state())
    silo = FedAvgFixMatchSilo(FedAvgFixMatchOptions(tau=0.0, local_epochs=2, silo_batch_size=4,
                                                    aggregation="samples"), SPEC, CPU)
    images = torch.randint(0, 256, (8, 1, 28, 28), dtype=torch.uint8, generator=torch.Generator().manual_seed(4))
    result = silo.local_update(plan, SiloData(images=images, true_labels=torch.arange(8) % 10, silo_id="a"))
    assert set(result.tensors) == set(plan.expected) and float(result.tensors["weight"]) == 8.0
    # tau = 0: every image is pseudo-labeled and used, in both epochs; the counts are images (the last pass's), not
    # images times epochs.
    assert result.metrics["pl_total"] == 8 and result.metrics["pl_selected"] == 8
    assert 0 <= result.metrics["pl_correct"] <= 8 and result.metrics["train_steps"] == 4
    assert sum(float(t.abs().sum()) for k, t in result.tensors.items() if k.startswith("delta/")) > 0


def test_supervised_silo_trains_on_true_labels_and_refuses_without_them():
    hub = SupervisedHub(SupervisedOptions(), SPEC, hub_data(), CPU, seed=0, total_rounds=2)
    plan = hub.begin_round(hub.init_state())
    silo = SupervisedSilo(SupervisedOptions(local_epochs=1, silo_batch_size=4), SPEC, CPU)
    assert SupervisedSilo.needs_true_labels
    images = torch.randint(0, 256, (8, 1, 28, 28), dtype=torch.uint8)
    with pytest.raises(ValueError, match="only in simulation"):
        silo.local_update(plan, SiloData(images=images, silo_id="a"))
    result = silo.local_update(plan, SiloData(images=images, true_labels=torch.arange(8) % 10, silo_id="a"))
    assert float(result.tensors["weight"]) == 8.0 and set(result.tensors) == set(plan.expected)
    # The delta is 8 x the local CE training on the TRUE labels: replaying it with them gives it back, with
    # other labels it does not.
    for labels, same in ((torch.arange(8) % 10, True), ((torch.arange(8) + 1) % 10, False)):
        model = load_model(SPEC, plan.tensors)
        start = {n: p.detach().clone() for n, p in model.named_parameters()}
        train_supervised(model, images, labels, epochs=1, batch_size=4, lr=plan.hyperparameters["lr"],
                         opt=silo.options.optimizer(), mean=SPEC.mean, std=SPEC.std, device=CPU,
                         generator=seeded_generator(0, 1, zlib.crc32(b"a")), flip=True)
        replay = weighted_delta(model, start, 8.0)
        assert all(torch.allclose(replay[k], result.tensors[k], atol=1e-6) for k in replay) is same
