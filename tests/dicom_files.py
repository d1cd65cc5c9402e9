"""Synthetic DICOM files for the tests, written with pydicom: a patient's name and ID in every file, so a test can
check that no header value ever leaves the loader."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from PIL import Image

SECRET_NAME = "Doe^Jane-SECRET123"
SECRET_ID = "PID-SECRET-4711"


def write_dicom(path: Path, pixels: np.ndarray, photometric: str | None = None, frames: int = 1,
                transfer_syntax: str | None = None, pixel_data: bytes | None = None, **elements) -> Path:
    """``pixels`` (H x W grayscale or H x W x 3 RGB; uint8 or uint16) as a DICOM file with the DICOM preamble.

    ``frames`` > 1 writes the same array as frame 0 and its inverse as the later frames. ``elements`` are set as
    they are (e.g. RescaleSlope=2, WindowCenter=[40, 400]); ``pixel_data`` replaces the pixel bytes (for a
    compressed transfer syntax).
    """
    from pydicom.dataset import Dataset, FileMetaDataset
    from pydicom.uid import ExplicitVRLittleEndian, SecondaryCaptureImageStorage, generate_uid

    meta = FileMetaDataset()
    meta.MediaStorageSOPClassUID = SecondaryCaptureImageStorage
    meta.MediaStorageSOPInstanceUID = generate_uid()
    meta.TransferSyntaxUID = transfer_syntax or ExplicitVRLittleEndian
    ds = Dataset()
    ds.file_meta = meta
    ds.SOPClassUID, ds.SOPInstanceUID = meta.MediaStorageSOPClassUID, meta.MediaStorageSOPInstanceUID
    ds.PatientName, ds.PatientID = SECRET_NAME, SECRET_ID
    ds.InstitutionName = "St. SECRET Hospital"
    ds.Modality = "OT"
    ds.Rows, ds.Columns = pixels.shape[:2]
    color = pixels.ndim == 3
    ds.SamplesPerPixel = 3 if color else 1
    ds.PhotometricInterpretation = photometric or ("RGB" if color else "MONOCHROME2")
    if color:
        ds.PlanarConfiguration = 0
    ds.BitsAllocated = ds.BitsStored = pixels.dtype.itemsize * 8
    ds.HighBit = ds.BitsStored - 1
    ds.PixelRepresentation = 0
    if frames > 1:
        ds.NumberOfFrames = frames
    for keyword, value in elements.items():
        setattr(ds, keyword, value)
    top = np.iinfo(pixels.dtype).max
    data = pixels.tobytes() + b"".join((top - pixels).tobytes() for _ in range(frames - 1))
    ds.PixelData = pixel_data if pixel_data is not None else data
    if pixel_data is not None:
        ds["PixelData"].VR = "OB"
    path.parent.mkdir(parents=True, exist_ok=True)
    # A transfer syntax pydicom does not know is written in explicit VR little endian
    encoding = {} if meta.TransferSyntaxUID.is_transfer_syntax else {"implicit_vr": False, "little_endian": True}
    ds.save_as(path, enforce_file_format=True, **encoding)
    return path


def png_to_dicom(png: Path) -> Path:
    """The PNG as an 8-bit DICOM file beside it (same name, .dcm) whose window maps every value to itself; the PNG
    is removed."""
    pixels = np.asarray(Image.open(png))
    target = write_dicom(png.with_suffix(".dcm"), pixels, WindowCenter=128, WindowWidth=256)  # identity
    png.unlink()
    return target
