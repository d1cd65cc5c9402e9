"""A hub that builds its network with the operator's own factory, and two silo processes over mutual TLS: the one
whose operator named the factory trains, the one that did not exits at join saying what to pass."""

import json

from silo_sim.stage import stage_federation
from tests.conftest import free_port

TINY = "tests.model_factories:tiny_net"


def test_a_factory_run_over_mtls_trains_only_at_silos_that_named_the_factory(tmp_path, processes):
    port = free_port()
    staged = stage_federation(
        tmp_path / "fed", num_silos=2, labels_per_class=2, unlabeled_limit=40, test_per_class=3, seed=3,
        hub_config={
            "run": {"threads": 1},
            "server": {"port": port, "long_poll_s": 2.0, "linger_s": 10.0},
            "model": {"factory": TINY, "options": {"width": 6}},
            "algorithm": {"name": "semifl", "options": {"hub_epochs": 1, "local_epochs": 1, "silo_batch_size": 8,
                                                          "hub_batch_size": 8, "tau": 0.0}},
            "rounds": {"total": 1, "min_silos": 1, "quorum": 1.0, "deadline_s": 120},
        },
    )
    hub = processes.start("hub", "-m", "silo_server.cli", "--config", str(staged.hub_config))
    trusting, other = staged.silos

    refusing = processes.start_silo(other, port)
    assert refusing.wait(timeout=120) == 2, processes.log(other.name)
    error = [line for line in processes.log(other.name).splitlines() if line.startswith("error: ")]
    assert len(error) == 1 and f"restart with --model-factory {TINY}" in error[0]
    assert "loaded" not in processes.log(other.name)  # refused before reading its images

    training = processes.start_silo(trusting, port, "--model-factory", TINY)
    assert training.wait(timeout=180) == 0, processes.log(trusting.name)
    assert hub.wait(timeout=60) == 0, processes.log("hub")
    card = json.loads((staged.hub_state_dir / "model_card.json").read_text())
    assert card["model"]["factory"] == TINY and card["model"]["name"] == TINY
    assert len(card["model"]["architecture_sha256"]) == 64
    assert card["silos"][trusting.name]["rounds_contributed"] == 1
    assert card["silos"].get(other.name, {}).get("rounds_contributed", 0) == 0
