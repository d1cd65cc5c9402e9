"""FedSEAL's ensemble_every_round over real gRPC: a silo left out of a round receives the round's model (Task
RECEIVE), folds it into its self-ensemble on disk and sends nothing; the hub counts that download."""

from __future__ import annotations

import threading

from safetensors import safe_open

from silo_client.client import SiloClient, SiloSettings
from silo_server.app import HubApp
from silo_server.config import parse_config
from tests.silo_client.test_cli_errors import write_images

SILOS = ("dev-1", "dev-2")


def hub_config(tmp_path, every_round: bool):
    return parse_config({
        "run": {"state_dir": "state", "device": "cpu", "threads": 1},
        "server": {"host": "127.0.0.1", "port": 0, "certs": "hub", "linger_s": 5},
        "data": {"labeled": {"kind": "demo", "labels_per_class": 1},
                 "validation": {"kind": "demo", "split": "test", "labels_per_class": 1}},
        "model": {"options": {"width": 4}},
        "algorithm": {"name": "fedseal", "options": {
            "init_epochs": 1, "hub_epochs": 1, "local_epochs": 1, "silo_batch_size": 2, "hub_batch_size": 5,
            "threshold_max": 0.5, "ensemble_every_round": every_round}},
        "rounds": {"total": 2, "silos_per_round_count": 1, "min_silos": 2, "quorum": 1.0, "deadline_s": 120},
        "security": {"allowed_silos": list(SILOS)},
    }, base=tmp_path)


def ensemble_counts(tmp_path) -> dict[str, int]:
    """How many global models each silo's stored self-ensemble holds (a silo that never used one has none)."""
    counts = {}
    for silo in SILOS:
        for path in (tmp_path / f"state-{silo}").glob("fedseal-ensemble-*.safetensors"):
            with safe_open(str(path), framework="pt") as f:
                counts[silo] = int(f.metadata()["count"])
    return counts


def run_federation(tmp_path, every_round: bool):
    return run_dev_silos(HubApp(hub_config(tmp_path, every_round), insecure_dev_only=True), tmp_path, SILOS)


def semifl_hub_config(tmp_path, silos, options=None, **sections):
    """A small SemiFL hub for `silos` (2 rounds, every silo in every round, tau 0: every image passes); `options`
    adds SemiFL options, other sections (rounds, wire) are merged over the defaults."""
    rounds = {"total": 2, "silos_per_round_count": len(silos), "min_silos": len(silos), "quorum": 1.0,
              "deadline_s": 120, **sections.pop("rounds", {})}
    return parse_config({
        "run": {"state_dir": "state", "device": "cpu", "threads": 1},
        "server": {"host": "127.0.0.1", "port": 0, "certs": "hub", "linger_s": 5},
        "data": {"labeled": {"kind": "demo", "labels_per_class": 1}},
        "model": {"options": {"width": 4}},
        "algorithm": {"name": "semifl", "options": {
            "init_epochs": 1, "hub_epochs": 1, "local_epochs": 1, "silo_batch_size": 2, "hub_batch_size": 5,
            "tau": 0.0, **(options or {})}},
        "rounds": rounds,
        "security": {"allowed_silos": list(silos)},
        **sections,
    }, base=tmp_path)


def run_dev_silos(app: HubApp, tmp_path, silos) -> list:
    """The hub's run to its end over real gRPC, with a silo-client for each of `silos` (insecure development mode,
    4 images each under tmp_path); returns the rounds' records. Everything started is stopped."""
    port = app.start_server()
    clients = []
    for silo in silos:
        write_images(tmp_path / f"images-{silo}", n=4)
        clients.append(SiloClient(SiloSettings(hub=f"127.0.0.1:{port}", certs=None, data=tmp_path / f"images-{silo}",
                                               device="cpu", state_dir=tmp_path / f"state-{silo}",
                                               insecure_dev_silo_id=silo, connect_timeout_s=30)))
    threads = [threading.Thread(target=c.run_forever, daemon=True) for c in clients]
    try:
        for t in threads:
            t.start()
        app.run()
        for t in threads:
            t.join(30)
        assert not any(t.is_alive() for t in threads)
        return app.hub.records.history
    finally:
        for c in clients:
            c.stop_event.set()
            c.close()
        app.stop(0)


def test_a_silo_left_out_of_a_round_receives_the_model_over_grpc(tmp_path) -> None:
    history = run_federation(tmp_path / "on", every_round=True)
    assert [(r.silos_sampled, r.silos_reported, r.silos_received) for r in history] == [(1, 1, 1), (1, 1, 1)]
    for r in history:
        assert r.bytes_down_received > 0 and r.bytes_down == 2 * r.bytes_down_received  # one bundle each
    assert ensemble_counts(tmp_path / "on") == {"dev-1": 2, "dev-2": 2}  # every round's model, sampled or not

    history = run_federation(tmp_path / "off", every_round=False)
    assert [r.silos_received for r in history] == [None, None]
    # One silo a round: 2 models between the two silos (a silo never sampled keeps no ensemble at all).
    assert sum(ensemble_counts(tmp_path / "off").values()) == 2
