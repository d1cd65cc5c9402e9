"""DICOM files in image folders: pixels only (rescale, window, MONOCHROME1 inverted, RGB kept), fixed refusal
reasons, and no header value (a patient's name or ID) in any reason, log line, warning or exception."""

import json
import logging
import subprocess
import sys
import warnings

import numpy as np
import pytest
from PIL import Image

import silo_core.data
import silo_core.dicom
from silo_core.data import DataError, load_image_file, load_unlabeled_folder, save_png_folder
from silo_core.dicom import BAD_PIXELS, NEEDS_PYDICOM, NO_IMAGE, NOT_DICOM, DicomError, probe_dicom, window
from tests.dicom_files import SECRET_ID, SECRET_NAME, png_to_dicom, write_dicom

pydicom = pytest.importorskip("pydicom", reason="needs pydicom: pip install 'silokit[dicom]'")

RAMP = (np.arange(64, dtype=np.uint16) * 40).reshape(8, 8)  # 0 .. 2520
SECRETS = (SECRET_NAME, SECRET_ID, "Doe", "SECRET")


def gray(path) -> np.ndarray:
    return load_image_file(path, 8, 1).numpy()[0]


def test_rescale_then_the_files_first_window(tmp_path):
    path = write_dicom(tmp_path / "ct.dcm", RAMP, RescaleSlope=2, RescaleIntercept=-100,
                       WindowCenter=[500, 40], WindowWidth=[1000, 80])
    values = RAMP * 2.0 - 100  # -100 .. 4940
    # Center 500, width 1000: DICOM's linear window runs from 0 (black) to 999 (white).
    expected = np.rint(np.clip(values / 999 * 255, 0, 255))
    assert np.array_equal(gray(path), expected)
    assert gray(path)[0, 0] == 0 and gray(path)[-1, -1] == 255


def test_monochrome1_is_inverted_and_without_a_window_the_range_is_stretched(tmp_path):
    stretched = RAMP / RAMP.max() * 255
    plain = write_dicom(tmp_path / "m2.dcm", RAMP)
    inverted = write_dicom(tmp_path / "m1.dcm", RAMP, photometric="MONOCHROME1")
    assert np.array_equal(gray(plain), np.rint(stretched))
    assert np.array_equal(gray(inverted), np.rint(255 - stretched))
    assert gray(inverted)[0, 0] == 255  # MONOCHROME1: the lowest value is white


def test_window_edge_cases():
    values = np.array([0.0, 9.0, 10.0, 11.0, np.nan])
    assert window(values, 10, 1).tolist() == [0, 0, 255, 255, 0]  # width 1: a threshold at c - 0.5
    assert window(values, 10, 0).tolist() == pytest.approx([0, 9 / 11 * 255, 10 / 11 * 255, 255, 0])  # invalid
    assert window(np.full(4, 7.0), None, None).tolist() == [0, 0, 0, 0]  # a constant image


def test_rgb_and_ybr_stay_colour(tmp_path):
    rgb = np.random.default_rng(0).integers(0, 256, (8, 8, 3), dtype=np.uint8)
    plain = write_dicom(tmp_path / "rgb.dcm", rgb)
    assert np.array_equal(load_image_file(plain, 8, 3).numpy(), rgb.transpose(2, 0, 1))
    from pydicom.pixels import convert_color_space

    ybr = write_dicom(tmp_path / "ybr.dcm", convert_color_space(rgb, "RGB", "YBR_FULL"), photometric="YBR_FULL")
    back = load_image_file(ybr, 8, 3).numpy().astype(int)
    assert np.abs(back - rgb.transpose(2, 0, 1)).max() <= 2  # pydicom converts YBR to RGB
    Image.fromarray(rgb).save(tmp_path / "rgb.png")  # to grayscale: the same luma conversion as a colour PNG
    assert np.array_equal(load_image_file(plain, 8, 1).numpy(), load_image_file(tmp_path / "rgb.png", 8, 1).numpy())


