"""Writing an ImageSet out as a folder of PNG files (labeled: one sub-folder per class), so that loading the
folder back gives the same images, order and labels."""

from __future__ import annotations

import os
import re
from pathlib import Path

import numpy as np
from PIL import Image

from silo_core.data.decoding import DataError
from silo_core.data.folders import list_image_files
from silo_core.data.imageset import ImageSet


def class_folder_name(index: int, name: str, num_classes: int) -> str:
    """``03_Dress``: the zero-padded index keeps sorted folder order equal to label order when reloaded, and
    characters that are unsafe in paths (e.g. the "/" in "T-shirt/top") become "_"."""
    safe = re.sub(r"[^\w.\- ]", "_", name).strip(". ") or "class"
    return f"{index:0{len(str(max(num_classes - 1, 0)))}d}_{safe}"


def describe_classes(classes: list[str]) -> str:
    """Class names for an error message: the first 12, then how many in all."""
    shown = ", ".join(classes[:12]) + (f", ... ({len(classes)} in all)" if len(classes) > 12 else "")
    return f"[{shown}]"


def same_classes(folders: list[str], classes: list[str]) -> bool:
    """Whether class folders (sorted, as loaded) name `classes` in order: each folder the name itself or its
    written form (``class_folder_name``: ``03_Dress``), so a folder written by silokit matches its names too."""
    if len(folders) != len(classes):
        return False
    return all(f in (name, class_folder_name(i, name, len(classes)))
               for i, (f, name) in enumerate(zip(folders, classes, strict=True)))


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
