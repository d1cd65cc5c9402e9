import gzip
import io
import os
import socket
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

import silo_core.data
from silo_core.data import (
    DataError,
    ImageSet,
    load_demo,
    load_image_file,
    load_labeled_folder,
    load_torchvision,
    load_unlabeled_folder,
    save_png_folder,
)

SHARED = Path("/work/shared/data")


def write_image(path: Path, value: int, size: tuple[int, int], mode: str = "L", fmt: str | None = None) -> None:
    """A constant image whose pixel value identifies it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    color = value if mode == "L" else (value, value, value)
    Image.new(mode, size, color).save(path, format=fmt)


def truncated_jpeg(path: Path) -> None:
    buf = io.BytesIO()
    rng = np.random.default_rng(0)
    Image.fromarray(rng.integers(0, 255, (64, 64, 3), dtype=np.uint8)).save(buf, format="JPEG", quality=90)
    path.write_bytes(buf.getvalue()[: len(buf.getvalue()) // 2])


@pytest.fixture
def mixed_folder(tmp_path: Path) -> Path:
    root = tmp_path / "silo"
    write_image(root / "a.png", 10, (20, 20))  # grayscale, smaller
    write_image(root / "b.JPG", 50, (40, 30), "RGB", "JPEG")  # RGB, non-square, upper-case extension
    write_image(root / "c.bmp", 90, (32, 32), "RGB")
    write_image(root / "sub" / "d.tiff", 130, (64, 64))  # nested
    write_image(root / "sub" / "deeper" / "e.jpeg", 170, (28, 28), "L", "JPEG")
    write_image(root / ".hidden.png", 1, (8, 8))  # hidden file: ignored
    write_image(root / ".cache" / "f.png", 2, (8, 8))  # hidden folder: ignored
    (root / "notes.txt").write_text("not an image")  # other extension: ignored
    (root / "corrupt.png").write_bytes(np.random.default_rng(1).bytes(500))
    truncated_jpeg(root / "truncated.jpg")
    return root


def test_unlabeled_folder_shapes_order_and_skips(mixed_folder: Path):
    data = load_unlabeled_folder(mixed_folder, 32, 3)
    assert data.images.shape == (5, 3, 32, 32) and data.images.dtype == torch.uint8
    assert data.labels is None and data.classes == []
    # sorted path order: a.png, b.JPG, c.bmp, sub/d.tiff, sub/deeper/e.jpeg (constant images keep their value)
    centres = data.images[:, 0, 16, 16].tolist()
    assert [abs(c - v) <= 2 for c, v in zip(centres, [10, 50, 90, 130, 170], strict=True)] == [True] * 5
    assert sorted(Path(p).name for p, _ in data.skipped) == ["corrupt.png", "truncated.jpg"]
    assert all(reason for _, reason in data.skipped)


@pytest.mark.timeout(30)  # before the fix the FIFO blocked the loader forever
@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs (POSIX)")
def test_only_regular_files_are_read(tmp_path: Path):
    root = tmp_path / "silo"
    write_image(root / "a.png", 10, (20, 20))
    write_image(root / "b.png", 50, (20, 20))
    os.mkfifo(root / "zz.png")  # nobody ever writes to it
    (root / "link.png").symlink_to(root / "a.png")  # a link to a regular file is followed
    (root / "fifo_link.png").symlink_to(root / "zz.png")  # a link to anything else is not
    (root / "zero.png").symlink_to("/dev/zero")  # a device that never ends
    (root / "dangling.png").symlink_to(root / "gone.png")
    write_image(root / "scans.png" / "c.png", 90, (20, 20))  # a folder named like an image is only a folder
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(str(root / "s.png"))
    try:
        data = load_unlabeled_folder(root, 16, 1)
    finally:
        sock.close()
    assert data.images[:, 0, 8, 8].tolist() == [10, 50, 10, 90]  # a, b, link, scans.png/c
    reasons = {Path(p).name: r for p, r in data.skipped}
    assert set(reasons) == {"zz.png", "fifo_link.png", "zero.png", "dangling.png", "s.png"}
    assert reasons["zz.png"] == reasons["fifo_link.png"] == "a FIFO, not a regular file; only regular files are read"
    assert reasons["zero.png"].startswith("a character device, not a regular file")
    assert reasons["s.png"].startswith("a socket, not a regular file")
    assert reasons["dangling.png"].startswith("FileNotFoundError")
    with pytest.raises(DataError, match=r"zz.png: a FIFO, not a regular file"):
        load_image_file(root / "zz.png", 16, 1)


@pytest.fixture
def pixel_limits(monkeypatch: pytest.MonkeyPatch) -> None:
    """Low limits so that small, fast images stand in for the 12,000-pixel-wide ones of the bug report: ours at
    1 MP, Pillow's bomb threshold at 5 MP (warning above it, error above 10 MP), as it is at 89 and 179 MP."""
    monkeypatch.setattr(silo_core.data.decoding, "MAX_IMAGE_PIXELS", 1_000_000)
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 5_000_000)


