"""A HASSLE run serves a dual ensemble of four networks (S, U and their residual models), not one network of the
card's model spec: silo-predict and silo-export build that structure from the card's algorithm and options, on a
state folder written by the hub's own export."""

from __future__ import annotations

import json

import onnxruntime
import torch

from silo_core.algorithms.hassle import DualEnsemble
from silo_server.app import HubApp
from silo_server.config import parse_config
from silo_tools.card import load_trained_model
from silo_tools.export import main as export_main


def test_a_hassle_runs_dual_ensemble_loads_and_exports_as_the_hub_served_it(tmp_path):
    config = parse_config({
        "run": {"state_dir": "state", "device": "cpu", "threads": 1},
        "server": {"host": "127.0.0.1", "port": 0},
        "data": {"labeled": {"kind": "demo", "labels_per_class": 2}},
        "model": {"options": {"width": 4}},
        "algorithm": {"name": "hassle", "options": {"local_epochs": 1, "batch_size": 8, "residual_width": 0.5,
                                                    "inference": "supervised"}},
    }, base=tmp_path)
    app = HubApp(config, insecure_dev_only=True)
    state = app.algorithm.init_state()
    app.export(state)  # the hub's own card and weights
    card = json.loads((tmp_path / "state" / "model_card.json").read_text())
    assert "dual ensemble" in card["inference"]

    trained = load_trained_model(tmp_path / "state")
    assert isinstance(trained.model, DualEnsemble) and trained.model.mode == "supervised"
    served = app.algorithm.served_model(state)
    torch.manual_seed(0)
    images = torch.rand(4, 1, 28, 28)
    with torch.no_grad():
        assert torch.allclose(trained.model(images), served(images), atol=1e-6)

    out = tmp_path / "model.onnx"
    assert export_main(["--model", str(tmp_path / "state"), "--format", "onnx", "--out", str(out), "-q"]) == 0
    session = onnxruntime.InferenceSession(str(out), providers=["CPUExecutionProvider"])
    mean, std = torch.tensor(card["model"]["normalize_mean"]), torch.tensor(card["model"]["normalize_std"])
    got = torch.from_numpy(session.run(None, {"images": images.numpy()})[0])
    with torch.no_grad():
        expected = served((images - mean.view(1, -1, 1, 1)) / std.view(1, -1, 1, 1))
    assert (got - expected).abs().max() <= 1e-4
