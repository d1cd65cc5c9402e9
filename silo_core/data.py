"""Image data: folders of image files, torchvision's on-disk datasets, and the bundled demo set.

Everything becomes an ``ImageSet``: N images at the model's size and channel count, plus labels and class names.
The images are a uint8 N x C x H x W tensor when their decoded pixels fit in ``cache_mb`` (small images: the demo,
Fashion-MNIST-style sets, every in-memory dataset), otherwise an ``ImageFiles``: the paths, decoded batch by batch
through a DataLoader as training asks for them (``image_batches``), so memory does not grow with the folder.
Algorithms read pixels only through ``image_batches`` / ``padded_image_batches``, which serve both kinds alike.
Files that cannot be decoded are skipped and listed, because one bad file in a silo's
folder of thousands must not stop a federation; so are files that are not regular files (a FIFO or device named
like an image) and images over ``MAX_IMAGE_PIXELS`` that cannot be read at reduced scale. Nothing here downloads,
unpickles or trusts file contents beyond decoding pixels (torchvision's CIFAR10/SVHN readers are used only after
their md5 checks pass).
"""

from __future__ import annotations

import copy
import functools
import gzip
import hashlib
import importlib.resources
import logging
import multiprocessing
import multiprocessing.context
import os
import re
import stat
import struct
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image, ImageFile, ImageOps, UnidentifiedImageError
from torch.utils.data import DataLoader, Dataset

from silo_core.dicom import DicomError, probe_dicom, read_dicom

IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".bmp", ".tif", ".tiff", ".dcm")  # .dcm: silo_core/dicom.py

# The most pixels one image may be decoded at. 64 megapixels (8000 x 8000) is above what scanners and radiology
# devices write (a mammogram is about 20), while the models train at a few hundred pixels a side at most, so a
# bigger image only costs memory: 192 MB as RGB, and 16-bit images pass through a 512 MB float64 copy in
# _to_8bit. It is also below Pillow's own decompression-bomb threshold (about 89 MP), which this loader replaces
# (see _identify). JPEGs over it (big camera photos) are still read, decoded at 1/2 to 1/8 scale (Image.draft);
# other formats over it, and JPEGs still over it at 1/8 scale, are skipped with the reason.
MAX_IMAGE_PIXELS = 64_000_000
DEMO_FILE = "fashion_mnist_demo.npz"

log = logging.getLogger("silo_core.data")

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
    images: torch.Tensor | ImageFiles  # uint8 N x C x H x W in memory, or files decoded batch by batch
    labels: torch.Tensor | None  # int64 [N], None for unlabeled data
    classes: list[str]  # class names, index = label; [] for unlabeled data
    # (path, reason) of files skipped when the folder was loaded; files found unreadable later, while training on
    # an ImageFiles, are in images.skipped
    skipped: list[tuple[str, str]] = field(default_factory=list)

    def __post_init__(self) -> None:
        if isinstance(self.images, ImageFiles):
            pass  # its shape and dtype are right by construction
        elif self.images.dtype != torch.uint8 or self.images.ndim != 4:
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


# --- image files read lazily ---------------------------------------------------------------------------------

# A folder whose decoded pixels (N x C x H x W bytes) fit in this many MiB is decoded once, when loaded, into one
# tensor: re-decoding small images on every pass costs more than it saves (28 px: 784 bytes an image, 680,000 of
# them per 512 MiB). A bigger folder is read from disk batch by batch, so memory does not grow with the image
# count (224 px RGB: 150 KB an image, 3 GB for 20,000). silo-client --cache-mb and hub.yaml data.cache_mb set it.
DEFAULT_CACHE_MB = 512.0
# Processes decoding images for a lazily read folder while the training process trains (0: decode in the
# training process itself). silo-client --loader-workers and hub.yaml data.loader_workers set it.
DEFAULT_LOADER_WORKERS = 2
_LOGGED_UNREADABLE = 10  # files found unreadable while training that are logged one by one (per folder)


