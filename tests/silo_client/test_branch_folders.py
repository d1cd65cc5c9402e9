"""A branch's folders as the silo counts and reads them: a file found unreadable while reading from disk stops
counting as an image at the next join (as in memory), an empty --data beside --labeled is a labeled-only silo,
images loose in --labeled are named and not counted, and linked folders are read (each real folder once)."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import numpy as np
from PIL import Image

from silo.v1 import silo_pb2
from silo_client.local_data import load_branch_data, usable_count
from silo_client.run_checks import count_image_files
from silo_client.settings import SiloSettings
from silo_core.data import count_image_files as count_listed
from silo_core.data import image_batches, list_image_files, load_unlabeled_folder

RUN = silo_pb2.RunDescription(image_size=28, in_channels=1, classes=["a", "b"])
LOG = logging.getLogger("test_branch_folders")


def png(path: Path, seed: int = 0) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(np.random.default_rng(seed).integers(0, 256, (28, 28), dtype=np.uint8)).save(path)
    return path


def settings(tmp_path: Path, **kw) -> SiloSettings:
    return SiloSettings(**{"hub": "127.0.0.1:1", "certs": None, "data": None, **kw})


def load(s: SiloSettings, tmp_path: Path):
    return load_branch_data(s, RUN, state_dir=tmp_path / "state", silo_id="s", files=0, log=LOG)


def test_a_truncated_file_read_from_disk_stops_counting_as_an_image_once_found(tmp_path):
    for i in range(3):
        png(tmp_path / "d" / f"{i}.png", i)
    whole = (tmp_path / "d" / "1.png").read_bytes()
    (tmp_path / "d" / "1.png").write_bytes(whole[: len(whole) // 2])  # its header still reads
    in_memory, skipped = load(settings(tmp_path, data=tmp_path / "d"), tmp_path)
    assert usable_count(in_memory.images) == 2 and skipped == 1
    lazy, skipped = load(settings(tmp_path, data=tmp_path / "d", cache_mb=0.0001), tmp_path)
    assert len(lazy.images) == 3 and skipped == 0  # only the headers were checked
    for _ in image_batches(lazy.images, [np.arange(3)]):  # training reads every file once
        pass
    assert len(lazy.images.skipped) == 1
    assert usable_count(lazy.images) == 2  # what the next join declares: as in memory, not 3 (plus 1 skipped)


def test_a_silo_weighs_its_update_by_the_images_it_could_read(tmp_path):
    # The count a join declares leaves out files found unreadable; a weight of every listed file exceeded it, and
    # the hub refused each update (bad_weight), or under secure aggregation the whole sum.
    import torch

    from silo_core.algorithms.base import RoundPlan, SiloData, model_tensors
    from silo_core.algorithms.fedavg_fixmatch import FedAvgFixMatchOptions, FedAvgFixMatchSilo
    from silo_core.models import ModelSpec

    for i in range(4):
        png(tmp_path / "d" / f"{i}.png", i)
    whole = (tmp_path / "d" / "1.png").read_bytes()
    (tmp_path / "d" / "1.png").write_bytes(whole[: len(whole) // 2])
    images = load_unlabeled_folder(tmp_path / "d", 28, 1, cache_mb=0.0001).images
    spec = ModelSpec(options={"width": 4})
    torch.manual_seed(0)
    plan = RoundPlan(round=1, tensors=model_tensors(spec.build()), hyperparameters={"lr": 0.01, "seed": 0}, expected={})
    options = FedAvgFixMatchOptions(aggregation="samples", local_epochs=1, silo_batch_size=4)
    result = FedAvgFixMatchSilo(options, spec, torch.device("cpu")).local_update(plan, SiloData(images=images))
    assert len(images) == 4 and usable_count(images) == 3 and float(result.tensors["weight"]) == 3.0
    # Every file gone unreadable while it trained (a lost mount): it sends nothing, not a weight of 0 (malformed)
    for i in (0, 2, 3):
        whole = (tmp_path / "d" / f"{i}.png").read_bytes()
        (tmp_path / "d" / f"{i}.png").write_bytes(whole[: len(whole) // 2])
    result = FedAvgFixMatchSilo(options, spec, torch.device("cpu")).local_update(plan, SiloData(images=images))
    assert result.skipped and result.tensors == {} and usable_count(images) == 0


def test_an_empty_data_folder_beside_a_labeled_one_is_a_labeled_only_silo(tmp_path):
    (tmp_path / "d").mkdir()
    png(tmp_path / "l" / "a" / "x.png")
    (tmp_path / "l" / "b").mkdir()
    data, skipped = load(settings(tmp_path, data=tmp_path / "d", labeled=tmp_path / "l"), tmp_path)
    assert len(data.images) == 0 and usable_count(data.labeled_images) == 1 and skipped == 0


def test_images_loose_in_the_labeled_folder_are_named_and_not_counted(tmp_path, caplog):
    png(tmp_path / "l" / "a" / "x.png")
    (tmp_path / "l" / "b").mkdir()
    png(tmp_path / "l" / "loose.png")
    assert count_image_files(tmp_path / "l", "--labeled") == 1  # what a silo joining before loading declares
    with caplog.at_level(logging.WARNING, logger=LOG.name):
        data, _ = load(settings(tmp_path, labeled=tmp_path / "l"), tmp_path)
    assert usable_count(data.labeled_images) == 1
    assert any("loose.png" in r.getMessage() and "no class sub-folder" in r.getMessage() for r in caplog.records)


def test_linked_folders_are_read_each_real_folder_once(tmp_path):
    png(tmp_path / "d" / "a.png")
    png(tmp_path / "ext" / "b.png")
    png(tmp_path / "ext" / "c.png")
    os.symlink(tmp_path / "ext", tmp_path / "d" / "linked")
    os.symlink(tmp_path / "ext", tmp_path / "d" / "again")  # the same folder twice
    os.symlink(tmp_path / "d", tmp_path / "d" / "loop")  # a link back up the tree
    assert count_listed(tmp_path / "d") == len(list_image_files(tmp_path / "d")) == 3
    assert len(load_unlabeled_folder(tmp_path / "d", 28, 1)) == 3
    png(tmp_path / "l" / "a" / "x.png")
    os.symlink(tmp_path / "ext", tmp_path / "l" / "b")  # a linked class folder
    assert count_image_files(tmp_path / "l", "--labeled") == 3
    data, _ = load(settings(tmp_path, labeled=tmp_path / "l"), tmp_path)
    assert data.labeled_labels.tolist() == [0, 1, 1]
