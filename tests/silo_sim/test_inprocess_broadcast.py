"""In process, a hub algorithm that broadcasts its round's model hands it to every silo left out of the sample
(SiloAlgorithm.receive_model), so a benchmark measures FedSEAL's ensemble_every_round as the deployed hub runs it."""

from __future__ import annotations

from silo_sim.attacks import PoisonedSilo
from silo_sim.inprocess import run_inprocess
from tests.silo_server.test_broadcast import BroadcastingMean
from tests.silo_server.test_hub import MeanOfSilos
from tests.silo_sim.test_one_sampling import NAMES, RecordingSilo, silos_with


class ReceivingSilo(RecordingSilo):
    def __init__(self):
        super().__init__()
        self.received: dict[int, list[str]] = {}

    def receive_model(self, plan, data):
        assert set(plan.tensors) == {"model/x"}  # the round's model, as the sampled silos get it
        self.received.setdefault(plan.round, []).append(data.silo_id)


def test_every_silo_left_out_of_a_round_receives_its_model_when_the_hub_broadcasts(tmp_path) -> None:
    silo = ReceivingSilo()
    _, history = run_inprocess(BroadcastingMean(), silo, silos_with(dict.fromkeys(NAMES, 10)), rounds=3,
                               silos_per_round=0.3, seed=1, state_dir=tmp_path / "on")
    for record in history:
        trained, received = silo.trained[record.round], silo.received[record.round]
        assert len(trained) == 3 and sorted(trained + received) == NAMES  # each silo once: trains or receives
        assert record.silos_sampled == 3 and record.silos_received == 7

    silo = ReceivingSilo()
    _, history = run_inprocess(MeanOfSilos(), silo, silos_with(dict.fromkeys(NAMES, 10)), rounds=3,
                               silos_per_round=0.3, seed=1, state_dir=tmp_path / "off")
    assert silo.received == {} and all(r.silos_received is None for r in history)


def test_an_attacking_silo_still_receives_the_rounds_it_is_left_out_of(tmp_path) -> None:
    """silo_sim/attacks.py's wrapper passes receive_model on: in process one wrapper serves every silo."""
    silo = ReceivingSilo()
    run_inprocess(BroadcastingMean(), PoisonedSilo(silo, "sign_flip", only=["branch-00"]),
                  silos_with(dict.fromkeys(NAMES, 10)), rounds=2, silos_per_round=0.3, seed=1,
                  state_dir=tmp_path)
    assert all(sorted(silo.trained[r] + silo.received[r]) == NAMES for r in (1, 2))
