"""A silo refuses, with what to do, runs its data cannot take part in (before any training)."""

import json
import subprocess
import sys

import numpy as np
import pytest
import torch

from silo_client.errors import SiloError
from silo_client.run_checks import check_data_for
from silo_core.algorithms import ALGORITHMS
from silo_core.algorithms.base import SiloData

EMPTY = torch.zeros(0, 1, 28, 28, dtype=torch.uint8)
SOME = torch.zeros(4, 1, 28, 28, dtype=torch.uint8)


def test_supervised_ceiling_needs_simulation_labels():
    silo = ALGORITHMS["supervised"].silo
    with pytest.raises(SiloError, match="only a simulation has"):
        check_data_for("supervised", silo, SiloData(images=SOME))
    check_data_for("supervised", silo, SiloData(images=SOME, true_labels=torch.zeros(4, dtype=torch.int64)))


def test_a_labeled_only_site_can_join_hassle_but_not_semifl():
    labeled = SiloData(images=EMPTY, labeled_images=SOME, labeled_labels=torch.zeros(4, dtype=torch.int64))
    check_data_for("hassle", ALGORITHMS["hassle"].silo, labeled)
    with pytest.raises(SiloError, match="pass --data"):
        check_data_for("semifl", ALGORITHMS["semifl"].silo, labeled)
    with pytest.raises(SiloError, match="--data .* or --labeled"):
        check_data_for("hassle", ALGORITHMS["hassle"].silo, SiloData(images=EMPTY))


def test_cli_needs_data_or_labeled():
    proc = subprocess.run([sys.executable, "-m", "silo_client.cli", "--certs", "x"], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 2 and "--data" in proc.stderr and "--labeled" in proc.stderr


def test_simulation_labels_of_files_skipped_as_unreadable_are_dropped_not_all_of_them(tmp_path):
    # silo-sim stages one true label per file (labels.json, in list order); a truncated file skipped at load made
    # the counts differ and the silo dropped every label, so the pseudo-label accuracy read low.
    from PIL import Image

    from silo.v1 import silo_pb2
    from silo_client.client import SiloClient, SiloSettings

    images = tmp_path / "images"
    images.mkdir()
    for i in range(4):
        Image.fromarray(np.full((28, 28), 40 * i, dtype=np.uint8)).save(images / f"{i}.png")
    (images / "2.png").write_bytes(b"not a png")  # the third file, label 7
    (tmp_path / "labels.json").write_text(json.dumps([5, 6, 7, 8]))
    client = SiloClient(SiloSettings(hub="127.0.0.1:1", certs=None, data=images, device="cpu",
                                     state_dir=tmp_path / "state", insecure_dev_silo_id="dev-1",
                                     sim_labels=tmp_path / "labels.json"))
    try:
        data = client._load(silo_pb2.RunDescription(image_size=28, in_channels=1, num_classes=10))
        assert len(data.images) == 3 and data.true_labels.tolist() == [5, 6, 8]
    finally:
        client.close()