@functools.cache
def _worker_start() -> multiprocessing.context.BaseContext:
    """How loader workers start: forked from a fork server, a small process started once that has imported this
    module and nothing else, never forked from the hub or silo itself. A fork of the hub copied its running gRPC
    server's polling state, and a worker crashed in gRPC's epoll code (taking the round with it); a fork of either
    would also inherit its models and buffers. Spawn where there is no fork server (Windows). As with any start
    method but fork, each worker imports the program's main module again: a script that reads folders lazily keeps
    its work under ``if __name__ == "__main__":`` (silokit's commands do)."""
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return multiprocessing.get_context("spawn")
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload([__name__])  # workers then start in milliseconds, torch already imported
    return context


def fits_in_memory(num_images: int, image_size: int, channels: int, cache_mb: float) -> bool:
    """Whether ``num_images`` decoded images take at most ``cache_mb`` MiB (then they are kept in memory)."""
    return num_images * channels * image_size * image_size <= cache_mb * 2**20


def _probe(path: Path, image_size: int, channels: int) -> None:
    """Refuses, from the file's type and header alone, what _decode would refuse before decoding a pixel: a file
    that is not a regular file, is no image, or is over MAX_IMAGE_PIXELS (a JPEG at its reduced draft scale). What
    only the pixels show (a truncated file) is found when the file is first decoded."""
    with _open_regular_file(path) as fh:
        if path.suffix.lower() == ".dcm":
            try:
                probe_dicom(fh, MAX_IMAGE_PIXELS)
            except DicomError as exc:
                raise _Refused(str(exc)) from None
            return
        with _identify(fh, path) as img:
            width, height = img.size
            img.draft("L" if channels == 1 else "RGB", (image_size, image_size))  # as _decode does
            if img.size[0] * img.size[1] > MAX_IMAGE_PIXELS:
                raise _Refused(f"{width}x{height} pixels exceeds the {MAX_IMAGE_PIXELS / 1e6:g}-megapixel limit")


def _probe_files(paths: list[Path], image_size: int, channels: int) -> tuple[list[int], list[tuple[str, str]]]:
    """The positions in ``paths`` whose header passes _probe, and (path, reason) of the others."""
    ok: list[int] = []
    skipped: list[tuple[str, str]] = []
    for i, path in enumerate(paths):
        try:
            _probe(path, image_size, channels)
            ok.append(i)
        except Exception as exc:  # as in _load_files: a bad file is skipped and reported
            skipped.append((str(path), _reason(exc)))
    return ok, skipped


class _FileReader(Dataset):
    """What a DataLoader worker gets (pickled): the paths and the target format, nothing else. The paths are one
    numpy byte array, a single object to pickle rather than one per path; decoding is _decode's, so an image is the
    same whichever process decodes it."""

    def __init__(self, paths: Sequence[str | os.PathLike[str]], image_size: int, channels: int):
        self.paths = np.array([os.fsencode(p) for p in paths], dtype=np.bytes_)
        self.image_size, self.channels = image_size, channels

    def __len__(self) -> int:
        return len(self.paths)

    def path(self, row: int) -> Path:
        return Path(os.fsdecode(self.paths[row]))

    def __getitem__(self, row: int) -> tuple[np.ndarray | None, str]:
        try:
            return _decode(self.path(row), self.image_size, self.channels), ""
        except Exception as exc:  # reported to the training process, which counts it; never fatal
            return None, _reason(exc)

    def collate(self, items: list[tuple[np.ndarray | None, str]]) -> tuple[torch.Tensor, torch.Tensor, list]:
        """(ok, pixels, [(position, reason)]): a zero image where a file failed, so positions stay aligned."""
        pixels = torch.zeros((len(items), self.channels, self.image_size, self.image_size), dtype=torch.uint8)
        ok = torch.zeros(len(items), dtype=torch.bool)
        failed = []
        for i, (arr, reason) in enumerate(items):
            if arr is None:
                failed.append((i, reason))
            else:
                pixels[i] = torch.from_numpy(arr)
                ok[i] = True
        return ok, pixels, failed


