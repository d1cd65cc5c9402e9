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

The rooms, each importing only those above it:

    decoding.py   one file: regular files only, identified from the header, the pixel limit, decoded and resized
    lazy.py       ImageFiles (files decoded batch by batch by loader workers) and the batch readers
    imageset.py   ImageSet, what every loader returns
    folders.py    listing image files; loading an unlabeled or a labeled (ImageFolder) folder
    datasets.py   torchvision's on-disk sets and the bundled demo subset
    writing.py    an ImageSet written out as PNG folders

This package is the public face: import from ``silo_core.data``.
"""

from silo_core.data.datasets import (
    DEMO_FILE,
    FASHION_MNIST_CLASSES,
    MNIST_CLASSES,
    TORCHVISION_DATASETS,
    load_demo,
    load_torchvision,
)
from silo_core.data.decoding import IMAGE_EXTENSIONS, MAX_IMAGE_PIXELS, DataError, image_form, load_image_file
from silo_core.data.folders import (
    count_image_files,
    count_labeled_files,
    list_image_files,
    load_labeled_folder,
    load_unlabeled_folder,
)
from silo_core.data.imageset import ImageSet
from silo_core.data.lazy import (
    DEFAULT_CACHE_MB,
    DEFAULT_LOADER_WORKERS,
    ImageFiles,
    Images,
    fits_in_memory,
    image_batches,
    padded_image_batches,
    readable,
)
from silo_core.data.writing import class_folder_name, describe_classes, same_classes, save_png_folder

__all__ = [
    "DEFAULT_CACHE_MB", "DEFAULT_LOADER_WORKERS", "DEMO_FILE", "FASHION_MNIST_CLASSES", "IMAGE_EXTENSIONS",
    "MAX_IMAGE_PIXELS", "MNIST_CLASSES", "TORCHVISION_DATASETS", "DataError", "ImageFiles", "ImageSet", "Images",
    "class_folder_name", "count_image_files", "count_labeled_files", "describe_classes", "fits_in_memory", "image_batches", "list_image_files",
    "image_form", "load_demo", "load_image_file", "load_labeled_folder", "load_torchvision", "load_unlabeled_folder",
    "padded_image_batches", "readable", "same_classes", "save_png_folder",
]