@pytest.mark.usefixtures("pixel_limits")
def test_big_jpegs_are_decoded_at_reduced_scale_and_other_big_images_skipped(tmp_path: Path, capfd):
    root = tmp_path / "silo"
    write_image(root / "small.png", 30, (64, 64))
    write_image(root / "warned.jpg", 120, (2400, 2400), "L", "JPEG")  # 5.8 MP: Pillow would warn
    write_image(root / "refused.jpg", 160, (3300, 3300), "RGB", "JPEG")  # 10.9 MP: Pillow would refuse
    write_image(root / "wide.png", 200, (2400, 2400))  # a PNG cannot be decoded at reduced scale
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        data = load_unlabeled_folder(root, 32, 1)
    # 2400/8 = 300 and 3300/8 = 413 pixels a side: only because draft() decoded them small are they under 1 MP
    assert [abs(v - want) <= 2 for v, want in zip(data.images[:, 0, 16, 16].tolist(), [160, 30, 120],
                                                  strict=True)] == [True] * 3  # refused.jpg, small.png, warned.jpg
    assert data.skipped == [(str(root / "wide.png"), "2400x2400 pixels exceeds the 1-megapixel limit")]
    assert not [w for w in caught if issubclass(w.category, Image.DecompressionBombWarning)]
    assert capfd.readouterr().err == ""
    with pytest.raises(DataError, match=r"wide.png: 2400x2400 pixels exceeds the 1-megapixel limit; replace"):
        load_image_file(root / "wide.png", 32, 1)


@pytest.mark.usefixtures("pixel_limits")
def test_a_jpeg_too_big_even_at_an_eighth_is_skipped(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(silo_core.data.decoding, "MAX_IMAGE_PIXELS", 50_000)
    write_image(tmp_path / "huge.jpg", 120, (2400, 2400), "L", "JPEG")
    with pytest.raises(DataError, match=r"2400x2400 pixels exceeds the 0.05-megapixel limit even when decoded "
                                        r"at 300x300"):
        load_image_file(tmp_path / "huge.jpg", 32, 1)


def test_grayscale_output_and_rgb_to_luma(tmp_path: Path):
    write_image(tmp_path / "red.png", 0, (28, 28), "RGB")
    Image.new("RGB", (28, 28), (255, 0, 0)).save(tmp_path / "red.png")
    x = load_image_file(tmp_path / "red.png", 28, 1)
    assert x.shape == (1, 28, 28)
    assert int(x[0, 0, 0]) == 76  # ITU-R 601 luma of pure red: 255 * 0.299
    rgb = load_image_file(tmp_path / "red.png", 28, 3)
    assert rgb[:, 5, 5].tolist() == [255, 0, 0]


def test_same_size_is_not_resampled_and_resize_is_applied(tmp_path: Path):
    arr = np.random.default_rng(2).integers(0, 256, (16, 16), dtype=np.uint8)
    Image.fromarray(arr).save(tmp_path / "x.png")
    assert np.array_equal(load_image_file(tmp_path / "x.png", 16, 1)[0].numpy(), arr)
    assert load_image_file(tmp_path / "x.png", 9, 3).shape == (3, 9, 9)


def test_16_bit_images_are_scaled_not_clipped(tmp_path: Path):
    arr = np.full((12, 12), 65535, dtype=np.uint16)
    arr[:, :6] = 257 * 100
    Image.fromarray(arr).save(tmp_path / "deep.png")
    x = load_image_file(tmp_path / "deep.png", 12, 1)
    assert int(x[0, 0, 0]) == 100 and int(x[0, 0, 11]) == 255


def test_a_stored_value_decodes_the_same_whatever_else_its_image_holds(tmp_path: Path):
    # The scale follows the mode, not the pixels: 32-bit integer and float TIFFs of one export once decoded a value
    # on scales 257 times apart depending on the image's maximum (200 -> 200 or 1; 0.5 -> 128 or 0).
    dark, bright = np.full((8, 8), 200, dtype=np.int32), np.full((8, 8), 200, dtype=np.int32)  # 16-bit values
    bright[0, 0] = 65535
    faint, hot = np.full((8, 8), 0.5, dtype=np.float32), np.full((8, 8), 0.5, dtype=np.float32)
    hot[0, 0] = 1.5
    for name, arr in {"dark": dark, "bright": bright, "faint": faint, "hot": hot}.items():
        Image.fromarray(arr).save(tmp_path / f"{name}.tif")
    assert Image.open(tmp_path / "dark.tif").mode == "I" and Image.open(tmp_path / "faint.tif").mode == "F"
    decoded = {n: load_image_file(tmp_path / f"{n}.tif", 8, 1)[0] for n in ("dark", "bright", "faint", "hot")}
    assert {n: (int(x[0, 0]), int(x[4, 4])) for n, x in decoded.items()} == {
        "dark": (1, 1), "bright": (255, 1), "faint": (128, 128), "hot": (255, 128)}


def test_load_image_file_errors_name_the_file(tmp_path: Path):
    bad = tmp_path / "bad.png"
    bad.write_bytes(b"\x89PNG not really")
    with pytest.raises(DataError, match="bad.png"):
        load_image_file(bad, 28, 1)


def test_missing_empty_and_unusable_folders(tmp_path: Path):
    with pytest.raises(DataError, match=r"nope.*does not exist"):
        load_unlabeled_folder(tmp_path / "nope", 28, 1)
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "readme.txt").write_text("x")
    with pytest.raises(DataError, match=r"no images found in .*empty"):
        load_unlabeled_folder(tmp_path / "empty", 28, 1)
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "x.png").write_bytes(b"garbage")
    with pytest.raises(DataError, match=r"none of the 1 image files"):
        load_unlabeled_folder(tmp_path / "bad", 28, 1)
    with pytest.raises(DataError, match="does not exist"):
        load_labeled_folder(tmp_path / "nope", 28, 1)
    with pytest.raises(ValueError, match="channels"):
        load_unlabeled_folder(tmp_path / "empty", 28, 2)


