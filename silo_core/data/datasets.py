"""Data sets held as arrays: torchvision's on-disk sets (Fashion-MNIST, MNIST read from their IDX files;
CIFAR-10 and SVHN through torchvision after its md5 checks) and the bundled Fashion-MNIST demo subset. Nothing here
downloads."""

from __future__ import annotations

import gzip
import importlib.resources
import os
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from silo_core.data.decoding import DataError, check_format
from silo_core.data.imageset import ImageSet

DEMO_FILE = "fashion_mnist_demo.npz"

FASHION_MNIST_CLASSES = [
    "T-shirt/top", "Trouser", "Pullover", "Dress", "Coat", "Sandal", "Shirt", "Sneaker", "Bag", "Ankle boot",
]
MNIST_CLASSES = ["0 - zero", "1 - one", "2 - two", "3 - three", "4 - four",
                 "5 - five", "6 - six", "7 - seven", "8 - eight", "9 - nine"]
TORCHVISION_DATASETS = ("FashionMNIST", "MNIST", "CIFAR10", "SVHN")


def _convert_batch(images: np.ndarray, image_size: int, channels: int, channels_last: bool) -> torch.Tensor:
    """uint8 N x H x W, N x H x W x C or N x C x H x W -> N x channels x image_size x image_size."""
    x = torch.from_numpy(np.ascontiguousarray(images))
    if x.ndim == 3:
        x = x[:, None]
    elif channels_last:
        x = x.permute(0, 3, 1, 2)
    if x.shape[1] == 3 and channels == 1:
        # Pillow's "L" conversion (ITU-R 601-2 luma, integer arithmetic) so folders and arrays agree.
        r, g, b = (x[:, i].to(torch.int32) for i in range(3))
        x = ((r * 19595 + g * 38470 + b * 7471 + 0x8000) >> 16).to(torch.uint8)[:, None]
    elif x.shape[1] == 1 and channels == 3:
        x = x.expand(-1, 3, -1, -1)
    if x.shape[-2:] != (image_size, image_size):
        chunks = []
        for start in range(0, len(x), 4096):  # bounded float memory for big datasets
            chunk = F.interpolate(x[start : start + 4096].float(), size=(image_size, image_size),
                                  mode="bilinear", antialias=True, align_corners=False)
            chunks.append(chunk.round_().clamp_(0, 255).to(torch.uint8))
        x = torch.cat(chunks) if chunks else x.new_zeros((0, channels, image_size, image_size))
    return x.contiguous()


def _read_idx(path: Path) -> np.ndarray:
    """An IDX file (MNIST format: big-endian header, uint8 data), plain or gzipped."""
    gz = path.with_name(path.name + ".gz")
    if path.exists():
        data = path.read_bytes()
    elif gz.exists():
        with gzip.open(gz, "rb") as fh:
            data = fh.read()
    else:
        raise FileNotFoundError(path)
    if len(data) < 4 or data[0] != 0 or data[1] != 0 or data[2] != 0x08:
        raise DataError(f"{path} is not an unsigned-byte IDX file; replace it with the official file")
    ndim = data[3]
    dims = [int.from_bytes(data[4 + 4 * i : 8 + 4 * i], "big") for i in range(ndim)]
    offset = 4 + 4 * ndim
    if len(data) - offset != int(np.prod(dims)):
        raise DataError(f"{path} is truncated or corrupt ({len(data) - offset} bytes of data for shape {dims}); "
                        f"replace it with the official file")
    return np.frombuffer(data, dtype=np.uint8, offset=offset).reshape(dims).copy()  # writable for torch


def _load_mnist_like(name: str, root: Path, train: bool) -> tuple[np.ndarray, np.ndarray]:
    raw = root / name / "raw"
    prefix = "train" if train else "t10k"
    files = [raw / f"{prefix}-images-idx3-ubyte", raw / f"{prefix}-labels-idx1-ubyte"]
    try:
        images, labels = (_read_idx(f) for f in files)
    except FileNotFoundError:
        raise DataError(f"{name} files not found: put {files[0].name}(.gz) and {files[1].name}(.gz) under "
                        f"{raw} (torchvision's layout; silokit never downloads)") from None
    if len(images) != len(labels):
        raise DataError(f"{raw}: {len(images)} images but {len(labels)} labels; replace the files with the official ones")
    return images, labels


def load_torchvision(name: str, root: str | os.PathLike[str], train: bool, image_size: int,
                     channels: int) -> ImageSet:
    """A torchvision dataset already on disk under ``root`` (torchvision's layout); never downloads."""
    check_format(image_size, channels)
    canonical = {n.lower(): n for n in TORCHVISION_DATASETS}.get(str(name).lower())
    if canonical is None:
        raise DataError(f"unknown dataset {name!r}; choose one of {', '.join(TORCHVISION_DATASETS)}")
    base = Path(root)
    if not base.is_dir():
        raise DataError(f"dataset root {base} does not exist; create it and put the {canonical} files under it "
                        f"(e.g. {base / canonical / 'raw'} for MNIST-style sets)")
    if canonical in ("FashionMNIST", "MNIST"):
        images, labels = _load_mnist_like(canonical, base, train)
        classes = FASHION_MNIST_CLASSES if canonical == "FashionMNIST" else MNIST_CLASSES
        x = _convert_batch(images, image_size, channels, channels_last=False)
    else:
        import torchvision.datasets as tvd  # imported here: slow to import and only needed for these sets

        try:
            if canonical == "CIFAR10":
                ds = tvd.CIFAR10(str(base), train=train, download=False)  # md5-checks every file before reading
                images, labels, classes = ds.data, np.asarray(ds.targets), list(ds.classes)
                x = _convert_batch(images, image_size, channels, channels_last=True)
            else:
                ds = tvd.SVHN(str(base), split="train" if train else "test", download=False)
                images, labels, classes = ds.data, np.asarray(ds.labels), [str(i) for i in range(10)]
                x = _convert_batch(images, image_size, channels, channels_last=False)
        except (RuntimeError, OSError) as exc:
            where = (f"extract cifar-10-python.tar.gz so that {base / 'cifar-10-batches-py'} exists"
                     if canonical == "CIFAR10" else
                     f"put {'train' if train else 'test'}_32x32.mat directly under {base}")
            raise DataError(f"{canonical} not found or corrupt under {base} ({exc}); {where} "
                            f"(torchvision's layout; silokit never downloads)") from exc
        except ImportError as exc:
            raise DataError(f"reading {canonical} needs scipy ({exc}); install it with pip install scipy") from exc
    return ImageSet(x, torch.from_numpy(labels.astype(np.int64)), list(classes), [])


def load_demo(split: str) -> ImageSet:
    """The bundled Fashion-MNIST subset: "train" (600 per class) or "test" (200 per class), 1 x 28 x 28."""
    if split not in ("train", "test"):
        raise ValueError(f"demo split must be 'train' or 'test', got {split!r}")
    resource = importlib.resources.files("silo_core").joinpath("demo_data", DEMO_FILE)
    try:
        with importlib.resources.as_file(resource) as path, np.load(path, allow_pickle=False) as npz:
            images, labels = npz[f"{split}_images"], npz[f"{split}_labels"]
            classes = [str(c) for c in npz["classes"]]
    except FileNotFoundError:
        raise DataError(f"the bundled demo data ({resource}) is missing; reinstall silokit or run "
                        f"tools/make_demo_data.py") from None
    x = torch.from_numpy(np.ascontiguousarray(images))[:, None]
    return ImageSet(x, torch.from_numpy(labels.astype(np.int64)), classes, [])

