"""hub.yaml data.cache_mb / data.loader_workers: the hub reads a big imagefolder from disk as it trains."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from silo_core.data import DEFAULT_CACHE_MB, DEFAULT_LOADER_WORKERS, ImageFiles
from silo_core.data.lazy import _worker_start
from silo_server.app import HubApp
from silo_server.config import ConfigError, parse_config


def config(tmp_path, **data):
    rng = np.random.default_rng(0)
    for c in range(3):
        folder = tmp_path / "labeled" / f"class{c}"
        folder.mkdir(parents=True)
        for i in range(4):
            Image.fromarray(rng.integers(0, 256, (28, 28), dtype=np.uint8)).save(folder / f"{i}.png")
    return parse_config({
        "run": {"state_dir": "state", "device": "cpu"},
        "server": {"host": "127.0.0.1", "port": 0, "certs": "hub"},
        "data": {"labeled": {"kind": "imagefolder", "path": "labeled"}, "test": {"kind": "imagefolder", "path": "labeled"},
                 **data},
        "model": {"options": {"width": 4}},
        "algorithm": {"name": "semifl", "options": {"hub_epochs": 1}},
        "metrics": {"enabled": False},
    }, base=tmp_path)


def test_defaults_and_a_hub_reading_its_labels_from_disk(tmp_path):
    memory = config(tmp_path)
    assert (memory.data.cache_mb, memory.data.loader_workers) == (DEFAULT_CACHE_MB, DEFAULT_LOADER_WORKERS)
    app = HubApp(config(tmp_path / "lazy", cache_mb=0, loader_workers=1), insecure_dev_only=True)
    assert isinstance(app.labeled.images, ImageFiles) and app.labeled.images.workers == 1
    assert isinstance(app.test.images, ImageFiles)
    assert isinstance(HubApp(memory).labeled.images, torch.Tensor)  # 12 small images: in memory
    # Loader workers start while the hub serves: forked from the hub itself they inherited its gRPC server's
    # polling state, and one crashed in gRPC's epoll code (silo-sim with data.cache_mb 0); they come from a fork
    # server now, which has nothing of the hub.
    assert _worker_start().get_start_method() in ("forkserver", "spawn")
    app.start_server()
    try:
        state = app.hub.rounds.resume_or_init()  # the initial ServerUpdate and static BN read the files
        scores = app.evaluate(state)
    finally:
        app.stop(0)
    assert 0.0 <= scores["accuracy"] <= 1.0 and np.isfinite(scores["loss"])


@pytest.mark.parametrize("key, value, words", [
    ("cache_mb", -1, "greater than or equal to 0"),
    ("loader_workers", -2, "greater than or equal to 0"),
    ("loader_workers", 1.5, "whole number"),
])
def test_bad_loader_settings_are_refused_by_key(tmp_path, key, value, words):
    with pytest.raises(ConfigError) as info:
        parse_config({"data": {"labeled": {"kind": "demo"}, key: value}}, base=tmp_path)
    assert f"data.{key}" in str(info.value) and words in str(info.value)