def test_labeled_folder_class_order_labels_and_skips(tmp_path: Path):
    root = tmp_path / "hub"
    write_image(root / "dog" / "1.png", 200, (28, 28))
    write_image(root / "dog" / "2.png", 201, (28, 28))
    write_image(root / "cat" / "x" / "1.png", 100, (40, 40), "RGB")
    write_image(root / "zebra" / "1.jpg", 50, (28, 28), "L", "JPEG")
    (root / "empty_class").mkdir()
    write_image(root / "loose.png", 0, (28, 28))
    write_image(root / ".trash" / "t.png", 0, (28, 28))
    (root / "dog" / "3.png").write_bytes(b"broken")
    data = load_labeled_folder(root, 28, 1)
    assert data.classes == ["cat", "dog", "empty_class", "zebra"]
    assert data.labels.dtype == torch.int64
    assert data.labels.tolist() == [0, 1, 1, 3]
    assert data.images[:, 0, 14, 14].tolist()[:3] == [100, 200, 201]
    reasons = {Path(p).name: r for p, r in data.skipped}
    assert set(reasons) == {"loose.png", "3.png"} and "class sub-folder" in reasons["loose.png"]


def test_labeled_folder_needs_class_folders(tmp_path: Path):
    write_image(tmp_path / "flat" / "1.png", 0, (28, 28))
    with pytest.raises(DataError, match="no class sub-folders.*unlabeled layout"):
        load_labeled_folder(tmp_path / "flat", 28, 1)
    (tmp_path / "classes" / "a").mkdir(parents=True)
    with pytest.raises(DataError, match="no images found in the class folders"):
        load_labeled_folder(tmp_path / "classes", 28, 1)


def test_subset_keeps_images_and_labels_together():
    data = ImageSet(torch.arange(5, dtype=torch.uint8).view(5, 1, 1, 1).expand(5, 1, 2, 2).clone(),
                    torch.tensor([0, 1, 0, 1, 1]), ["a", "b"], [("x", "bad")])
    sub = data.subset(np.array([4, 0]))
    assert len(sub) == 2 and sub.images[:, 0, 0, 0].tolist() == [4, 0] and sub.labels.tolist() == [1, 0]
    assert sub.classes == ["a", "b"] and sub.skipped == [("x", "bad")]
    assert data.subset(torch.tensor([True, False, False, False, True])).labels.tolist() == [0, 1]
    assert len(data.subset([])) == 0


def test_save_png_folder_round_trips(tmp_path: Path):
    demo = load_demo("test")
    some = demo.subset(np.arange(0, 2000, 150))  # 14 images, more than 10 so file names need zero padding
    paths = save_png_folder(some, tmp_path / "unl", labeled=False)
    assert [p.name for p in paths[:2]] == ["00.png", "01.png"] and len(paths) == 14
    back = load_unlabeled_folder(tmp_path / "unl", 28, 1)
    assert torch.equal(back.images, some.images)

    save_png_folder(some, tmp_path / "lab", labeled=True)
    back = load_labeled_folder(tmp_path / "lab", 28, 1)
    assert back.classes[0] == "0_T-shirt_top" and len(back.classes) == 10  # every class gets a folder
    assert torch.equal(back.labels, some.labels[torch.argsort(some.labels, stable=True)])
    assert torch.equal(back.images, some.images[torch.argsort(some.labels, stable=True)])

    with pytest.raises(DataError, match="already holds images"):
        save_png_folder(some, tmp_path / "unl", labeled=False)


