"""Image files read lazily: ``ImageFiles`` stands in for an in-memory tensor and decodes files batch by batch
through a DataLoader (``workers`` processes) only when training reads them; ``image_batches`` and
``padded_image_batches`` serve in-memory tensors and files alike, so algorithms never tell them apart."""

from __future__ import annotations

import copy
import functools
import hashlib
import logging
import multiprocessing
import multiprocessing.context
import os
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from silo_core.data import decoding
from silo_core.data.decoding import check_format, refusal_reason

log = logging.getLogger("silo_core.data")

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



class _FileReader(Dataset):
    """What a DataLoader worker gets (pickled): the paths and the target format, nothing else. The paths are one
    numpy byte array, a single object to pickle rather than one per path; decoding is decode_file's, so an image is the
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
            return decoding.decode_file(self.path(row), self.image_size, self.channels), ""
        except Exception as exc:  # reported to the training process, which counts it; never fatal
            return None, refusal_reason(exc)

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
        check_format(image_size, channels)
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