class ImageFiles:
    """Image files decoded only when a batch of them is read (``image_batches``), each exactly as a folder
    loaded into memory would hold it (uint8 C x H x W at the model's size).

    It stands in for the in-memory tensor where algorithms need one: ``len()``, ``.shape`` (N, C, H, W), and
    indexing by a slice, an index tensor or a boolean mask, which gives another ImageFiles over those files (a
    view: no pixel is read). A file that fails to decode while being read (damaged or replaced after the folder was
    listed) is left out of its batch, remembered so it is never decoded again, and listed in ``skipped``; all views
    of one folder share what was found. ``workers`` processes decode while the caller trains.
    """

    dtype = torch.uint8
    ndim = 4

    def __init__(self, paths: Sequence[str | os.PathLike[str]], image_size: int, channels: int,
                 workers: int = DEFAULT_LOADER_WORKERS):
        _check_format(image_size, channels)
        if workers < 0:
            raise ValueError(f"workers must be >= 0 (0 decodes in this process), got {workers}")
        self.reader = _FileReader(paths, image_size, channels)
        self.rows = torch.arange(len(self.reader))  # this view's files, as rows of the reader
        self.workers = workers
        self._bad = torch.zeros(len(self.reader), dtype=torch.bool)  # shared by all views, updated in place
        self._skipped: list[tuple[str, str]] = []  # shared too: (path, reason) found while reading

    @property
    def shape(self) -> torch.Size:
        return torch.Size((len(self.rows), self.reader.channels, self.reader.image_size, self.reader.image_size))

    def __len__(self) -> int:
        return len(self.rows)

    def __repr__(self) -> str:
        return f"ImageFiles({len(self)} files, {tuple(self.shape[1:])}, {self.workers} workers)"

    def __getitem__(self, key: slice | Sequence[int] | np.ndarray | torch.Tensor) -> ImageFiles:
        if isinstance(key, slice):
            rows = self.rows[key]
        else:
            index = key if isinstance(key, torch.Tensor) else torch.as_tensor(np.asarray(key))
            if index.ndim != 1:
                raise TypeError("index ImageFiles with a slice, a 1-D index tensor or a boolean mask; read pixels "
                                "through silo_core.data.image_batches")
            rows = self.rows[index if index.dtype == torch.bool else index.long()]
        view = copy.copy(self)  # shares the reader and what was found unreadable
        view.rows = rows
        return view

    @property
    def paths(self) -> list[Path]:
        return [Path(p) for p in self.path_strings()]

    def path_strings(self) -> list[str]:
        """This view's file paths as strings: for tens of thousands of files (silo-sim's staging links each one),
        without a Path or a tensor element per file."""
        return [os.fsdecode(p) for p in self.reader.paths[self.rows.numpy()]]

    @property
    def skipped(self) -> list[tuple[str, str]]:
        """(path, reason) of the files of this folder found unreadable while reading, in the order found."""
        return list(self._skipped)

    def readable(self) -> torch.Tensor:
        """A boolean mask over this view: False for files found unreadable so far."""
        return ~self._bad[self.rows]

    def fingerprint(self) -> str:
        """Ties state kept about these images (FedSEAL's self-ensemble) to these files in this order: their paths,
        sizes and modification times, so a changed folder or a rewritten file starts afresh."""
        digest = hashlib.sha256()
        for path in self.paths:
            try:
                st = path.stat()
                stamp = f"{st.st_size}:{st.st_mtime_ns}"
            except OSError:  # deleted since listed: a changed folder, so a new fingerprint
                stamp = "gone"
            digest.update(os.fsencode(path) + b"\0" + stamp.encode() + b"\n")
        return digest.hexdigest()

    def _found_unreadable(self, row: int, reason: str) -> None:
        if bool(self._bad[row]):
            return  # found again by a batch that was already on its way
        self._bad[row] = True
        path = self.reader.path(row)
        self._skipped.append((str(path), reason))
        if len(self._skipped) <= _LOGGED_UNREADABLE:
            log.warning("skipped image %s, unreadable while training: %s", path, reason)
        if len(self._skipped) == _LOGGED_UNREADABLE:
            log.warning("%d images found unreadable while training; further ones are counted, not logged",
                        _LOGGED_UNREADABLE)

    def read(self, index_batches: Iterable[torch.Tensor], pin_memory: bool = False,
             workers: int | None = None) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """padded_image_batches for these files: one DataLoader over the given batches, in their order, so the
        caller's shuffling and augmentation (seeded, in this process) are those of the in-memory path."""
        rows = [self.rows[torch.as_tensor(b, dtype=torch.long)] for b in index_batches]
        known = [self._bad[r] for r in rows]
        todo = [r[~k].tolist() for r, k in zip(rows, known, strict=True)]  # known-bad files are not read again
        workers = min(self.workers if workers is None else workers, len(todo))
        loader = DataLoader(self.reader, batch_sampler=todo, collate_fn=self.reader.collate, num_workers=workers,
                            pin_memory=pin_memory, multiprocessing_context=_worker_start() if workers else None)
        for r, k, wanted, (ok, pixels, failed) in zip(rows, known, todo, loader, strict=True):
            for position, reason in failed:
                self._found_unreadable(wanted[position], reason)
            if bool(k.any()):  # put the batch back in the caller's positions, known-bad files as gaps
                full_ok = torch.zeros(len(r), dtype=torch.bool)
                full_ok[~k] = ok
                full = pixels.new_zeros((len(r), *pixels.shape[1:]))
                full[~k] = pixels
                ok, pixels = full_ok, full
            yield ok, pixels


