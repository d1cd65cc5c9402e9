"""Image folders read lazily (silo_core.data.ImageFiles): nothing is decoded up front, every pass decodes each file
once, training gives the same model as the in-memory path, and a file that breaks mid-training is skipped, counted
and never fatal. Real image files written with Pillow; the decoder is only wrapped to count its calls."""

import os
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

import silo_core.data
from silo_core.algorithms.base import RoundPlan, SiloData, model_tensors
from silo_core.algorithms.fedseal import image_fingerprint
from silo_core.algorithms.semifl import SemiFLOptions, SemiFLSilo
from silo_core.data import (
    ImageFiles,
    fits_in_memory,
    image_batches,
    load_labeled_folder,
    load_unlabeled_folder,
    padded_image_batches,
    readable,
)
from silo_core.models import ModelSpec
from silo_core.training import OptimizerSettings, evaluate, predict_logits, shuffled_batches, train_supervised

SIZE = 16
SPEC = ModelSpec(num_classes=3, in_channels=3, image_size=SIZE, mean=[0.5] * 3, std=[0.5] * 3,
                 options={"width": 4})
CPU = torch.device("cpu")


def write_folder(root: Path, count: int, classes: int = 0, seed: int = 0) -> list[Path]:
    """``count`` RGB images of random structured content (PNG and JPEG mixed, sizes other than SIZE so they are
    resized); under ``root/<class>/`` when ``classes`` > 0."""
    rng = np.random.default_rng(seed)
    paths = []
    for i in range(count):
        folder = root / f"{i % classes:02d}_class" if classes else root
        folder.mkdir(parents=True, exist_ok=True)
        base = rng.integers(0, 256, (6, 6, 3), dtype=np.uint8)
        img = Image.fromarray(base).resize((20 + i % 5, 24), Image.Resampling.BILINEAR)
        path = folder / f"{i:03d}.{'jpg' if i % 3 == 0 else 'png'}"
        img.save(path)
        paths.append(path)
    return paths


