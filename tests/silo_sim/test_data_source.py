"""silo-sim's --data: the demo subset, a torchvision dataset on disk (its whole training split) or any folder of
class sub-folders, whose files are linked into the staged federation, never re-encoded."""

import gzip
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml
from PIL import Image

from silo_core.data import DataError, list_image_files
from silo_core.data.folders import load_labeled_folder
from silo_sim.stage import load_source, stage_federation


def colour_folder(root: Path, classes: int = 3, per_class: int = 12) -> Path:
    """JPEGs of 32 x 32 RGB noise, one tint per class so a network can tell them apart."""
    rng = np.random.default_rng(0)
    for k in range(classes):
        (root / f"class{k}").mkdir(parents=True)
        for i in range(per_class):
            pixels = rng.integers(0, 80, (32, 32, 3), dtype=np.uint8)
            pixels[..., k] += 170
            Image.fromarray(pixels).save(root / f"class{k}" / f"img{i}.jpg", quality=90)
    return root


def test_a_folder_source_is_split_and_linked_with_the_model_input_taken_from_its_images(tmp_path) -> None:
    folder = colour_folder(tmp_path / "photos")
    source = load_source(str(folder))
    assert (source.image_size, source.channels, len(source.train), source.test) == (32, 3, 36, None)
    staged = stage_federation(tmp_path / "fed", num_silos=2, labels_per_class=2, test_per_class=3, seed=0,
                              source=source)
    config = yaml.safe_load(staged.hub_config.read_text())
    assert config["model"]["image_size"] == 32 and config["model"]["in_channels"] == 3
    by_inode = {p.stat().st_ino: p.parent.name for p in list_image_files(folder)}
    test, labeled = list_image_files(staged.root / "hub" / "test"), list_image_files(staged.root / "hub" / "labeled")
    assert len(test) == 9 and len(labeled) == 6
    silo_files = [list_image_files(s.data) for s in staged.silos]
    assert sum(map(len, silo_files)) == 36 - 9 - 6
    # Every staged file is one of the originals (a hard link on one file system), each used once.
    staged_inodes = [p.stat().st_ino for p in test + labeled + sum(silo_files, [])]
    assert sorted(staged_inodes) == sorted(by_inode) and all(p.suffix == ".jpg" for p in test)
    # A labeled copy sits in its own class's folder, named as the source's; a silo's labels.json tells each file's
    # true class.
    assert all(by_inode[p.stat().st_ino] == p.parent.name for p in test + labeled)
    assert load_labeled_folder(staged.root / "hub" / "labeled", 32, 3).classes == ["class0", "class1", "class2"]
    for silo, files in zip(staged.silos, silo_files, strict=True):
        truth = json.loads(silo.labels.read_text())
        assert [f"class{k}" for k in truth] == [by_inode[p.stat().st_ino] for p in files]


def test_a_folder_sources_model_input_is_read_as_the_loader_reads_its_images(tmp_path) -> None:
    """16-bit and gray-palette PNGs are grayscale to the loader, so to the staged model too; a DICOM folder (which
    plain Pillow cannot open) is read through silo_core.dicom, as the hub, the silos and predict read it."""
    pytest.importorskip("pydicom", reason="needs pydicom: pip install 'silokit[dicom]'")
    from tests.dicom_files import png_to_dicom

    rng = np.random.default_rng(0)
    for k in range(2):
        (tmp_path / "wide" / f"c{k}").mkdir(parents=True)
        Image.fromarray(rng.integers(0, 65535, (20, 24), dtype=np.uint16)).save(tmp_path / "wide" / f"c{k}" / "a.png")
        gray = Image.fromarray(rng.integers(0, 255, (20, 24), dtype=np.uint8)).convert("P")
        gray.save(tmp_path / "wide" / f"c{k}" / "b.png")
        (tmp_path / "scans" / f"c{k}").mkdir(parents=True)
        for i in range(2):
            png = tmp_path / "scans" / f"c{k}" / f"{i}.png"
            Image.fromarray(rng.integers(0, 255, (30, 26), dtype=np.uint8)).save(png)
            png_to_dicom(png)
    assert Image.open(next((tmp_path / "wide" / "c0").glob("a.png"))).mode.startswith("I")
    wide = load_source(str(tmp_path / "wide"))
    assert (wide.channels, wide.image_size) == (1, 20)
    scans = load_source(str(tmp_path / "scans"))
    assert (scans.channels, scans.image_size, len(scans.train)) == (1, 26, 4)


