"""The model card names the kept best model even when it is the initial one (round 0, before any silo took part),
since best_model.safetensors then holds it and silo-predict / silo-export trust the card."""

from __future__ import annotations

import logging

import pytest
from prometheus_client import generate_latest

from silo_core.rounds import RoundRecord, Scores
from silo_core.selection import BestRound
from silo_server.app import HubApp
from silo_server.config import parse_config
from silo_server.state.checkpoint import load_best_round, save_best_model

CONFIG = {
    "run": {"state_dir": "state", "device": "cpu"},
    "server": {"host": "127.0.0.1", "port": 0},
    "data": {"labeled": {"kind": "demo", "labels_per_class": 2},
             "validation": {"kind": "demo", "split": "test", "labels_per_class": 2}},
}


def test_round_zero_as_best_is_named_in_the_card(tmp_path) -> None:
    app = HubApp(parse_config(CONFIG, base=tmp_path), insecure_dev_only=True)
    assert app.best_round_card() is None  # nothing scored yet
    app.best = BestRound()
    assert app.best.offer(0, 0.25) and app.best.found
    save_best_model(tmp_path / "state", app.spec.build(), app.hub.run_id, app.best)
    app.hub.records.initial = Scores(test_accuracy=0.31, validation_accuracy=0.25)
    card = app.best_round_card()
    assert card is not None and (card["round"], card["validation_accuracy"]) == (0, 0.25)
    assert card["weights_file"] == "best_model.safetensors"
    assert card["metrics"] == {"test_accuracy": 0.31}  # the initial model's own test score


def test_the_hub_warns_when_no_round_beat_the_initial_model(tmp_path, caplog) -> None:
    app = HubApp(parse_config(CONFIG, base=tmp_path), insecure_dev_only=True)
    app.best = BestRound()
    app.best.offer(0, 0.80)
    app.hub.records.history.append(RoundRecord(round=1, scores=Scores(validation_accuracy=0.70)))
    with caplog.at_level(logging.INFO, logger="silo_server"):
        app.log_best_round(tmp_path / "best_model.safetensors")
    [record] = [r for r in caplog.records if "best_model.safetensors" in r.getMessage()]
    assert record.levelno == logging.WARNING and "no round beat the hub's labels alone" in record.getMessage()
    assert "best round on the validation split: 0 (80.00%), the initial model" in record.getMessage()
    caplog.clear()
    app.best.offer(2, 0.82)
    with caplog.at_level(logging.INFO, logger="silo_server"):
        app.log_best_round(tmp_path / "best_model.safetensors")
    [record] = [r for r in caplog.records if "best_model.safetensors" in r.getMessage()]
    assert record.levelno == logging.INFO and "best round on the validation split: 2 (82.00%)" in record.getMessage()


def test_the_best_model_is_written_only_after_its_rounds_checkpoint(tmp_path) -> None:
    # A hub killed between the two must not hold a best model whose noise its restored accountant does not count.
    app = HubApp(parse_config(CONFIG, base=tmp_path), insecure_dev_only=True)
    state = app.algorithm.init_state()
    app.validate(state)
    best = tmp_path / "state" / "best_model.safetensors"
    assert app.best.found and app.best.round == 0 and not best.exists()
    app.hub.records.save(state, {})
    assert best.is_file() and load_best_round(tmp_path / "state", app.hub.run_id).round == 0


def test_a_hub_whose_run_fails_shows_phase_failed_to_a_last_scrape(tmp_path) -> None:
    """silokit_hub_phase lists "failed": a run that raises sets it before the process exits (and waits for a last
    scrape when a Prometheus was watching), so the dashboard does not freeze on the phase it died in."""
    config = parse_config({**CONFIG, "metrics": {"host": "127.0.0.1", "port": 0, "final_scrape_s": 0}},
                          base=tmp_path)
    app = HubApp(config, insecure_dev_only=True)

    def broken_run():
        app.hub.rounds.set_phase("training")
        raise RuntimeError("a bug in round 3")

    app.hub.run = broken_run
    with pytest.raises(RuntimeError, match="a bug in round 3"):
        app.run()
    text = generate_latest(app.metrics.registry).decode()
    assert 'silokit_hub_phase{phase="failed"} 1.0' in text and 'silokit_hub_phase{phase="training"} 0.0' in text


def test_a_hub_killed_between_a_checkpoint_and_its_best_model_write_keeps_that_model_on_restart(tmp_path) -> None:
    # The checkpoint of the best round so far is written, then the hub dies before best_model.safetensors is
    # (after_save never runs): the restarted hub writes that round's model from the checkpoint, so the file, the
    # card and the best-round gauge (BestRound.from_history) name the same round.
    config = parse_config(CONFIG, base=tmp_path)
    app = HubApp(config, insecure_dev_only=True)
    app.hub.records.after_save = None  # killed just after the checkpoint
    state = app.hub.rounds.resume_or_init()
    assert state.round == 0 and not (tmp_path / "state" / "best_model.safetensors").exists()
    initial = app.hub.records.initial.validation_accuracy
    again = HubApp(config, insecure_dev_only=True)
    assert not again.best.found
    assert again.load_checkpoint().round == 0
    kept = load_best_round(tmp_path / "state", again.hub.run_id)
    assert (kept.round, kept.accuracy) == (0, initial) == (again.best.round, again.best.accuracy)
    card = again.best_round_card()
    assert card is not None and (card["round"], card["validation_accuracy"]) == (0, initial)


def test_the_card_lists_the_silos_whose_updates_are_in_the_model_from_before_a_restart(tmp_path) -> None:
    # The card listed the registry's silos, those joined since the hub (re)started: a silo whose updates are in
    # the model from before a restart, and that did not join again, was missing from it.
    app = HubApp(parse_config(CONFIG, base=tmp_path), insecure_dev_only=True)
    app.hub.join("back", 40, 0, "cpu", skipped_images=2)
    app.hub.records.contributed = {"back": 3, "gone": 5}  # as a checkpoint restores them
    app.hub.registry.declared_before = {"gone": 70}
    card = app.silos_card()
    assert list(card) == ["back", "gone"]
    assert card["back"] == {"rounds_contributed": 3, "unlabeled_images": 40, "skipped_images": 2}
    assert card["gone"] == {"rounds_contributed": 5, "unlabeled_images": 70, "skipped_images": None}