@pytest.fixture
def decodes(monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    """Every path decode_file is called on, in this process (count with workers=0)."""
    seen: list[Path] = []
    real = silo_core.data.decoding.decode_file

    def counting(path, image_size, channels):
        seen.append(Path(path))
        return real(path, image_size, channels)

    monkeypatch.setattr(silo_core.data.decoding, "decode_file", counting)
    return seen


def test_listing_decodes_nothing_and_each_pass_decodes_each_file_once(tmp_path: Path, decodes: list[Path]):
    paths = write_folder(tmp_path / "u", 21)
    loaded = load_unlabeled_folder(tmp_path / "u", SIZE, 3, cache_mb=0, workers=0)
    assert isinstance(loaded.images, ImageFiles) and len(loaded) == 21 and loaded.skipped == []
    assert tuple(loaded.images.shape) == (21, 3, SIZE, SIZE)
    assert decodes == []  # listed and headers checked, not one pixel decoded

    batches = shuffled_batches(21, 5, torch.Generator().manual_seed(0))
    seen = sum(len(idx) for idx, _ in image_batches(loaded.images, batches))
    assert seen == 20  # one epoch: the trailing batch of one is dropped by shuffled_batches, as for tensors
    assert sorted(decodes) == sorted(paths[int(i)] for b in batches for i in b)

    decodes.clear()
    predict_logits(SPEC.build(), loaded.images, SPEC.mean, SPEC.std, CPU, batch_size=7)
    assert sorted(decodes) == sorted(paths)  # one whole-set pass: every file once


def test_cache_threshold_picks_memory_or_files(tmp_path: Path, decodes: list[Path]):
    write_folder(tmp_path / "u", 10)
    exact = 10 * 3 * SIZE * SIZE / 2**20  # the decoded bytes, in MiB
    assert fits_in_memory(10, SIZE, 3, exact) and not fits_in_memory(10, SIZE, 3, exact * 0.999)
    in_memory = load_unlabeled_folder(tmp_path / "u", SIZE, 3, cache_mb=exact, workers=0)
    assert isinstance(in_memory.images, torch.Tensor) and len(decodes) == 10
    lazy = load_unlabeled_folder(tmp_path / "u", SIZE, 3, cache_mb=exact * 0.999, workers=0)
    assert isinstance(lazy.images, ImageFiles) and len(decodes) == 10
    # The same pixels, whichever process decodes them (two loader workers here).
    lazy.images.workers = 2
    order = [torch.tensor([3, 0, 7]), torch.tensor([9, 1]), torch.arange(10)]
    for idx, pixels in image_batches(lazy.images, order):
        assert torch.equal(pixels, in_memory.images[idx])


def test_views_index_files_not_pixels(tmp_path: Path):
    paths = write_folder(tmp_path / "u", 8)
    files = load_unlabeled_folder(tmp_path / "u", SIZE, 3, cache_mb=0).images
    assert files[2:5].paths == paths[2:5]
    assert files[torch.tensor([6, 1])].paths == [paths[6], paths[1]]
    mask = torch.tensor([True, False] * 4)
    assert files[mask].paths == paths[::2]
    assert files[mask][torch.tensor([3, 0])].paths == [paths[6], paths[0]]  # views of views
    assert len(files[:0]) == 0 and tuple(files[:0].shape) == (0, 3, SIZE, SIZE)
    with pytest.raises(TypeError):
        files[3]


def test_labeled_folder_read_lazily_has_the_same_labels_and_pixels(tmp_path: Path):
    write_folder(tmp_path / "l", 15, classes=3)
    (tmp_path / "l" / "01_class" / "broken.png").write_bytes(b"not an image")
    memory = load_labeled_folder(tmp_path / "l", SIZE, 3)
    lazy = load_labeled_folder(tmp_path / "l", SIZE, 3, cache_mb=0, workers=0)
    assert isinstance(memory.images, torch.Tensor) and isinstance(lazy.images, ImageFiles)
    assert lazy.classes == memory.classes and torch.equal(lazy.labels, memory.labels)
    assert [p for p, _ in lazy.skipped] == [p for p, _ in memory.skipped] == [str(tmp_path / "l/01_class/broken.png")]
    _, pixels = next(image_batches(lazy.images, [torch.arange(len(lazy))]))
    assert torch.equal(pixels, memory.images)


def test_lazy_refuses_special_files_and_non_images_up_front(tmp_path: Path):
    write_folder(tmp_path / "u", 3)
    (tmp_path / "u" / "junk.jpg").write_bytes(b"\x00" * 100)
    os.mkfifo(tmp_path / "u" / "pipe.png")  # would block a reader forever
    lazy = load_unlabeled_folder(tmp_path / "u", SIZE, 3, cache_mb=0, workers=0)
    reasons = dict(lazy.skipped)
    assert len(lazy) == 3 and set(reasons) == {str(tmp_path / "u/junk.jpg"), str(tmp_path / "u/pipe.png")}
    assert "FIFO" in reasons[str(tmp_path / "u/pipe.png")]


def test_lazy_and_in_memory_train_the_same_model(tmp_path: Path):
    write_folder(tmp_path / "l", 24, classes=3)
    memory = load_labeled_folder(tmp_path / "l", SIZE, 3)
    lazy = load_labeled_folder(tmp_path / "l", SIZE, 3, cache_mb=0, workers=2)
    weights = []
    for images in (memory.images, lazy.images):
        torch.manual_seed(0)
        model = SPEC.build()
        train_supervised(model, images, memory.labels, epochs=2, batch_size=5, lr=0.05, opt=OptimizerSettings(),
                         mean=SPEC.mean, std=SPEC.std, device=CPU, generator=torch.Generator().manual_seed(1))
        weights.append(model.state_dict())
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])


def semifl_update(images, silo_id: str = "s") -> tuple[dict, dict]:
    torch.manual_seed(0)
    plan = RoundPlan(round=1, tensors=model_tensors(SPEC.build()), hyperparameters={"lr": 0.05, "seed": 3},
                     expected={})
    options = SemiFLOptions(tau=0.0, local_epochs=2, silo_batch_size=4)  # every image pseudo-labeled
    result = SemiFLSilo(options, SPEC, CPU).local_update(plan, SiloData(images=images, silo_id=silo_id))
    assert not result.skipped
    return result.tensors, result.metrics


