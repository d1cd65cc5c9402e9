"""A silo whose folder is read from disk as it trains (over --cache-mb): real rounds against an in-process hub, with
loader worker processes forked beside gRPC, and a file that breaks between rounds skipped, counted and exported."""

from __future__ import annotations

import threading

import numpy as np
import pytest
from PIL import Image

from silo_client.cli import main
from silo_client.client import SiloClient, SiloSettings
from silo_client.metrics import SiloMetricFamilies, SiloMetrics
from silo_core.data import ImageFiles
from silo_server.app import HubApp
from silo_server.config import parse_config
from tests.silo_client.test_metrics import samples


def test_a_silo_reading_from_disk_trains_and_counts_a_file_that_breaks(tmp_path) -> None:
    folder = tmp_path / "images"
    folder.mkdir()
    rng = np.random.default_rng(0)
    for i in range(12):
        Image.fromarray(rng.integers(0, 256, (28, 28), dtype=np.uint8)).save(folder / f"{i:02d}.png")
    app = HubApp(parse_config({
        "run": {"state_dir": "state", "device": "cpu"},
        "server": {"host": "127.0.0.1", "port": 0, "certs": "hub", "linger_s": 5},
        "data": {"labeled": {"kind": "demo", "labels_per_class": 1}},
        "model": {"options": {"width": 4}},
        "algorithm": {"name": "semifl", "options": {"tau": 0.0, "hub_epochs": 1, "local_epochs": 1}},
        "rounds": {"total": 2},
        "metrics": {"enabled": False},
        "security": {"allowed_silos": ["dev-1"]},
    }, base=tmp_path), insecure_dev_only=True)
    port = app.start_server()
    families = SiloMetricFamilies()
    client = SiloClient(SiloSettings(hub=f"127.0.0.1:{port}", certs=None, data=folder, device="cpu",
                                     state_dir=tmp_path / "silo-state", insecure_dev_silo_id="dev-1",
                                     cache_mb=0, loader_workers=1), metrics=SiloMetrics(families, "dev-1"))
    hub = threading.Thread(target=app.run, daemon=True)
    try:
        client._join()
        assert isinstance(client.data.images, ImageFiles) and len(client.data.images) == 12
        assert client.skipped_images == 0
        (folder / "05.png").write_bytes(b"truncated by a failing disk")  # after listing, before training
        hub.start()
        assert client.run_forever() == 0
        hub.join(timeout=30)
    finally:
        client.close()
        app.stop(0)
    assert client.rounds_done == [1, 2]  # the broken file did not stop the silo
    assert client.skipped_images == 1 and client.data.images.skipped[0][0] == str(folder / "05.png")
    assert samples(families)[("silokit_silo_unreadable_images", (("silo", "dev-1"),))] == 1
    rounds = app.hub.records.history
    assert [r.algorithm.get("pseudo_label_ratio") for r in rounds] == [1.0, 1.0]  # 11 of 11 readable images
    assert [r.silos_reported for r in rounds] == [1, 1]


@pytest.mark.parametrize("flag, value", [("--cache-mb", "-1"), ("--cache-mb", "nan"), ("--loader-workers", "-1")])
def test_bad_loader_flags_are_refused(flag, value, capsys) -> None:
    with pytest.raises(SystemExit) as info:
        main(["--data", "images", "--certs", "certs", flag, value])
    assert info.value.code == 2 and flag in capsys.readouterr().err
