"""Image data: folders of image files, torchvision's on-disk datasets, and the bundled demo set.

Everything becomes an ``ImageSet``: a uint8 N x C x H x W tensor at the model's size and channel count, plus
labels and class names. Files that cannot be decoded are skipped and listed, because one bad file in a silo's
folder of thousands must not stop a federation; so are files that are not regular files (a FIFO or device named
like an image) and images over ``MAX_IMAGE_PIXELS`` that cannot be read at reduced scale. Nothing here downloads,
unpickles or trusts file contents beyond decoding pixels (torchvision's CIFAR10/SVHN readers are used only after
their md5 checks pass).
"""

from __future__ import annotations

import gzip
import importlib.resources
import os
import re
import stat
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image, ImageFile, ImageOps, UnidentifiedImageError

from silo_core.dicom import DicomError, read_dicom

IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".bmp", ".tif", ".tiff", ".dcm")  # .dcm: silo_core/dicom.py

# The most pixels one image may be decoded at. 64 megapixels (8000 x 8000) is above what scanners and radiology
# devices write (a mammogram is about 20), while the models train at a few hundred pixels a side at most, so a
# bigger image only costs memory: 192 MB as RGB, and 16-bit images pass through a 512 MB float64 copy in
# _to_8bit. It is also below Pillow's own decompression-bomb threshold (about 89 MP), which this loader replaces
# (see _identify). JPEGs over it (big camera photos) are still read, decoded at 1/2 to 1/8 scale (Image.draft);
# other formats over it, and JPEGs still over it at 1/8 scale, are skipped with the reason.
MAX_IMAGE_PIXELS = 64_000_000
DEMO_FILE = "fashion_mnist_demo.npz"

FASHION_MNIST_CLASSES = [
    "T-shirt/top", "Trouser", "Pullover", "Dress", "Coat", "Sandal", "Shirt", "Sneaker", "Bag", "Ankle boot",
]
MNIST_CLASSES = ["0 - zero", "1 - one", "2 - two", "3 - three", "4 - four",
                 "5 - five", "6 - six", "7 - seven", "8 - eight", "9 - nine"]
TORCHVISION_DATASETS = ("FashionMNIST", "MNIST", "CIFAR10", "SVHN")


class DataError(Exception):
    """A data problem the user can fix; the message names the path and what to do."""


@dataclass
class ImageSet:
    images: torch.Tensor  # uint8, N x C x H x W
    labels: torch.Tensor | None  # int64 [N], None for unlabeled data
    classes: list[str]  # class names, index = label; [] for unlabeled data
    skipped: list[tuple[str, str]] = field(default_factory=list)  # (path, reason) of files that were skipped

    def __post_init__(self) -> None:
        if self.images.dtype != torch.uint8 or self.images.ndim != 4:
            raise ValueError(f"ImageSet.images must be uint8 N x C x H x W, got {self.images.dtype} "
                             f"{tuple(self.images.shape)}")
        if self.labels is not None and tuple(self.labels.shape) != (len(self.images),):
            raise ValueError(f"ImageSet.labels must have shape [{len(self.images)}], got {tuple(self.labels.shape)}")

    def __len__(self) -> int:
        return int(self.images.shape[0])

    def subset(self, idx: Sequence[int] | np.ndarray | torch.Tensor) -> ImageSet:
        """The images at ``idx`` (integer indices in the given order, or a boolean mask)."""
        if isinstance(idx, torch.Tensor):
            index = idx if idx.dtype == torch.bool else idx.long()
        else:
            arr = np.asarray(idx)
            index = torch.from_numpy(arr) if arr.dtype == np.bool_ else torch.as_tensor(arr.astype(np.int64))
        labels = self.labels[index] if self.labels is not None else None
        return ImageSet(self.images[index], labels, list(self.classes), list(self.skipped))


def _check_format(image_size: int, channels: int) -> None:
    if channels not in (1, 3):
        raise ValueError(f"channels must be 1 (grayscale) or 3 (RGB), got {channels}")
    if image_size < 1:
        raise ValueError(f"image_size must be positive, got {image_size}")


# --- single files --------------------------------------------------------------------------------------------


class _Refused(Exception):
    """A file the loader will not read; the message is the whole reason shown in the skipped list."""


def _reason(exc: Exception) -> str:
    return str(exc) if isinstance(exc, _Refused) else f"{type(exc).__name__}: {exc}"


