"""The model card names the kept best model even when it is the initial one (round 0, before any silo took part),
since best_model.safetensors then holds it and silo-predict / silo-export trust the card."""

from __future__ import annotations

from silo_core.selection import BestRound
from silo_server.app import HubApp
from silo_server.config import parse_config
from silo_server.state.checkpoint import save_best_model


def test_round_zero_as_best_is_named_in_the_card(tmp_path) -> None:
    config = parse_config({
        "run": {"state_dir": "state", "device": "cpu"},
        "server": {"host": "127.0.0.1", "port": 0},
        "data": {"labeled": {"kind": "demo", "labels_per_class": 2},
                 "validation": {"kind": "demo", "split": "test", "labels_per_class": 2}},
    }, base=tmp_path)
    app = HubApp(config, insecure_dev_only=True)
    assert app.best_round_card() is None  # nothing scored yet
    app.best = BestRound()
    assert app.best.offer(0, 0.25) and app.best.found
    save_best_model(tmp_path / "state", app.spec.build(), app.hub.run_id, app.best)
    card = app.best_round_card()
    assert card is not None and (card["round"], card["validation_accuracy"]) == (0, 0.25)
    assert card["weights_file"] == "best_model.safetensors"