def test_a_semifl_silo_update_is_the_same_from_memory_or_from_files(tmp_path: Path):
    write_folder(tmp_path / "u", 30)
    memory = load_unlabeled_folder(tmp_path / "u", SIZE, 3)
    lazy = load_unlabeled_folder(tmp_path / "u", SIZE, 3, cache_mb=0, workers=2)
    (a, metrics_a), (b, metrics_b) = semifl_update(memory.images), semifl_update(lazy.images)
    assert metrics_a == metrics_b and metrics_a["pl_total"] == 30
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_file_broken_mid_training_is_skipped_counted_and_not_read_again(tmp_path: Path, decodes: list[Path]):
    paths = write_folder(tmp_path / "u", 20)
    lazy = load_unlabeled_folder(tmp_path / "u", SIZE, 3, cache_mb=0, workers=0)
    paths[7].write_bytes(b"overwritten after the folder was listed")  # e.g. a sync tool replacing the file
    tensors, metrics = semifl_update(lazy.images)
    assert all(torch.isfinite(t).all() for t in tensors.values())  # the round went on without it
    assert metrics["pl_total"] == 19 and metrics["pl_selected"] == 19
    assert [p for p, _ in lazy.images.skipped] == [str(paths[7])]
    assert "cannot identify image file" in lazy.images.skipped[0][1]
    assert readable(lazy.images).tolist() == [i != 7 for i in range(20)]
    assert decodes.count(paths[7]) == 1  # found in the pseudo-labelling pass, never decoded again

    # Later passes leave it out (a zero image in padded batches, a gap in kept ones) without decoding it.
    decodes.clear()
    semifl_update(lazy.images)
    assert paths[7] not in decodes and len(lazy.images.skipped) == 1
    ok, pixels = next(padded_image_batches(lazy.images, [torch.tensor([6, 7, 8])]))
    assert ok.tolist() == [True, False, True] and int(pixels[1].sum()) == 0
    kept, _ = next(image_batches(lazy.images[5:10], [torch.tensor([1, 2, 3])]))  # a view knows it too
    assert kept.tolist() == [1, 3]


def test_evaluation_leaves_an_unreadable_image_out(tmp_path: Path):
    write_folder(tmp_path / "l", 18, classes=3)
    lazy = load_labeled_folder(tmp_path / "l", SIZE, 3, cache_mb=0, workers=0)
    memory = load_labeled_folder(tmp_path / "l", SIZE, 3)
    lazy.images.paths[4].write_bytes(b"")
    model = SPEC.build().eval()
    scores = evaluate(model, lazy.images, lazy.labels, SPEC.mean, SPEC.std, CPU)
    keep = torch.arange(18) != 4
    expected = evaluate(model, memory.images[keep], memory.labels[keep], SPEC.mean, SPEC.std, CPU)
    assert scores == pytest.approx(expected)
    logits = predict_logits(model, lazy.images, SPEC.mean, SPEC.std, CPU)
    assert logits.shape == (18, 3) and logits[4].abs().sum() == 0  # documented: zero logits for it


def test_fedseal_fingerprint_of_files_follows_the_files(tmp_path: Path):
    paths = write_folder(tmp_path / "u", 6)
    files = load_unlabeled_folder(tmp_path / "u", SIZE, 3, cache_mb=0).images
    first = image_fingerprint(files)
    assert image_fingerprint(files) == first and image_fingerprint(files[1:]) != first
    Image.new("RGB", (20, 20), (1, 2, 3)).save(paths[2])  # rewritten: another size or time
    os.utime(paths[2], ns=(1, 1))
    assert image_fingerprint(files) != first


def test_dicom_files_are_checked_up_front_from_their_header(tmp_path: Path, decodes: list[Path]):
    pytest.importorskip("pydicom", reason="needs pydicom: pip install 'silokit[dicom]'")
    from tests.silo_core.test_dicom import unreadable_files

    expected = unreadable_files(tmp_path)
    memory = load_unlabeled_folder(tmp_path, 8, 1)
    decodes.clear()
    lazy = load_unlabeled_folder(tmp_path, 8, 1, cache_mb=0, workers=0)
    assert decodes == []
    # Every refusal the header shows, with the in-memory loader's reason; damaged pixel data shows when decoded.
    assert dict(lazy.skipped) == {p: r for p, r in memory.skipped if not p.endswith("truncated-pixels.dcm")}
    assert len(lazy) == len(memory) + 1 and set(expected) - {Path(p).name for p, _ in lazy.skipped} == {
        "truncated-pixels.dcm"}
    kept, pixels = next(image_batches(lazy.images, [torch.arange(len(lazy))]))
    assert torch.equal(pixels, memory.images)
    assert [Path(p).name for p, _ in lazy.images.skipped] == ["truncated-pixels.dcm"]


def test_whole_set_passes_take_fewer_big_images_at_a_time():
    from silo_core.training import pass_batch_size

    assert pass_batch_size(torch.zeros(3, 1, 28, 28), 500) == 500  # small images: as always
    assert pass_batch_size(torch.zeros(3, 3, 64, 64), 500) == 500
    assert pass_batch_size(torch.zeros(3, 3, 224, 224), 500) == 40  # 224 px RGB: 40 at a time, not 500
    assert pass_batch_size(torch.zeros(3, 3, 2048, 2048), 500) == 1


def test_counting_image_files_counts_what_listing_lists(tmp_path: Path):
    for rel in ("a.png", "sub/b.JPG", "sub/deeper/c.jpeg", ".hidden.png", ".cache/d.png", "notes.txt"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_bytes(b"")
    assert silo_core.data.count_image_files(tmp_path) == len(silo_core.data.list_image_files(tmp_path)) == 3
