"""Folders of image files: listing them (hidden files and folders ignored, sorted), and loading an unlabeled
folder or a labeled one (ImageFolder layout) into an ImageSet, in memory when the decoded pixels fit in cache_mb,
otherwise as ImageFiles whose headers were checked. A file that cannot be read is skipped and listed, never fatal
on its own."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from silo_core.data import decoding
from silo_core.data.decoding import IMAGE_EXTENSIONS, DataError, check_format, probe_file, refusal_reason
from silo_core.data.imageset import ImageSet
from silo_core.data.lazy import DEFAULT_CACHE_MB, DEFAULT_LOADER_WORKERS, ImageFiles, fits_in_memory


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
    """(folder, its image file names) for every folder under ``root``, hidden files and folders ignored. Linked
    folders are followed (a branch may link its images in from elsewhere, and a labeled class folder that is a link
    is read too), each real folder once: a link back up the tree, or a second link to one folder, adds nothing."""
    seen: set[str] = set()
    for dirpath, dirnames, filenames in os.walk(root, followlinks=True):
        real = os.path.realpath(dirpath)
        if real in seen:
            dirnames[:] = []
            continue
        seen.add(real)
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


def _class_dirs(folder: Path) -> list[Path]:
    return sorted((d for d in folder.iterdir() if d.is_dir() and not d.name.startswith(".")), key=lambda d: d.name)


def count_labeled_files(root: str | os.PathLike[str]) -> int:
    """How many files load_labeled_folder would read: those inside its class folders (images directly under
    ``root`` belong to no class and are ignored)."""
    return sum(count_image_files(d) for d in _class_dirs(Path(root)))


def probe_files(paths: list[Path], image_size: int, channels: int) -> tuple[list[int], list[tuple[str, str]]]:
    """The positions in ``paths`` whose header passes probe_file, and (path, reason) of the others."""
    ok: list[int] = []
    skipped: list[tuple[str, str]] = []
    for i, path in enumerate(paths):
        try:
            probe_file(path, image_size, channels)
            ok.append(i)
        except Exception as exc:  # as in _load_files: a bad file is skipped and reported
            skipped.append((str(path), refusal_reason(exc)))
    return ok, skipped


def _load_files(paths: list[Path], image_size: int, channels: int) -> tuple[list[np.ndarray], list[int], list]:
    """Decode ``paths``; returns the arrays, the positions in ``paths`` that worked, and the skipped ones."""
    arrays: list[np.ndarray] = []
    ok: list[int] = []
    skipped: list[tuple[str, str]] = []
    for i, path in enumerate(paths):
        try:
            arrays.append(decoding.decode_file(path, image_size, channels))
            ok.append(i)
        except Exception as exc:  # a bad file is skipped and reported, never fatal on its own
            skipped.append((str(path), refusal_reason(exc)))
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
    check_format(image_size, channels)
    folder = _check_folder(root, "image")
    paths = list_image_files(folder)
    if not paths:
        raise DataError(f"no images found in {folder} (looked recursively for {', '.join(IMAGE_EXTENSIONS)}); "
                        f"put the image files there or point to the right folder")
    if not fits_in_memory(len(paths), image_size, channels, cache_mb):
        ok, skipped = probe_files(paths, image_size, channels)
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
    check_format(image_size, channels)
    folder = _check_folder(root, "labeled image")
    class_dirs = _class_dirs(folder)
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
            ok, class_skipped = probe_files(paths, image_size, channels)
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

