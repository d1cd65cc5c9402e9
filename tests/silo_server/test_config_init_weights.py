"""model.init_weights / model.init_from_run in hub.yaml: paths next to the config file, checked at load; the hub
reads the file once, logs what loaded, hands it to the algorithm's hub half, and tells no silo about it."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import save_file

from silo_core.models import ModelSpec
from silo_core.tensors import sha256_hex
from silo_server.cli import main
from silo_server.config import ConfigError, load_config, parse_config

BASE = {"data": {"labeled": {"kind": "demo", "labels_per_class": 2}}, "run": {"state_dir": "state", "device": "cpu"},
        "model": {"options": {"width": 4}}, "metrics": {"enabled": False}}
SMALL = ModelSpec(options={"width": 4})  # the demo data: 28x28 grayscale, 10 classes


def _config(tmp_path: Path, **model) -> Path:
    path = tmp_path / "hub.yaml"
    path.write_text(yaml.safe_dump({**BASE, "model": {**BASE["model"], **model}}))
    return path


def test_paths_are_relative_to_the_config_file_and_must_exist(tmp_path):
    save_file(SMALL.build().state_dict(), str(tmp_path / "start.safetensors"))
    (tmp_path / "earlier").mkdir()
    config = load_config(_config(tmp_path, init_weights="start.safetensors"))
    assert config.model.init_weights == tmp_path / "start.safetensors"
    with pytest.raises(ConfigError, match="model.init_weights .*nope.safetensors is not a file"):
        load_config(_config(tmp_path, init_weights="nope.safetensors"))
    with pytest.raises(ConfigError, match="model.init_from_run .*earlier holds no model.safetensors"):
        load_config(_config(tmp_path, init_from_run="earlier"))
    (tmp_path / "earlier" / "model.safetensors").write_bytes((tmp_path / "start.safetensors").read_bytes())
    assert load_config(_config(tmp_path, init_from_run="earlier")).model.init_from_run == tmp_path / "earlier"
    with pytest.raises(ConfigError, match="model.init_weights .* or model.init_from_run .*not both"):
        parse_config({**BASE, "model": {"init_weights": "a", "init_from_run": "b"}})


def test_the_hub_loads_the_file_once_for_its_hub_half_and_check_prints_the_report(tmp_path, caplog, capsys):
    torch.manual_seed(5)
    weights = SMALL.build().state_dict()
    save_file(weights, str(tmp_path / "start.safetensors"))
    from silo_server.app import HubApp

    with caplog.at_level(logging.INFO, logger="silo_server"):
        app = HubApp(load_config(_config(tmp_path, init_weights="start.safetensors")), insecure_dev_only=True)
    assert all(torch.equal(app.algorithm.initial_weights[k], v) for k, v in weights.items())
    count = len(weights)
    assert f"start.safetensors: {count} of {count} tensors loaded" in caplog.text
    assert "start" not in str(app.run_description())  # silos never hear of the file
    card = app.initial_weights_card()  # what the model card records of the starting point
    assert card["file"].endswith("start.safetensors") and card["loaded"] == count and card["missing"] == []
    assert card["sha256"] == sha256_hex((tmp_path / "start.safetensors").read_bytes())

    assert main(["--config", str(tmp_path / "hub.yaml"), "--check", "--insecure-dev-only"]) == 0
    assert f"{count} of {count} tensors loaded" in capsys.readouterr().out

    weights["features.4.weight"] = torch.zeros(8, 4, 5, 5)  # not the network the config names
    save_file(weights, str(tmp_path / "start.safetensors"))
    assert main(["--config", str(tmp_path / "hub.yaml"), "--check", "--insecure-dev-only"]) == 2
    assert "features.4.weight has shape (8, 4, 5, 5) in the file" in capsys.readouterr().err