def test_multi_frame_gives_its_first_frame(tmp_path):
    first = np.tile(np.arange(8, dtype=np.uint8) * 30, (8, 1))  # the later frames are its inverse
    path = write_dicom(tmp_path / "cine.dcm", first, frames=3, WindowCenter=128, WindowWidth=256)
    assert np.array_equal(gray(path), first)


def test_a_dicom_folder_loads_like_the_png_folder_it_came_from(tmp_path):
    images = silo_core.data.load_demo("test").subset(range(12))
    pngs = save_png_folder(images, tmp_path / "png", labeled=False)
    save_png_folder(images, tmp_path / "dcm", labeled=False)
    for png in sorted((tmp_path / "dcm").iterdir()):
        png_to_dicom(png)
    from_png = load_unlabeled_folder(pngs[0].parent, 20, 1)
    from_dicom = load_unlabeled_folder(tmp_path / "dcm", 20, 1)
    assert len(from_dicom) == 12 and not from_dicom.skipped
    assert np.array_equal(from_dicom.images.numpy(), from_png.images.numpy())


def test_size_is_refused_from_the_header_before_pixel_data_is_read(tmp_path, monkeypatch):
    path = write_dicom(tmp_path / "big.dcm", RAMP)
    decoded = []
    monkeypatch.setattr(pydicom.pixels, "pixel_array", lambda *a, **k: decoded.append(1))
    monkeypatch.setattr(silo_core.data.decoding, "MAX_IMAGE_PIXELS", 63)
    with pytest.raises(DataError, match="8x8 pixels exceeds the 6.3e-05-megapixel limit"):
        load_image_file(path, 8, 1)
    assert decoded == []


def unreadable_files(folder):
    """DICOM-named files the loader must refuse, each with the reason it must give (a prefix of it)."""
    good = write_dicom(folder / "good.dcm", RAMP).read_bytes()
    (folder / "png-named.dcm").write_bytes(b"\x89PNG\r\n\x1a\n" + b"\x00" * 200)
    (folder / "text.dcm").write_text(f"{SECRET_NAME} {SECRET_ID}\n" * 20)
    (folder / "truncated-pixels.dcm").write_bytes(good[:-40])
    (folder / "truncated-header.dcm").write_bytes(good[:300])
    write_dicom(folder / "palette.dcm", RAMP.astype(np.uint8), photometric="PALETTE COLOR")
    with pydicom.config.disable_value_validation():  # header values that a careless reader would echo
        write_dicom(folder / "secret-photometric.dcm", RAMP, photometric="SECRET123")
        write_dicom(folder / "secret-syntax.dcm", RAMP, transfer_syntax="1.2.840.SECRET123")
    window_file = write_dicom(folder / "secret-window.dcm", RAMP, WindowCenter="777777", WindowWidth="88888888")
    window_file.write_bytes(window_file.read_bytes().replace(b"777777", b"SECRET").replace(b"88888888", b"Doe^Jane"))
    return {
        "png-named.dcm": NOT_DICOM, "text.dcm": NOT_DICOM, "truncated-pixels.dcm": BAD_PIXELS,
        "truncated-header.dcm": NO_IMAGE, "palette.dcm": "DICOM photometric interpretation PALETTE COLOR is not",
        "secret-photometric.dcm": "DICOM photometric interpretation (missing or unregistered) is not",
        "secret-syntax.dcm": "DICOM transfer syntax (an unregistered UID) is not supported",
    }