def test_bad_sources_are_refused_with_what_to_pass(tmp_path) -> None:
    with pytest.raises(DataError, match="not a folder nor one of the known sources"):
        load_source(str(tmp_path / "missing"))
    (tmp_path / "flat").mkdir()
    Image.new("L", (8, 8)).save(tmp_path / "flat" / "a.png")
    with pytest.raises(DataError, match="needs a folder of class sub-folders"):
        load_source(str(tmp_path / "flat"))
    with pytest.raises(DataError, match="files not found"):
        load_source(f"fashion-mnist:{tmp_path}")


def write_idx(path: Path, array: np.ndarray) -> None:
    """An unsigned-byte IDX file (the MNIST format), gzipped, as the official files come."""
    header = bytes([0, 0, 0x08, array.ndim]) + b"".join(int(n).to_bytes(4, "big") for n in array.shape)
    with gzip.open(path, "wb") as fh:
        fh.write(header + array.astype(np.uint8).tobytes())


def test_a_torchvision_dataset_on_disk_is_a_source_with_its_own_test_split(tmp_path, sim_data_cache) -> None:
    raw = tmp_path / "data" / "FashionMNIST" / "raw"
    raw.mkdir(parents=True)
    rng = np.random.default_rng(0)
    for prefix, n in (("train", 40), ("t10k", 20)):
        write_idx(raw / f"{prefix}-images-idx3-ubyte.gz", rng.integers(0, 256, (n, 28, 28)))
        write_idx(raw / f"{prefix}-labels-idx1-ubyte.gz", np.arange(n) % 10)
    source = load_source(f"fashion-mnist:{tmp_path / 'data'}")
    assert (len(source.train), len(source.test), source.image_size, source.channels) == (40, 20, 28, 1)
    assert source.train.labels.tolist() == [i % 10 for i in range(40)]
    # Written once as PNG files of the cache, which staging links from.
    assert sorted(p.name.split("-")[0] for p in (sim_data_cache / "sim-data").iterdir()
                  if p.name.startswith("FashionMNIST")) == ["FashionMNIST", "FashionMNIST"]


def test_silo_sim_runs_on_an_rgb_folder_over_the_wire(tmp_path) -> None:
    folder = colour_folder(tmp_path / "photos", per_class=16)
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, "-m", "silo_sim.cli", "--data", str(folder), "--silos", "2", "--workers", "1",
         "--rounds", "1", "--labels-per-class", "3", "--test-per-class", "4", "--option", "hub_epochs=1",
         "--option", "tau=0.0", "--option", "local_epochs=1", "--workdir", str(tmp_path / "work"), "--out", str(out)],
        capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["rounds"][0]["silos_reported"] == 2 and summary["rounds"][0]["silos_contributed"] == 2
    assert 0.0 <= summary["baseline"]["test_accuracy"] <= 1.0  # the baseline read the same 32 px colour images
    assert summary["settings"]["data"] == str(folder) and summary["settings"]["image_size"] is None
    assert "from 48 images in 3 classes under" in " ".join(proc.stdout.split())  # the console wraps long lines


