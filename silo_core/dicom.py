"""DICOM (.dcm) files as images: the pixels of the first frame, never a header value.

Hospitals keep their images as DICOM. ``read_dicom`` turns one file into an 8-bit Pillow image (L or RGB) that
silo_core.data resizes and converts like a PNG. It needs the optional extra ``pip install 'silokit[dicom]'``
(pydicom 3); without it every .dcm file is skipped with that hint, and the rest of the folder still loads.

What is read, in order:
- only the image tags (rows, columns, samples, photometric interpretation, bit depth, rescale slope/intercept
  or modality LUT, window center/width) and the file meta's transfer syntax: patient, study and every other
  element is skipped unparsed (pydicom's ``specific_tags``), so no name or ID is ever even decoded;
- the size, checked against the caller's pixel limit before any pixel data is read;
- the first frame only (a multi-frame file such as a cine loop or a tomosynthesis stack gives its first frame;
  pydicom reads just that frame);
- grayscale (MONOCHROME1/2): the modality LUT (rescale slope and intercept) then the VOI window from the file
  (the first center/width pair when there are several; DICOM's LINEAR function), or the min-max of the pixel
  values when the file has no valid window; MONOCHROME1 (white is zero) is inverted so every image is dark-is-low;
- colour (RGB and the YBR forms pydicom converts to RGB) stays RGB, 16-bit colour scaled to 8 bits.

Refused, each with a fixed reason: files without the DICOM preamble and "DICM" prefix (read with force=False),
files without an image, palette-colour and other colour models, and compressed transfer syntaxes for which no
decoder is installed (the reason names the packages to install).

Privacy: a reason is one of the fixed texts below, plus numbers or the registered name of a transfer syntax or
photometric interpretation, never a value copied from the file, and pydicom's exceptions (whose text can quote
element values) never travel on: every failure is raised afresh after the pydicom exception is gone, so not even
a traceback chain holds it. pydicom's own messages are silenced where they could quote a value: value validation
is off, the "pydicom" logger does not reach the application's log handlers, and warnings raised from pydicom are
ignored. These are process-wide pydicom settings, set when this module first loads pydicom; silokit uses pydicom
nowhere else.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable, Sequence
from typing import Any, BinaryIO, TypeVar

import numpy as np
from PIL import Image

NEEDS_PYDICOM = "needs pydicom 3 to read DICOM files: pip install 'silokit[dicom]'"
NOT_DICOM = "not a readable DICOM file (no DICOM header, or a damaged one)"
NO_IMAGE = "a DICOM file without an image (no rows and columns)"
BAD_PIXELS = "DICOM pixel data is missing, damaged or truncated"
BAD_RESCALE = "DICOM rescale slope/intercept or modality LUT is damaged"
DECODER_HINT = "pip install pylibjpeg pylibjpeg-libjpeg pylibjpeg-openjpeg (or python-gdcm)"

GRAY = ("MONOCHROME1", "MONOCHROME2")
COLOR = ("RGB", "YBR_FULL", "YBR_FULL_422", "YBR_ICT", "YBR_RCT")  # pydicom returns these as RGB
_OTHER_PHOTOMETRIC = ("PALETTE COLOR", "YBR_PARTIAL_420", "YBR_PARTIAL_422", "HSV", "ARGB", "CMYK")

# The elements read from a file; everything else is skipped unparsed. Group 0002 (file meta) is always read.
_HEADER_TAGS = [
    0x00280002,  # Samples per Pixel
    0x00280004,  # Photometric Interpretation
    0x00280008,  # Number of Frames
    0x00280010,  # Rows
    0x00280011,  # Columns
    0x00280100,  # Bits Allocated
    0x00280101,  # Bits Stored
    0x00280103,  # Pixel Representation
    0x00281050,  # Window Center
    0x00281051,  # Window Width
    0x00281052,  # Rescale Intercept
    0x00281053,  # Rescale Slope
    0x00281054,  # Rescale Type
    0x00283000,  # Modality LUT Sequence
]

T = TypeVar("T")


class DicomError(Exception):
    """A DICOM file that is not read; the message is a fixed reason that never holds a value from the file."""


def _attempt(step: Callable[[], T], reason: str) -> T:
    """``step()``, or DicomError(reason) raised after pydicom's exception is dropped (no __context__ to it)."""
    try:
        return step()
    except Exception:  # pydicom raises many types, and their text may quote element values
        pass
    raise DicomError(reason)


_configured = False


def _import_pydicom() -> Any:
    global _configured
    try:
        import pydicom
        import pydicom.pixels
    except ImportError:
        raise DicomError(NEEDS_PYDICOM) from None
    if not _configured:
        pydicom.config.settings.reading_validation_mode = pydicom.config.IGNORE  # its warnings quote the value
        logging.getLogger("pydicom").propagate = False  # pydicom's log lines never reach silokit's handlers
        warnings.filterwarnings("ignore", module=r"(pydicom|silo_core\.dicom)(\.|$)")
        _configured = True
    return pydicom


def _first_number(ds: Any, keyword: str) -> float | None:
    """The first number of a DS element (Window Center/Width hold one per window); None if absent or not a number."""
    try:
        value = ds.get(keyword)  # converts the raw bytes here, so a damaged value raises here
        if isinstance(value, Sequence) and not isinstance(value, str):
            value = value[0]
        number = float(value)
    except Exception:
        return None
    return number if np.isfinite(number) else None


