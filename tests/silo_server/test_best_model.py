"""The hub's best-round model file: what a restarted hub reads back from it, and what it ignores."""

import math

import torch
from safetensors.torch import load_file

from silo_core.models import ModelSpec
from silo_core.selection import BestRound
from silo_server.state.checkpoint import BEST_MODEL, load_best_round, save_best_model


def test_a_restarted_hub_reads_the_best_round_back_from_the_file_itself(tmp_path):
    model = ModelSpec("small_cnn", options={"width": 4}).build()
    save_best_model(tmp_path, model, "run-a", BestRound(round=7, accuracy=0.8125))
    assert sorted(p.name for p in tmp_path.iterdir()) == [BEST_MODEL]  # written whole, no temporary left behind
    restored = load_best_round(tmp_path, "run-a")
    assert (restored.round, restored.accuracy) == (7, 0.8125)
    weights = load_file(str(tmp_path / BEST_MODEL))
    assert all(torch.equal(weights[k], v) for k, v in model.state_dict().items())
    # The record goes on from there: a lower round score does not replace it, a higher one does.
    assert not restored.offer(8, 0.80) and restored.offer(9, 0.83)


def test_another_runs_or_an_unreadable_best_model_file_is_not_trusted(tmp_path):
    model = ModelSpec("small_cnn", options={"width": 4}).build()
    save_best_model(tmp_path, model, "run-a", BestRound(round=3, accuracy=0.9))
    assert load_best_round(tmp_path, "run-b").round == 0  # a state dir reused by another run
    (tmp_path / BEST_MODEL).write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{not json")
    empty = load_best_round(tmp_path, "run-a")
    assert empty.round == 0 and empty.accuracy == -math.inf  # the next validated round replaces the file
    assert load_best_round(tmp_path / "nowhere", "run-a").round == 0


def test_a_restarted_hub_keeps_the_initial_model_when_no_round_has_beaten_it(tmp_path):
    # Round 0 is the initial model, the hub's labels alone; a hub restarted before any round beat it must not
    # let the next, worse round replace it.
    model = ModelSpec("small_cnn", options={"width": 4}).build()
    save_best_model(tmp_path, model, "run-a", BestRound(round=0, accuracy=0.8))
    restored = load_best_round(tmp_path, "run-a")
    assert (restored.round, restored.accuracy, restored.found) == (0, 0.8, True)
    assert not restored.offer(3, 0.75) and restored.offer(4, 0.81)
