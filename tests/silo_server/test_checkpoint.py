"""Resuming trusts nothing in the state folder: each tampering or corruption below, made to a real checkpoint, makes
the hub fall back to the previous round with a warning naming the file, or refuse with one line saying how to
recover, before its port opens."""

import hashlib
import json
import logging
import math
import shutil
import subprocess
import sys

import pytest
import torch
import yaml
from safetensors.torch import load_file, save_file

from silo_core.algorithms.base import HubState, load_model, model_tensors
from silo_core.models import ModelSpec
from silo_core.selection import BestRound
from silo_server.state.checkpoint import (
    BEST_MODEL,
    INFO,
    MANIFEST,
    TENSORS,
    CheckpointError,
    load_best_round,
    load_latest,
    save_best_model,
    save_checkpoint,
)

SPEC = ModelSpec("small_cnn", options={"width": 4})
TOTAL = 10


def fits_model(state):
    """What the hub passes: the algorithm's served model, loaded strictly from the checkpoint's tensors."""
    return load_model(SPEC, state.tensors)


def load(state_dir):
    return load_latest(state_dir, total_rounds=TOTAL, check=fits_model)


def write_rounds(state_dir, *rounds):
    """Real checkpoints, one per round; round r's weights are all r so that the tests can tell them apart."""
    model = SPEC.build()
    for r in rounds:
        tensors = {k: torch.full_like(v, float(r)) if v.is_floating_point() else v
                   for k, v in model_tensors(model).items()}
        save_checkpoint(state_dir, HubState(r, tensors, {"hub_loss": 0.5}), {"history": [{"round": r}]})
    return state_dir / "checkpoints"


def round_dir(state_dir, r):
    return state_dir / "checkpoints" / f"round-{r:06d}"


def resign(folder):
    """Recompute the manifest as a careful forger would: the checks beyond the checksums must hold on their own."""
    sums = json.loads((folder / MANIFEST).read_text())["sha256"]
    for name in sums:
        sums[name] = hashlib.sha256((folder / name).read_bytes()).hexdigest()
    (folder / MANIFEST).write_text(json.dumps({"sha256": sums}))


def set_round(folder, value):
    info = json.loads((folder / INFO).read_text())
    info["round"] = value
    (folder / INFO).write_text(json.dumps(info))
    resign(folder)


def first_weight(loaded):
    state, _ = loaded
    return float(next(v for v in state.tensors.values() if v.is_floating_point()).flatten()[0])


def assert_fell_back(tmp_path, caplog, bad_file, why):
    with caplog.at_level(logging.WARNING, logger="silo_server"):
        loaded = load(tmp_path)
    assert loaded[0].round == 1 and first_weight(loaded) == 1.0 and loaded[1]["history"] == [{"round": 1}]
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any(str(bad_file) in w and why in w and str(round_dir(tmp_path, 1)) in w for w in warnings), warnings


def test_a_good_checkpoint_round_trips_without_warnings(tmp_path, caplog):
    write_rounds(tmp_path, 1, 2)
    with caplog.at_level(logging.WARNING, logger="silo_server"):
        state, info = load(tmp_path)
    assert state.round == 2 and state.meta == {"hub_loss": 0.5} and info["history"] == [{"round": 2}]
    assert first_weight((state, info)) == 2.0
    assert fits_model(state) is not None
    assert sorted(p.name for p in round_dir(tmp_path, 2).iterdir()) == [MANIFEST, INFO, TENSORS]
    assert caplog.records == []
    assert load(tmp_path / "fresh") is None  # no checkpoint at all: a fresh run


def test_latest_pointing_outside_the_state_dir_is_never_followed(tmp_path, caplog):
    write_rounds(tmp_path / "elsewhere", 7)  # a checkpoint that verifies, outside this state folder
    root = write_rounds(tmp_path / "state", 1, 2)
    (root / "LATEST").write_text("../../elsewhere/checkpoints/round-000007")
    with caplog.at_level(logging.WARNING, logger="silo_server"):
        state, _ = load(tmp_path / "state")
    assert state.round == 2  # the newest round directory inside checkpoints/, not round 7
    assert any("LATEST does not name a round-N directory" in r.getMessage() for r in caplog.records)


def test_a_missing_latest_resumes_from_the_newest_round_directory_with_a_warning(tmp_path, caplog):
    root = write_rounds(tmp_path, 1, 2)
    (root / "LATEST").unlink()
    with caplog.at_level(logging.WARNING, logger="silo_server"):
        state, _ = load(tmp_path)
    assert state.round == 2
    assert any("LATEST is missing" in r.getMessage() for r in caplog.records)


