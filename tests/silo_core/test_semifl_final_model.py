"""Issue 37: the quick quality profile ends SemiFL within noise of server-only. These tests pin down that
nothing in the hub half throws the silos' work away at the end: the final fine-tune keeps the last round's
silo step, and SemiFL's model equals server-only's only where no silo contributed."""

from __future__ import annotations

import torch
from torch import nn

from silo_core.algorithms.base import HubData, HubState, load_model
from silo_core.algorithms.semifl import SemiFLHub, SemiFLOptions
from silo_core.algorithms.server_only import ServerOnlyHub, ServerOnlyOptions
from silo_core.models import ModelSpec
from silo_core.training import cosine_lr

SPEC = ModelSpec(options={"width": 4})
CPU = torch.device("cpu")


def hub_data() -> HubData:
    g = torch.Generator().manual_seed(0)
    images = torch.randint(0, 256, (20, 1, 28, 28), dtype=torch.uint8, generator=g)
    return HubData(images, torch.arange(20) % 10)


def flat(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def silo_step(state: HubState, scale: float = 0.05) -> tuple[dict[str, torch.Tensor], float]:
    """One silo's sums (uniform weight 1) that moved every weight by a fixed random step, and its norm."""
    g = torch.Generator().manual_seed(1)
    names = [n for n, _ in load_model(SPEC, state.tensors).named_parameters()]
    deltas = {f"delta/{n}": scale * torch.randn(state.tensors[f"model/{n}"].shape, generator=g)
              for n in names}
    norm = float(torch.cat([d.flatten() for d in deltas.values()]).norm())
    return {**deltas, "weight": torch.tensor([1.0])}, norm


def test_the_final_fine_tune_keeps_the_silos_step_of_the_last_round():
    rounds = 2
    hub = SemiFLHub(SemiFLOptions(hub_epochs=3), SPEC, hub_data(), CPU, seed=0, total_rounds=rounds)
    state, _ = hub.finish_round(hub.init_state(), {}, {})  # round 1, no silo contributed
    summed, step = silo_step(state)
    # The last round ends with the paper's final fine-tune, at the last round's learning rate, which the
    # cosine schedule keeps above zero; with or without the silos' step it draws the same batches.
    assert cosine_lr(hub.options.lr, rounds, rounds) > 0
    federated, _ = hub.finish_round(state, summed, {})
    alone, _ = hub.finish_round(state, {}, {})
    assert federated.round == alone.round == rounds
    kept = float((flat(hub.served_model(federated)) - flat(hub.served_model(alone))).norm())
    # The fine-tune moves both starts alike: nearly all of the silos' step is still in the served model.
    assert 0.8 * step < kept < 1.2 * step
    # And the served model is the state's own, not a hub-only copy kept aside.
    assert torch.equal(flat(hub.served_model(federated)), flat(load_model(SPEC, federated.tensors)))


def test_semifl_equals_server_only_only_where_no_silo_contributed():
    # A one-round run, so that the round compared is also the last, ending with the final fine-tune.
    semifl = SemiFLHub(SemiFLOptions(hub_epochs=3), SPEC, hub_data(), CPU, seed=0, total_rounds=1)
    server_only = ServerOnlyHub(ServerOnlyOptions(hub_epochs=3), SPEC, hub_data(), CPU, seed=0,
                                total_rounds=1)
    start, floor_start = semifl.init_state(), server_only.init_state()
    assert torch.equal(flat(semifl.served_model(start)), flat(server_only.served_model(floor_start)))
    # A round in which every silo skipped (nothing passed tau, as in the quick profile's round 1): the same
    # model, to the weight.
    nothing, _ = semifl.finish_round(start, {}, {"pl_total": 300.0, "pl_selected": 0.0})
    floor, _ = server_only.finish_round(floor_start, {}, {})
    assert torch.equal(flat(semifl.served_model(nothing)), flat(server_only.served_model(floor)))
    # A round with a silo's step: another model, by about that step.
    summed, step = silo_step(start)
    contributed, _ = semifl.finish_round(start, summed, {})
    apart = float((flat(semifl.served_model(contributed)) - flat(server_only.served_model(floor))).norm())
    assert apart > 0.5 * step