def test_demo_data_is_stratified():
    train, test = load_demo("train"), load_demo("test")
    assert train.images.shape == (6000, 1, 28, 28) and train.images.dtype == torch.uint8
    assert test.images.shape == (2000, 1, 28, 28)
    assert torch.bincount(train.labels).tolist() == [600] * 10
    assert torch.bincount(test.labels).tolist() == [200] * 10
    assert train.classes[0] == "T-shirt/top" and train.classes[9] == "Ankle boot" and len(train.classes) == 10
    assert 0.2 < train.images.float().mean().item() / 255 < 0.4  # real clothing images, not blanks
    with pytest.raises(ValueError, match="train"):
        load_demo("val")


def write_idx(path: Path, arr: np.ndarray, compress: bool) -> None:
    header = bytes([0, 0, 8, arr.ndim]) + b"".join(int(d).to_bytes(4, "big") for d in arr.shape)
    data = header + arr.astype(np.uint8).tobytes()
    path.parent.mkdir(parents=True, exist_ok=True)
    if compress:
        with gzip.open(str(path) + ".gz", "wb") as fh:
            fh.write(data)
    else:
        path.write_bytes(data)


@pytest.mark.parametrize("compress", [False, True])
def test_torchvision_mnist_layout_plain_and_gzipped(tmp_path: Path, compress: bool):
    images = np.random.default_rng(3).integers(0, 256, (7, 28, 28), dtype=np.uint8)
    labels = np.array([3, 1, 4, 1, 5, 9, 2], dtype=np.uint8)
    write_idx(tmp_path / "MNIST" / "raw" / "t10k-images-idx3-ubyte", images, compress)
    write_idx(tmp_path / "MNIST" / "raw" / "t10k-labels-idx1-ubyte", labels, compress)
    data = load_torchvision("MNIST", tmp_path, train=False, image_size=28, channels=1)
    assert torch.equal(data.images[:, 0], torch.from_numpy(images)) and data.labels.tolist() == labels.tolist()
    rgb = load_torchvision("mnist", tmp_path, train=False, image_size=32, channels=3)
    assert rgb.images.shape == (7, 3, 32, 32) and torch.equal(rgb.images[:, 0], rgb.images[:, 2])
    with pytest.raises(DataError, match=r"put train-images-idx3-ubyte\(.gz\).*MNIST/raw"):
        load_torchvision("MNIST", tmp_path, train=True, image_size=28, channels=1)


def test_torchvision_errors(tmp_path: Path):
    with pytest.raises(DataError, match=r"missing.*does not exist"):
        load_torchvision("FashionMNIST", tmp_path / "missing", True, 28, 1)
    with pytest.raises(DataError, match="FashionMNIST/raw"):
        load_torchvision("FashionMNIST", tmp_path, True, 28, 1)
    with pytest.raises(DataError, match="cifar-10-batches-py"):
        load_torchvision("CIFAR10", tmp_path, True, 32, 3)
    with pytest.raises(DataError, match="unknown dataset 'ImageNet'"):
        load_torchvision("ImageNet", tmp_path, True, 32, 3)
    raw = tmp_path / "broken" / "MNIST" / "raw"
    write_idx(raw / "t10k-labels-idx1-ubyte", np.zeros(5, dtype=np.uint8), False)
    (raw / "t10k-images-idx3-ubyte").write_bytes(bytes([0, 0, 8, 3]) + (10).to_bytes(4, "big") * 3 + b"\0" * 9)
    with pytest.raises(DataError, match="truncated or corrupt"):
        load_torchvision("MNIST", tmp_path / "broken", False, 28, 1)


@pytest.mark.skipif(not (SHARED / "FashionMNIST" / "raw").is_dir(), reason="shared Fashion-MNIST files absent")
def test_torchvision_fashion_mnist_from_shared_folder():
    data = load_torchvision("FashionMNIST", SHARED, train=False, image_size=28, channels=1)
    assert data.images.shape == (10000, 1, 28, 28)
    assert torch.bincount(data.labels).tolist() == [1000] * 10
    assert data.labels[0].item() == 9 and data.classes[9] == "Ankle boot"  # the official first test image
    demo = load_demo("test")
    # the demo set's test images are a subset of the official test set
    first = demo.images[0]
    assert bool((data.images == first).flatten(1).all(1).any())
