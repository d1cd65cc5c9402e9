"""Hub + 3 silo processes over mutual TLS on loopback: rounds complete, every silo contributes, the hub is killed
and restarted and resumes at the next round without repeating or losing one, and keeps its best round's model."""

import hashlib
import json
import os
import signal

import pytest
import torch
import yaml
from safetensors.torch import load_file

from silo_core.data import load_labeled_folder
from silo_core.models import ModelSpec
from silo_core.training import evaluate
from silo_sim.stage import stage_federation
from tests.conftest import free_port, wait_for

TINY = {"hub_epochs": 1, "local_epochs": 1, "silo_batch_size": 8, "hub_batch_size": 8, "tau": 0.0}


def history(staged):
    path = staged.hub_state_dir / "history.json"
    try:
        return json.loads(path.read_text())["rounds"]
    except (OSError, ValueError):
        return []


def check_best_round(staged, rounds, card):
    """The hub scored every round on its validation split and kept the best round's model across the restart:
    the model card names it, and the kept weights score exactly what the card says."""
    scores = [h["validation_accuracy"] for h in rounds]
    best = max(range(len(scores)), key=lambda i: (scores[i], i)) + 1  # a tie goes to the later round
    chosen = card["best_round"]
    assert chosen["round"] == best and chosen["validation_accuracy"] == scores[best - 1]
    assert chosen["metrics"]["test_accuracy"] == rounds[best - 1]["test_accuracy"]
    path = staged.hub_state_dir / chosen["weights_file"]
    assert chosen["weights_sha256"] == hashlib.sha256(path.read_bytes()).hexdigest()
    model = ModelSpec("small_cnn").build()
    model.load_state_dict(load_file(str(path)))
    validation = load_labeled_folder(staged.root / "hub" / "validation", 28, 1)
    assert len(validation) == 30
    scored = evaluate(model.eval(), validation.images, validation.labels, [0.5], [0.5], torch.device("cpu"))
    assert scored["accuracy"] == pytest.approx(chosen["validation_accuracy"], abs=1e-6)


def test_semifl_over_mtls_survives_a_hub_restart(tmp_path, processes):
    port = free_port()
    staged = stage_federation(
        tmp_path / "fed", num_silos=3, labels_per_class=2, unlabeled_limit=60, test_per_class=5, seed=1,
        validation_per_class=3,
        hub_config={
            "run": {"threads": 1},
            "server": {"port": port, "long_poll_s": 2.0, "linger_s": 10.0},
            "algorithm": {"name": "semifl", "options": TINY},
            "rounds": {"total": 4, "min_silos": 3, "quorum": 1.0, "deadline_s": 120},
        },
    )
    # A corrupt and a truncated image at one branch: skipped, counted, reported; the silo still trains.
    (staged.silos[0].data / "zz-corrupt.png").write_bytes(b"not an image at all")
    (staged.silos[0].data / "zz-truncated.jpg").write_bytes(b"\xff\xd8\xff\xe0" + b"\x00" * 20)
    hub = processes.start("hub", "-m", "silo_server.cli", "--config", str(staged.hub_config))
    silos = [
        processes.start(s.name, "-m", "silo_client.cli", "--data", str(s.data), "--certs", str(s.certs),
                        "--hub", f"127.0.0.1:{port}", "--state-dir", str(s.state_dir), "--sim-labels", str(s.labels),
                        "--threads", "1", "--connect-timeout", "120")
        for s in staged.silos
    ]
    wait_for(lambda: len(history(staged)) >= 2 or hub.poll() is not None, 180, "two rounds")
    assert hub.poll() is None, processes.log("hub")
    os.kill(hub.pid, signal.SIGKILL)
    hub.wait()

    before = history(staged)
    done_before = [h["round"] for h in before]
    assert done_before == list(range(1, len(before) + 1)) and len(before) >= 2
    for h in before:
        assert h["silos_sampled"] == 3 and h["silos_reported"] == 3 and h["silos_skipped"] == 0
        assert h["bytes_up"] > 0 and h["bytes_down"] > 0
    # The checkpoint is written before history.json, so a kill between the two leaves the checkpoint one round
    # ahead; the checkpoint is the record the hub resumes from (and it carries the history with it).
    latest = (staged.hub_state_dir / "checkpoints" / "LATEST").read_text().strip()
    resumed = int(latest.removeprefix("round-"))
    assert resumed in (len(before), len(before) + 1), latest
    assert (staged.hub_state_dir / "checkpoints" / latest / "state.safetensors").is_file()

    restarted = processes.start("hub-restarted", "-m", "silo_server.cli", "--config", str(staged.hub_config))
    assert restarted.wait(timeout=240) == 0, processes.log("hub-restarted")
    log = processes.log("hub-restarted")
    assert f"resumed from checkpoint after round {resumed}" in log
    assert f"round {resumed + 1} attempt 1" in log or resumed == 4
    assert f"round {resumed} attempt" not in log  # nothing before the checkpoint ran again

    after = history(staged)
    assert [h["round"] for h in after] == [1, 2, 3, 4]
    assert after[:len(before)] == before
    for h in after:
        assert h["silos_reported"] == 3 and 0.0 <= h["test_accuracy"] <= 1.0
        assert 0.0 < h["pseudo_label_ratio"] <= 1.0
    card = json.loads((staged.hub_state_dir / "model_card.json").read_text())
    assert card["rounds"] == 4 and card["algorithm"] == "semifl"
    assert set(card["silos"]) == {s.name for s in staged.silos}
    # Every silo's update is in all four sums; the checkpoint carried the count across the restart.
    assert all(v["rounds_contributed"] == 4 for v in card["silos"].values()), card["silos"]
    assert (staged.hub_state_dir / "model.safetensors").stat().st_size > 10_000
    check_best_round(staged, after, card)
    assert f"best round on the validation split: {card['best_round']['round']} (" in log
    assert card["silos"][staged.silos[0].name]["skipped_images"] == 2
    assert card["silos"][staged.silos[1].name]["skipped_images"] == 0
    assert "2 of 22 image files skipped as unreadable" in processes.log(staged.silos[0].name)
    for silo in silos:
        assert silo.wait(timeout=60) == 0, processes.log(silo.name)
    assert yaml.safe_load(staged.hub_config.read_text())["server"]["port"] == port