_FILE_KINDS = {stat.S_IFIFO: "a FIFO", stat.S_IFCHR: "a character device", stat.S_IFBLK: "a block device",
               stat.S_IFSOCK: "a socket", stat.S_IFDIR: "a folder"}


def _require_regular(st_mode: int) -> None:
    if not stat.S_ISREG(st_mode):
        kind = _FILE_KINDS.get(stat.S_IFMT(st_mode), "a special file")
        raise _Refused(f"{kind}, not a regular file; only regular files are read")


def _open_regular_file(path: Path) -> BinaryIO:
    """``path`` opened for reading if it is a regular file; anything else is refused before a byte is read.

    A FIFO named like an image would block the loader forever, a device can stream without end, and a socket or
    folder holds no image. A symlink is followed only when it points to a regular file (os.stat follows links), so
    a silo may link images in from elsewhere on its disk. The check before opening keeps special files from ever
    being opened (opening some devices has side effects); the check on the open descriptor catches a file swapped
    in between, and O_NONBLOCK keeps that open from waiting for a swapped-in FIFO's writer.
    """
    _require_regular(os.stat(path).st_mode)
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_BINARY", 0))
    try:
        _require_regular(os.fstat(fd).st_mode)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def _identify(fh: BinaryIO, path: Path) -> ImageFile.ImageFile:
    """The image in ``fh``, identified from its header: the size is known, no pixel is decoded yet.

    This is Image.open's search over the registered formats without its decompression-bomb check, which runs on
    the same header before our code sees the size: above Image.MAX_IMAGE_PIXELS it prints a raw warning to stderr,
    above twice that it refuses the file, a huge JPEG that draft() would read at 1/8 scale included. _decode
    enforces MAX_IMAGE_PIXELS instead. Pillow's check cannot be switched off for one call: Image.MAX_IMAGE_PIXELS
    and warnings.catch_warnings are both process-wide, so changing either would change it for other threads too.
    """
    Image.init()  # registers every format plugin, as Image.open does when the extension's plugin does not match
    prefix = fh.read(16)
    # Our formats first, as Image.open tries the extension's and the common plugins first: some plugins accept
    # any header and only fail later, so they must not get a PNG before the PNG plugin does.
    for fmt in dict.fromkeys(("PNG", "JPEG", "BMP", "TIFF", *Image.ID)):
        factory, accept = Image.OPEN[fmt]
        result = not accept or accept(prefix)
        if not result or isinstance(result, str):  # a string explains why the format does not apply
            continue
        fh.seek(0)
        try:
            return factory(fh, str(path))
        except (SyntaxError, IndexError, TypeError, struct.error):
            continue  # not this format after all: Image.open's rule too
    raise UnidentifiedImageError(f"cannot identify image file {str(path)!r}")


def _open_image(fh: BinaryIO, path: Path) -> Image.Image:
    """The image in ``fh``: a .dcm file read by silo_core.dicom (8-bit, first frame, size checked before its pixels
    are read; the reason for a refusal is a fixed text, never a header value), any other file identified."""
    if path.suffix.lower() != ".dcm":
        return _identify(fh, path)
    try:
        return read_dicom(fh, MAX_IMAGE_PIXELS)
    except DicomError as exc:
        raise _Refused(str(exc)) from None


def _to_8bit(img: Image.Image) -> Image.Image:
    """16-bit and float images (common in medical data) scaled to 8 bits; plain convert("L") would clip them."""
    arr = np.asarray(img, dtype=np.float64)
    if img.mode.startswith("I;16") or (img.mode == "I" and arr.size and arr.max() > 255):
        arr = arr / 257.0  # 0..65535 -> 0..255
    elif img.mode == "F" and arr.size and arr.max() <= 1.0:
        arr = arr * 255.0  # float images in [0, 1]
    return Image.fromarray(np.clip(np.rint(arr), 0, 255).astype(np.uint8))