def test_in_memory_images_are_encoded_once_then_linked_by_every_staging(tmp_path, sim_data_cache) -> None:
    first = stage_federation(tmp_path / "one", num_silos=2, labels_per_class=1, unlabeled_limit=20, test_per_class=1)
    cached = sorted(p for p in (sim_data_cache / "sim-data").iterdir() if p.name.startswith("demo-"))
    assert [p.name.split("-")[0] for p in cached] == ["demo", "demo"]  # the train and test splits
    assert all((p / "complete").is_file() for p in cached)
    written = {p: p.stat().st_mtime_ns for c in cached for p in list_image_files(c)}
    assert len(written) == 6000 + 2000
    second = stage_federation(tmp_path / "two", num_silos=2, labels_per_class=1, unlabeled_limit=20,
                              test_per_class=1)
    assert {p: p.stat().st_mtime_ns for c in cached for p in list_image_files(c)} == written  # none rewritten
    for staged in (first, second):  # every staged image is a link to a cached file, with its pixels
        files = list_image_files(staged.root / "hub" / "test") + list_image_files(staged.silos[0].data)
        assert files and all(p.stat().st_nlink >= 2 for p in files)
    one, two = (list_image_files(s.silos[0].data) for s in (first, second))
    assert [p.stat().st_ino for p in one] == [p.stat().st_ino for p in two]  # same seed, same images


def test_the_hub_part_is_complete_before_the_silos_are_staged(tmp_path) -> None:
    seen = []

    def hub_staged(staged) -> None:  # silo-sim starts the hub here
        config = yaml.safe_load(staged.hub_config.read_text())
        seen.append((config["rounds"]["min_silos"], len(staged.silos), (staged.root / "pki" / "hub").is_dir(),
                     len(list_image_files(staged.root / "hub" / "labeled")), (staged.root / "silos").exists()))

    staged = stage_federation(tmp_path / "fed", num_silos=3, labels_per_class=1, unlabeled_limit=30,
                              test_per_class=1, seed=0, hub_staged=hub_staged)
    assert seen == [(3, 0, True, 10, False)] and len(staged.silos) == 3


def test_a_labeled_silo_gets_a_folder_for_every_class_even_those_its_shard_lacks(tmp_path) -> None:
    # Two classes per silo: the labeled silo's shard holds 2 of the demo's 10 classes, and a labeled folder's
    # classes are its sub-folders, which the silo checks against the run's count.
    staged = stage_federation(tmp_path / "fed", num_silos=5, labels_per_class=1, partition="classes",
                              classes_per_silo=2, labeled_silos=1, silo_labels_per_class=2, test_per_class=2,
                              unlabeled_limit=200, seed=0)
    folder = staged.silos[0].labeled
    classes = sorted(d.name for d in folder.iterdir() if d.is_dir())
    assert len(classes) == 10
    assert sum(1 for d in folder.iterdir() if d.is_dir() and any(d.iterdir())) <= 2  # the rest are empty
    assert len(load_labeled_folder(folder, 28, 1).classes) == 10  # as the silo loads it for a 10-class run


def test_the_in_process_replay_gives_a_labeled_silo_its_labeled_folder_as_the_silo_client_does(tmp_path,
                                                                                            monkeypatch) -> None:
    # replay_staged (the benchmark's wire check) read each silo's unlabeled folder only: HASSLE's labeled silos
    # trained there on less than over the wire, where silo-client also loads --labeled.
    import silo_sim.inprocess as inprocess

    staged = stage_federation(tmp_path / "fed", num_silos=3, labels_per_class=1, labeled_silos=1,
                              silo_labels_per_class=2, test_per_class=1, unlabeled_limit=60, seed=0)
    seen = {}

    def capture(hub, silo, silos, rounds, fraction, seed, evaluate):
        seen.update({d.silo_id: (len(d.images), d.num_labeled, d.labeled_labels) for d in silos})
        return None, []

    monkeypatch.setattr(inprocess, "run_inprocess", capture)
    inprocess.replay_staged(staged.root, "hassle", {}, rounds=1)
    by_name = {s.name: s for s in staged.silos}
    assert set(seen) == set(by_name)
    for name, (unlabeled, labeled, labels) in seen.items():
        spec = by_name[name]
        assert (unlabeled, labeled) == (spec.num_images, spec.num_labeled)
        if spec.labeled is not None:
            assert labeled > 0 and len(labels) == labeled and labels.max() < 10
        else:
            assert labels is None
    assert sum(1 for s in staged.silos if s.labeled is not None) == 1