Images = torch.Tensor | ImageFiles


def padded_image_batches(images: Images, index_batches: Iterable[torch.Tensor], pin_memory: bool = False,
                         workers: int | None = None) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """For each batch of indices into ``images``: (ok, pixels), pixels uint8 len(batch) x C x H x W in the batch's
    order and ok a boolean mask of the positions that could be read (an unreadable file gives a zero image there;
    ok is all True for images in memory). ``pin_memory`` (for a CUDA device) puts read pixels in page-locked memory,
    so that copies to the device can be asynchronous; ``workers`` overrides the files' own number of processes."""
    if isinstance(images, ImageFiles):
        yield from images.read(index_batches, pin_memory, workers)
        return
    for idx in index_batches:
        yield torch.ones(len(idx), dtype=torch.bool), images[idx]


def image_batches(images: Images, index_batches: Iterable[torch.Tensor], pin_memory: bool = False,
                  workers: int | None = None) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """For each batch of indices into ``images``: (kept, pixels), the indices of the batch that could be read and
    their pixels (for images in memory, the batch itself and ``images[batch]``). Labels or pseudo-labels indexed
    by ``kept`` stay aligned with the pixels when a file turns out to be unreadable."""
    index_batches = [torch.as_tensor(b, dtype=torch.long) for b in index_batches]
    for idx, (ok, pixels) in zip(index_batches, padded_image_batches(images, index_batches, pin_memory, workers),
                                 strict=True):
        yield (idx, pixels) if bool(ok.all()) else (idx[ok], pixels[ok])


def readable(images: Images) -> torch.Tensor:
    """A boolean mask over ``images``: False for files found unreadable so far (all True in memory)."""
    if isinstance(images, ImageFiles):
        return images.readable()
    return torch.ones(len(images), dtype=torch.bool)


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


