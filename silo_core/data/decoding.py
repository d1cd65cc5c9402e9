"""One image file: opened only if it is a regular file, identified from its header, refused over
MAX_IMAGE_PIXELS before a pixel is decoded, then decoded to uint8 C x H x W at the model's size and channels.
Every other room decodes and probes through here, so an image is the same whichever path reads it."""

from __future__ import annotations

import os
import stat
import struct
from pathlib import Path
from typing import BinaryIO

import numpy as np
import torch
from PIL import Image, ImageFile, ImageOps, UnidentifiedImageError

from silo_core.dicom import DicomError, probe_dicom, read_dicom

IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".bmp", ".tif", ".tiff", ".dcm")  # .dcm: silo_core/dicom.py

# The most pixels one image may be decoded at. 64 megapixels (8000 x 8000) is above what scanners and radiology
# devices write (a mammogram is about 20), while the models train at a few hundred pixels a side at most, so a
# bigger image only costs memory: 192 MB as RGB, and 16-bit images pass through a 512 MB float64 copy in
# _to_8bit. It is also below Pillow's own decompression-bomb threshold (about 89 MP), which this loader replaces
# (see _identify). JPEGs over it (big camera photos) are still read, decoded at 1/2 to 1/8 scale (Image.draft);
# other formats over it, and JPEGs still over it at 1/8 scale, are skipped with the reason.
MAX_IMAGE_PIXELS = 64_000_000


class DataError(Exception):
    """A data problem the user can fix; the message names the path and what to do."""



def check_format(image_size: int, channels: int) -> None:
    if channels not in (1, 3):
        raise ValueError(f"channels must be 1 (grayscale) or 3 (RGB), got {channels}")
    if image_size < 1:
        raise ValueError(f"image_size must be positive, got {image_size}")


class Refused(Exception):
    """A file the loader will not read; the message is the whole reason shown in the skipped list."""


def refusal_reason(exc: Exception) -> str:
    return str(exc) if isinstance(exc, Refused) else f"{type(exc).__name__}: {exc}"


_FILE_KINDS = {stat.S_IFIFO: "a FIFO", stat.S_IFCHR: "a character device", stat.S_IFBLK: "a block device",
               stat.S_IFSOCK: "a socket", stat.S_IFDIR: "a folder"}


def _require_regular(st_mode: int) -> None:
    if not stat.S_ISREG(st_mode):
        kind = _FILE_KINDS.get(stat.S_IFMT(st_mode), "a special file")
        raise Refused(f"{kind}, not a regular file; only regular files are read")


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
    above twice that it refuses the file, a huge JPEG that draft() would read at 1/8 scale included. decode_file
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
        raise Refused(str(exc)) from None


def _to_8bit(img: Image.Image) -> Image.Image:
    """16-bit and float images (common in medical data) scaled to 8 bits; plain convert("L") would clip them.
    The scale follows the mode alone, never the pixels: two files of one scanner's export must decode a stored value
    to the same 8-bit value whatever else each image holds. Integer images are read as 16-bit (0..65535, as PNG and
    TIFF store them), float images as intensities in [0, 1]."""
    arr = np.asarray(img, dtype=np.float64)
    if img.mode.startswith("I"):
        arr = arr / 257.0  # 0..65535 -> 0..255
    elif img.mode == "F":
        arr = arr * 255.0  # [0, 1] -> 0..255; values outside clip, as in torchvision's float-to-uint8 conversion
    return Image.fromarray(np.clip(np.rint(arr), 0, 255).astype(np.uint8))


def decode_file(path: Path, image_size: int, channels: int) -> np.ndarray:
    mode = "L" if channels == 1 else "RGB"
    with _open_regular_file(path) as fh, _open_image(fh, path) as img:
        width, height = img.size
        img.draft(mode, (image_size, image_size))  # JPEG only: decode big photos at reduced scale, much faster
        if img.size[0] * img.size[1] > MAX_IMAGE_PIXELS:  # checked on the header, before any pixel is decoded
            reduced = f" even when decoded at {img.size[0]}x{img.size[1]}" if img.size != (width, height) else ""
            raise Refused(f"{width}x{height} pixels exceeds the {MAX_IMAGE_PIXELS / 1e6:g}-megapixel limit{reduced}")
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


GRAY_MODES = ("1", "L", "LA", "I", "F", "I;16", "I;16B", "I;16L", "I;16N")


def image_form(path: str | os.PathLike[str]) -> tuple[int, int]:
    """(channels, smaller side) a model should take for this file, read as decode_file reads it (a .dcm through
    silo_core.dicom): 1 for grayscale (16-bit, float and palette images of grays included), 3 otherwise."""
    path = Path(path)
    try:
        with _open_regular_file(path) as fh, _open_image(fh, path) as img:
            gray = img.mode in GRAY_MODES
            if img.mode == "P":
                palette = img.getpalette() or []
                gray = all(palette[i] == palette[i + 1] == palette[i + 2] for i in range(0, len(palette) - 2, 3))
            return (1 if gray else 3), min(img.size)
    except Exception as exc:  # as load_image_file: one clear line
        raise DataError(f"cannot read image {path}: {refusal_reason(exc)}; replace or delete the file") from exc


def load_image_file(path: str | os.PathLike[str], image_size: int, channels: int) -> torch.Tensor:
    """One image file as uint8 C x H x W, converted to ``channels`` and resized to ``image_size``."""
    check_format(image_size, channels)
    try:
        arr = decode_file(Path(path), image_size, channels)
    except Exception as exc:  # Pillow raises many types on bad files (OSError, ValueError, SyntaxError, ...)
        raise DataError(f"cannot read image {path}: {refusal_reason(exc)}; replace or delete the file") from exc
    return torch.from_numpy(np.ascontiguousarray(arr))


def probe_file(path: Path, image_size: int, channels: int) -> None:
    """Refuses, from the file's type and header alone, what decode_file would refuse before decoding a pixel: a file
    that is not a regular file, is no image, or is over MAX_IMAGE_PIXELS (a JPEG at its reduced draft scale). What
    only the pixels show (a truncated file) is found when the file is first decoded."""
    with _open_regular_file(path) as fh:
        if path.suffix.lower() == ".dcm":
            try:
                probe_dicom(fh, MAX_IMAGE_PIXELS)
            except DicomError as exc:
                raise Refused(str(exc)) from None
            return
        with _identify(fh, path) as img:
            width, height = img.size
            img.draft("L" if channels == 1 else "RGB", (image_size, image_size))  # as decode_file does
            if img.size[0] * img.size[1] > MAX_IMAGE_PIXELS:
                raise Refused(f"{width}x{height} pixels exceeds the {MAX_IMAGE_PIXELS / 1e6:g}-megapixel limit")