def test_a_round_directory_that_is_a_symlink_out_of_the_state_dir_is_refused(tmp_path, caplog):
    write_rounds(tmp_path / "elsewhere", 3)
    root = write_rounds(tmp_path / "state", 1, 2)
    shutil.rmtree(root / "round-000002")
    (root / "round-000002").symlink_to(tmp_path / "elsewhere" / "checkpoints" / "round-000003")
    with caplog.at_level(logging.WARNING, logger="silo_server"):
        state, _ = load(tmp_path / "state")
    assert state.round == 1
    assert any("round-000002 leads outside" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("value", [10**12, TOTAL + 1, -5, "3", 2.0, True])
def test_a_round_out_of_range_or_not_an_integer_falls_back(tmp_path, caplog, value):
    write_rounds(tmp_path, 1, 2)
    set_round(round_dir(tmp_path, 2), value)
    assert_fell_back(tmp_path, caplog, round_dir(tmp_path, 2) / INFO, f"holds round {value!r}")


def test_a_round_that_disagrees_with_its_directory_falls_back(tmp_path, caplog):
    write_rounds(tmp_path, 1, 2)
    set_round(round_dir(tmp_path, 2), 5)
    assert_fell_back(tmp_path, caplog, round_dir(tmp_path, 2) / INFO, "holds round 5 but lies in round-000002")


def test_nan_weights_fall_back(tmp_path, caplog):
    write_rounds(tmp_path, 1, 2)
    path = round_dir(tmp_path, 2) / TENSORS
    tensors = load_file(str(path))
    name = sorted(tensors)[0]
    tensors[name].view(-1)[0] = math.nan
    save_file(tensors, str(path))
    resign(round_dir(tmp_path, 2))
    assert_fell_back(tmp_path, caplog, path, f"NaN or infinite values in {name}")


def test_tensors_that_do_not_fit_the_model_fall_back(tmp_path, caplog):
    write_rounds(tmp_path, 1, 2)
    path = round_dir(tmp_path, 2) / TENSORS
    tensors = load_file(str(path))
    name = sorted(tensors)[0]
    tensors[name] = torch.zeros(3)
    save_file(tensors, str(path))
    resign(round_dir(tmp_path, 2))
    assert_fell_back(tmp_path, caplog, path, "does not fit the model")


def test_a_flipped_byte_falls_back(tmp_path, caplog):
    write_rounds(tmp_path, 1, 2)
    path = round_dir(tmp_path, 2) / TENSORS
    data = bytearray(path.read_bytes())
    data[-3] ^= 0x01  # inside the weights: the file still parses, only its checksum tells
    path.write_bytes(bytes(data))
    load_file(str(path))
    assert_fell_back(tmp_path, caplog, path, "does not match the sha256")


def test_a_truncated_file_falls_back(tmp_path, caplog):
    write_rounds(tmp_path, 1, 2)
    path = round_dir(tmp_path, 2) / TENSORS
    path.write_bytes(path.read_bytes()[:100])
    assert_fell_back(tmp_path, caplog, path, "does not match the sha256")


def test_a_checkpoint_without_a_manifest_loads_unverified_with_a_warning(tmp_path, caplog):
    write_rounds(tmp_path, 1, 2)  # as the code before checksums wrote them
    for r in (1, 2):
        (round_dir(tmp_path, r) / MANIFEST).unlink()
    with caplog.at_level(logging.WARNING, logger="silo_server"):
        state, _ = load(tmp_path)
    assert state.round == 2
    assert any(f"{round_dir(tmp_path, 2)} has no {MANIFEST}" in r.getMessage() and "unverified" in r.getMessage()
               for r in caplog.records)
    # The other checks still hold for such a checkpoint: a truncated one falls back to the round before.
    path = round_dir(tmp_path, 2) / TENSORS
    path.write_bytes(path.read_bytes()[:100])
    caplog.clear()
    assert_fell_back(tmp_path, caplog, path, "is unreadable")


def test_when_no_checkpoint_verifies_the_error_names_the_file_and_the_way_out(tmp_path):
    write_rounds(tmp_path, 1)
    path = round_dir(tmp_path, 1) / TENSORS
    path.write_bytes(path.read_bytes()[:100])
    with pytest.raises(CheckpointError) as err:
        load(tmp_path)
    message = str(err.value)
    assert isinstance(err.value, ValueError) and "\n" not in message
    assert f"{path} does not match the sha256" in message and f"move {tmp_path} aside" in message


def test_a_corrupt_best_model_is_ignored_with_a_warning(tmp_path, caplog):
    save_best_model(tmp_path, SPEC.build(), "run-a", BestRound(round=4, accuracy=0.75))
    path = tmp_path / BEST_MODEL
    path.write_bytes(path.read_bytes()[:-100])  # the header parses; the weights are cut short
    with caplog.at_level(logging.WARNING, logger="silo_server"):
        best = load_best_round(tmp_path, "run-a")
    assert best.round == 0
    assert any(str(path) in r.getMessage() and "ignored" in r.getMessage() for r in caplog.records)


# ------------------------------------------------------------------------------ through the silo-server command

def test_the_hub_refuses_a_corrupt_only_checkpoint_before_it_opens_its_port(tmp_path):
    state_dir = tmp_path / "state"
    cfg = tmp_path / "hub.yaml"
    cfg.write_text(yaml.safe_dump({
        "data": {"labeled": {"kind": "demo", "labels_per_class": 2}},
        "model": {"name": "small_cnn", "image_size": 28, "in_channels": 1},
        "server": {"host": "127.0.0.1", "port": 0}, "metrics": {"enabled": False},
        "run": {"state_dir": str(state_dir), "device": "cpu"},
    }))
    write_rounds(state_dir, 1)
    path = round_dir(state_dir, 1) / TENSORS
    path.write_bytes(path.read_bytes()[:100])
    for extra in ([], ["--check"]):  # a real start, then the check that would have caught it
        proc = subprocess.run([sys.executable, "-m", "silo_server.cli", "--config", str(cfg), "--insecure-dev-only",
                               *extra], capture_output=True, text=True, timeout=120)
        errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
        assert proc.returncode == 2, proc.stderr
        assert len(errors) == 1 and str(path) in errors[0] and "aside" in errors[0], proc.stderr
        assert "Traceback" not in proc.stderr
        assert not (state_dir / "port").exists()  # refused before the port opened