def _image_names(root: Path) -> Iterator[tuple[str, list[str]]]:
    """(folder, its image file names) for every folder under ``root``, hidden files and folders ignored."""
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if not d.startswith(".")]
        yield dirpath, [f for f in filenames if _is_image(f)]


def list_image_files(root: str | os.PathLike[str]) -> list[Path]:
    """Image files under ``root``, recursively, hidden files and folders ignored, in sorted path order."""
    root = Path(root)
    found = [Path(dirpath) / f for dirpath, names in _image_names(root) for f in names]
    return sorted(found, key=lambda p: p.relative_to(root).parts)


def count_image_files(root: str | os.PathLike[str]) -> int:
    """How many files list_image_files would list, without building or sorting their paths."""
    return sum(len(names) for _, names in _image_names(Path(root)))


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


def load_unlabeled_folder(root: str | os.PathLike[str], image_size: int, channels: int, *,
                          cache_mb: float = DEFAULT_CACHE_MB, workers: int = DEFAULT_LOADER_WORKERS) -> ImageSet:
    """All images under ``root`` (recursively), e.g. a silo's local data: decoded into memory when their pixels
    fit in ``cache_mb`` MiB, otherwise files read batch by batch by ``workers`` processes (see ImageFiles)."""
    _check_format(image_size, channels)
    folder = _check_folder(root, "image")
    paths = list_image_files(folder)
    if not paths:
        raise DataError(f"no images found in {folder} (looked recursively for {', '.join(IMAGE_EXTENSIONS)}); "
                        f"put the image files there or point to the right folder")
    if not fits_in_memory(len(paths), image_size, channels, cache_mb):
        ok, skipped = _probe_files(paths, image_size, channels)
        if not ok:
            raise _nothing_usable(folder, skipped)
        return ImageSet(ImageFiles([paths[i] for i in ok], image_size, channels, workers), None, [], skipped)
    arrays, _, skipped = _load_files(paths, image_size, channels)
    if not arrays:
        raise _nothing_usable(folder, skipped)
    return ImageSet(_stack(arrays, image_size, channels), None, [], skipped)


def load_labeled_folder(root: str | os.PathLike[str], image_size: int, channels: int, *,
                        cache_mb: float = DEFAULT_CACHE_MB, workers: int = DEFAULT_LOADER_WORKERS) -> ImageSet:
    """ImageFolder layout: ``root/<class>/**/<image>``; sorted class-folder names give the label order.

    A class folder may be empty (a site need not hold every class; the label space stays the same everywhere).
    Images directly under ``root`` belong to no class: they are listed in ``skipped``. In memory or read from
    disk batch by batch as for load_unlabeled_folder.
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
    class_paths = [list_image_files(class_dir) for class_dir in class_dirs]
    num_files = sum(len(paths) for paths in class_paths)
    lazy = not fits_in_memory(num_files, image_size, channels, cache_mb)
    arrays: list[np.ndarray] = []
    kept: list[Path] = []  # the readable files, when they are read lazily
    labels: list[int] = []
    for label, paths in enumerate(class_paths):
        if lazy:
            ok, class_skipped = _probe_files(paths, image_size, channels)
            kept.extend(paths[i] for i in ok)
        else:
            class_arrays, ok, class_skipped = _load_files(paths, image_size, channels)
            arrays.extend(class_arrays)
        labels.extend([label] * len(ok))
        skipped.extend(class_skipped)
    if num_files == 0:
        raise DataError(f"no images found in the class folders under {folder} (looked for "
                        f"{', '.join(IMAGE_EXTENSIONS)}); put each class's images in its sub-folder")
    if not labels:
        raise _nothing_usable(folder, [s for s in skipped if not s[1].startswith("not inside")])
    images = ImageFiles(kept, image_size, channels, workers) if lazy else _stack(arrays, image_size, channels)
    return ImageSet(images, torch.tensor(labels, dtype=torch.int64), [d.name for d in class_dirs], skipped)


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