def _decode(path: Path, image_size: int, channels: int) -> np.ndarray:
    mode = "L" if channels == 1 else "RGB"
    with _open_regular_file(path) as fh, _open_image(fh, path) as img:
        width, height = img.size
        img.draft(mode, (image_size, image_size))  # JPEG only: decode big photos at reduced scale, much faster
        if img.size[0] * img.size[1] > MAX_IMAGE_PIXELS:  # checked on the header, before any pixel is decoded
            reduced = f" even when decoded at {img.size[0]}x{img.size[1]}" if img.size != (width, height) else ""
            raise _Refused(f"{width}x{height} pixels exceeds the {MAX_IMAGE_PIXELS / 1e6:g}-megapixel limit{reduced}")
        img.load()
        img = ImageOps.exif_transpose(img)  # camera photos store their orientation in EXIF
        if img.mode in ("I", "F") or img.mode.startswith("I;16"):
            img = _to_8bit(img)
        if img.mode == "P" and "transparency" in img.info:
            img = img.convert("RGBA")  # avoids Pillow's palette-transparency warning
        if img.mode != mode:
            img = img.convert(mode)
        if img.size != (image_size, image_size):
            img = img.resize((image_size, image_size), Image.Resampling.BILINEAR)
        arr = np.array(img, dtype=np.uint8)  # a writable copy (Pillow arrays are read-only)
    return arr[None] if arr.ndim == 2 else arr.transpose(2, 0, 1)


def load_image_file(path: str | os.PathLike[str], image_size: int, channels: int) -> torch.Tensor:
    """One image file as uint8 C x H x W, converted to ``channels`` and resized to ``image_size``."""
    _check_format(image_size, channels)
    try:
        arr = _decode(Path(path), image_size, channels)
    except Exception as exc:  # Pillow raises many types on bad files (OSError, ValueError, SyntaxError, ...)
        raise DataError(f"cannot read image {path}: {_reason(exc)}; replace or delete the file") from exc
    return torch.from_numpy(np.ascontiguousarray(arr))


# --- folders -------------------------------------------------------------------------------------------------


def _check_folder(root: str | os.PathLike[str], what: str) -> Path:
    path = Path(root)
    if not path.exists():
        raise DataError(f"{what} folder {path} does not exist; check the path or create it and put the images there")
    if not path.is_dir():
        raise DataError(f"{what} path {path} is not a folder; pass the folder that holds the images")
    return path


def _is_image(name: str) -> bool:
    return not name.startswith(".") and name.lower().endswith(IMAGE_EXTENSIONS)


def list_image_files(root: str | os.PathLike[str]) -> list[Path]:
    """Image files under ``root``, recursively, hidden files and folders ignored, in sorted path order."""
    root = Path(root)
    found: list[Path] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if not d.startswith(".")]
        found.extend(Path(dirpath) / f for f in filenames if _is_image(f))
    return sorted(found, key=lambda p: p.relative_to(root).parts)


def _load_files(paths: list[Path], image_size: int, channels: int) -> tuple[list[np.ndarray], list[int], list]:
    """Decode ``paths``; returns the arrays, the positions in ``paths`` that worked, and the skipped ones."""
    arrays: list[np.ndarray] = []
    ok: list[int] = []
    skipped: list[tuple[str, str]] = []
    for i, path in enumerate(paths):
        try:
            arrays.append(_decode(path, image_size, channels))
            ok.append(i)
        except Exception as exc:  # a bad file is skipped and reported, never fatal on its own
            skipped.append((str(path), _reason(exc)))
    return arrays, ok, skipped


def _stack(arrays: list[np.ndarray], image_size: int, channels: int) -> torch.Tensor:
    if not arrays:
        return torch.zeros((0, channels, image_size, image_size), dtype=torch.uint8)
    return torch.from_numpy(np.stack(arrays))


def _nothing_usable(root: Path, skipped: list[tuple[str, str]]) -> DataError:
    path, reason = skipped[0]
    return DataError(f"none of the {len(skipped)} image files under {root} could be read (e.g. {path}: {reason}); "
                     f"check that they are valid {'/'.join(IMAGE_EXTENSIONS)} images")


def load_unlabeled_folder(root: str | os.PathLike[str], image_size: int, channels: int) -> ImageSet:
    """All images under ``root`` (recursively), e.g. a silo's local data."""
    _check_format(image_size, channels)
    folder = _check_folder(root, "image")
    paths = list_image_files(folder)
    if not paths:
        raise DataError(f"no images found in {folder} (looked recursively for {', '.join(IMAGE_EXTENSIONS)}); "
                        f"put the image files there or point to the right folder")
    arrays, _, skipped = _load_files(paths, image_size, channels)
    if not arrays:
        raise _nothing_usable(folder, skipped)
    return ImageSet(_stack(arrays, image_size, channels), None, [], skipped)