def test_unreadable_files_are_skipped_with_fixed_reasons_and_no_header_value_anywhere(tmp_path, caplog, capfd,
                                                                                     monkeypatch):
    expected = unreadable_files(tmp_path)
    caplog.set_level(logging.DEBUG)
    # pydicom set up afresh inside this test, as in a fresh process (pytest resets warning filters per test);
    # unset, pydicom would warn and log "Invalid value for VR UI: '1.2.840.SECRET123'".
    monkeypatch.setattr(silo_core.dicom, "_configured", False)
    with warnings.catch_warnings(record=True) as caught:
        loaded = load_unlabeled_folder(tmp_path, 8, 1)
    reasons = {path.rsplit("/", 1)[1]: reason for path, reason in loaded.skipped}
    assert len(loaded) == 2  # good.dcm, and secret-window.dcm with its range stretched instead
    assert set(reasons) == set(expected)
    for name, reason in reasons.items():
        assert reason.startswith(expected[name]), (name, reason)
    out, err = capfd.readouterr()
    seen = [*reasons.values(), caplog.text, out, err, *(str(w.message) for w in caught)]
    for name in expected:  # the exceptions a caller gets, and everything chained to them
        with pytest.raises(DataError) as info:
            load_image_file(tmp_path / name, 8, 1)
        exc: BaseException | None = info.value
        while exc is not None:
            assert "pydicom" not in type(exc).__module__
            seen.append(str(exc))
            exc = exc.__cause__ or exc.__context__
    for text in seen:
        assert not any(secret in text for secret in SECRETS), text


def test_probe_refuses_from_the_header_alone(tmp_path, monkeypatch):
    expected = unreadable_files(tmp_path)
    decoded = []
    monkeypatch.setattr(pydicom.pixels, "pixel_array", lambda *a, **k: decoded.append(1))
    refused = {}
    for path in sorted(tmp_path.iterdir()):
        with open(path, "rb") as fh:
            try:
                probe_dicom(fh, 64)
            except DicomError as exc:
                refused[path.name] = str(exc)
    # Damaged pixel data shows only when decoded; everything else is refused with read_dicom's reason.
    assert set(refused) == set(expected) - {"truncated-pixels.dcm"}
    assert all(reason.startswith(expected[name]) for name, reason in refused.items())
    assert decoded == []


def test_compressed_without_a_decoder_names_the_packages(tmp_path):
    from pydicom.encaps import encapsulate
    from pydicom.pixels import get_decoder
    from pydicom.uid import JPEGLSLossless

    if get_decoder(JPEGLSLossless).is_available:
        pytest.skip("a JPEG-LS decoder is installed here")
    path = write_dicom(tmp_path / "jls.dcm", RAMP, transfer_syntax=JPEGLSLossless,
                       pixel_data=encapsulate([b"\xff\xd8" + b"\x00" * 30]))
    with pytest.raises(DataError) as info:
        load_image_file(path, 8, 1)
    assert "DICOM transfer syntax JPEG-LS Lossless Image Compression needs a decoder" in str(info.value)
    assert "pip install pylibjpeg pylibjpeg-libjpeg" in str(info.value)


def test_without_pydicom_a_dicom_file_is_skipped_with_the_install_hint(tmp_path):
    write_dicom(tmp_path / "mixed" / "scan.dcm", RAMP)
    Image.new("L", (8, 8), 50).save(tmp_path / "mixed" / "photo.png")
    write_dicom(tmp_path / "only" / "scan.dcm", RAMP)
    script = (
        "import json, sys\n"
        "sys.modules['pydicom'] = None\n"
        "from silo_core.data import DataError, load_unlabeled_folder\n"
        "mixed = load_unlabeled_folder(sys.argv[1], 8, 1)\n"
        "try:\n"
        "    load_unlabeled_folder(sys.argv[2], 8, 1)\n"
        "    error = None\n"
        "except DataError as exc:\n"
        "    error = str(exc)\n"
        "print(json.dumps({'loaded': len(mixed), 'skipped': mixed.skipped, 'error': error}))\n"
    )
    proc = subprocess.run([sys.executable, "-c", script, str(tmp_path / "mixed"), str(tmp_path / "only")],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    assert result["loaded"] == 1
    assert [reason for _, reason in result["skipped"]] == [NEEDS_PYDICOM]
    assert "pip install 'silokit[dicom]'" in result["error"] and "scan.dcm" in result["error"]
    assert "Traceback" not in proc.stderr