def _check_transfer_syntax(pydicom: Any, ds: Any) -> None:
    uid = _attempt(lambda: pydicom.uid.UID(ds.file_meta.TransferSyntaxUID), NOT_DICOM)
    known = _attempt(lambda: bool(uid.is_transfer_syntax), NOT_DICOM)
    name = str(uid.name) if known else "(an unregistered UID)"
    try:
        decoder = pydicom.pixels.get_decoder(uid)
        available = bool(decoder.is_available)
    except Exception:  # NotImplementedError for transfer syntaxes pydicom has no decoder for at all (e.g. video)
        decoder = None
    if decoder is None:
        raise DicomError(f"DICOM transfer syntax {name} is not supported")
    if not available:
        raise DicomError(f"DICOM transfer syntax {name} needs a decoder that is not installed: {DECODER_HINT}")


def window(values: np.ndarray, center: float | None, width: float | None) -> np.ndarray:
    """Grayscale values after the modality LUT -> 0..255 floats through the VOI window.

    DICOM's LINEAR function (PS3.3 C.11.2.1.2.1): values up to c - 0.5 - (w - 1)/2 are black, above
    c - 0.5 + (w - 1)/2 white, linear in between. Without a valid window (width below 1 or absent) the pixel
    values' own range is stretched to 0..255; a constant image becomes black.
    """
    values = np.nan_to_num(values.astype(np.float64), nan=0.0, posinf=0.0, neginf=0.0)
    if center is not None and width is not None and width >= 1:
        if width == 1:
            return np.where(values > center - 0.5, 255.0, 0.0)
        scaled = ((values - (center - 0.5)) / (width - 1) + 0.5) * 255.0
        return np.clip(scaled, 0.0, 255.0)
    low, high = (float(values.min()), float(values.max())) if values.size else (0.0, 0.0)
    if high <= low:
        return np.zeros_like(values)
    return (values - low) * (255.0 / (high - low))


def _to_uint8(values: np.ndarray) -> np.ndarray:
    return np.clip(np.rint(values), 0, 255).astype(np.uint8)


def _read_header(fh: BinaryIO, max_pixels: int) -> tuple[Any, Any, str]:
    """pydicom, the file's image elements and its photometric interpretation, once the header shows that the
    file can be read: a DICOM file with an image of at most ``max_pixels`` pixels, a supported colour model and a
    transfer syntax an installed decoder handles. No pixel data is read."""
    pydicom = _import_pydicom()
    fh.seek(0)
    ds = _attempt(lambda: pydicom.dcmread(fh, force=False, stop_before_pixels=True, specific_tags=_HEADER_TAGS),
                  NOT_DICOM)
    rows, columns = _attempt(lambda: (int(ds.get("Rows") or 0), int(ds.get("Columns") or 0)), NOT_DICOM)
    if rows < 1 or columns < 1:
        raise DicomError(NO_IMAGE)
    if rows * columns > max_pixels:
        raise DicomError(f"{columns}x{rows} pixels exceeds the {max_pixels / 1e6:g}-megapixel limit")
    photometric = _attempt(lambda: str(ds.get("PhotometricInterpretation") or "").strip().upper(), NOT_DICOM)
    if photometric not in GRAY + COLOR:
        known = photometric if photometric in _OTHER_PHOTOMETRIC else "(missing or unregistered)"
        raise DicomError(f"DICOM photometric interpretation {known} is not supported; only grayscale "
                         f"(MONOCHROME1/2) and RGB/YBR colour images are read")
    _check_transfer_syntax(pydicom, ds)
    return pydicom, ds, photometric


def probe_dicom(fh: BinaryIO, max_pixels: int) -> None:
    """Raises DicomError if ``read_dicom`` would refuse the file from its header alone; reads no pixel data.
    A file that passes can still fail later on damaged pixel data."""
    _read_header(fh, max_pixels)


def read_dicom(fh: BinaryIO, max_pixels: int) -> Image.Image:
    """The first frame of the DICOM file open in ``fh`` as an 8-bit Pillow image ("L" or "RGB").

    Raises DicomError (a fixed reason, no value from the file) for anything it will not or cannot read, including
    images of more than ``max_pixels`` pixels, which are refused from the header before pixel data is read.
    """
    pydicom, ds, photometric = _read_header(fh, max_pixels)
    fh.seek(0)
    frame = _attempt(lambda: pydicom.pixels.pixel_array(fh, index=0), BAD_PIXELS)  # reads only the first frame
    if photometric in GRAY:
        if frame.ndim != 2:
            raise DicomError(BAD_PIXELS)
        values = _attempt(lambda: pydicom.pixels.apply_modality_lut(frame, ds), BAD_RESCALE)
        gray = window(values, _first_number(ds, "WindowCenter"), _first_number(ds, "WindowWidth"))
        if photometric == "MONOCHROME1":
            gray = 255.0 - gray
        return Image.fromarray(_to_uint8(gray))  # 2-D uint8: mode L
    if frame.ndim != 3 or frame.shape[-1] != 3:
        raise DicomError(BAD_PIXELS)
    if frame.dtype != np.uint8:  # 16-bit colour: scaled by its stored bit depth
        bits = _attempt(lambda: int(ds.get("BitsStored") or 16), NOT_DICOM)
        top = 2**bits - 1 if 8 < bits <= 16 else 65535
        frame = _to_uint8(frame.astype(np.float64) * (255.0 / top))
    return Image.fromarray(np.ascontiguousarray(frame))  # H x W x 3 uint8: mode RGB