def load_labeled_folder(root: str | os.PathLike[str], image_size: int, channels: int) -> ImageSet:
    """ImageFolder layout: ``root/<class>/**/<image>``; sorted class-folder names give the label order.

    A class folder may be empty (a site need not hold every class; the label space stays the same everywhere).
    Images directly under ``root`` belong to no class: they are listed in ``skipped``.
    """
    _check_format(image_size, channels)
    folder = _check_folder(root, "labeled image")
    class_dirs = sorted((d for d in folder.iterdir() if d.is_dir() and not d.name.startswith(".")),
                        key=lambda d: d.name)
    loose = [f for f in sorted(folder.iterdir()) if f.is_file() and _is_image(f.name)]
    if not class_dirs:
        hint = " (it holds images directly: that is the unlabeled layout)" if loose else ""
        raise DataError(f"labeled folder {folder} has no class sub-folders{hint}; put each class's images in "
                        f"its own sub-folder, e.g. {folder}/cat/1.png and {folder}/dog/2.png")
    skipped: list[tuple[str, str]] = [(str(f), "not inside a class sub-folder; ignored") for f in loose]
    arrays: list[np.ndarray] = []
    labels: list[int] = []
    num_files = 0
    for label, class_dir in enumerate(class_dirs):
        paths = list_image_files(class_dir)
        num_files += len(paths)
        class_arrays, _, class_skipped = _load_files(paths, image_size, channels)
        arrays.extend(class_arrays)
        labels.extend([label] * len(class_arrays))
        skipped.extend(class_skipped)
    if num_files == 0:
        raise DataError(f"no images found in the class folders under {folder} (looked for "
                        f"{', '.join(IMAGE_EXTENSIONS)}); put each class's images in its sub-folder")
    if not arrays:
        raise _nothing_usable(folder, [s for s in skipped if not s[1].startswith("not inside")])
    return ImageSet(_stack(arrays, image_size, channels), torch.tensor(labels, dtype=torch.int64),
                    [d.name for d in class_dirs], skipped)


# --- in-memory arrays (torchvision datasets, demo data) ------------------------------------------------------


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
    _check_format(image_size, channels)
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


# --- writing -------------------------------------------------------------------------------------------------


def class_folder_name(index: int, name: str, num_classes: int) -> str:
    """``03_Dress``: the zero-padded index keeps sorted folder order equal to label order when reloaded, and
    characters that are unsafe in paths (e.g. the "/" in "T-shirt/top") become "_"."""
    safe = re.sub(r"[^\w.\- ]", "_", name).strip(". ") or "class"
    return f"{index:0{len(str(max(num_classes - 1, 0)))}d}_{safe}"


def save_png_folder(images: ImageSet, root: str | os.PathLike[str], labeled: bool) -> list[Path]:
    """Write ``images`` as PNG files: labeled -> ``root/<NN_class>/<i>.png``, unlabeled -> ``root/<i>.png``.

    ``i`` is the zero-padded index in ``images``, so loading the folder back gives the same order (and, for
    labeled sets, the same labels: every class gets a folder, named by ``class_folder_name``).
    Returns the written paths in index order. Refuses a folder that already holds images, so files from an
    earlier run can never mix in.
    """
    folder = Path(root)
    if folder.is_dir() and list_image_files(folder):
        raise DataError(f"{folder} already holds images; choose a new or empty folder (or delete it first)")
    n, c = len(images), int(images.images.shape[1])
    if c not in (1, 3):
        raise DataError(f"can only write 1- or 3-channel images as PNG, got {c} channels")
    width = len(str(max(n - 1, 0)))
    if labeled:
        if images.labels is None or not images.classes:
            raise DataError(f"cannot write a labeled folder at {folder}: the image set has no labels/classes")
        dirs = [folder / class_folder_name(k, name, len(images.classes)) for k, name in enumerate(images.classes)]
        for d in dirs:
            d.mkdir(parents=True, exist_ok=True)
        targets = [dirs[int(y)] / f"{i:0{width}d}.png" for i, y in enumerate(images.labels.tolist())]
    else:
        folder.mkdir(parents=True, exist_ok=True)
        targets = [folder / f"{i:0{width}d}.png" for i in range(n)]
    pixels = images.images.permute(0, 2, 3, 1).numpy()
    for arr, path in zip(pixels, targets, strict=True):
        # compress_level=1: these files are scratch copies for the simulator; speed beats size.
        Image.fromarray(arr[:, :, 0] if c == 1 else np.ascontiguousarray(arr)).save(path, compress_level=1)
    return targets
