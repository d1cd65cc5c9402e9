"""A silo refuses, with what to do, runs its data cannot take part in (before any training)."""

import subprocess
import sys

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
