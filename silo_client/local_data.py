"""The branch's own images, read for a run: the unlabeled folder (--data), the labeled one (--labeled) checked
against the run's class names, the files skipped as unreadable, and in simulation the true labels of the unlabeled
images. Nothing here leaves the process."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch

from silo.v1 import silo_pb2
from silo_client.run_checks import check_labeled_classes
from silo_client.settings import SiloSettings
from silo_core.algorithms.base import SiloData
from silo_core.data import (
    ImageFiles,
    Images,
    count_image_files,
    list_image_files,
    load_labeled_folder,
    load_unlabeled_folder,
    readable,
)


def load_branch_data(s: SiloSettings, run: silo_pb2.RunDescription, *, state_dir: Path, silo_id: str,
                     files: int, log: logging.Logger) -> tuple[SiloData, int]:
    """The run's view of the branch's folders, and how many files were skipped as unreadable (of `files`)."""
    loading = {"cache_mb": s.cache_mb, "workers": s.loader_workers}
    empty = torch.zeros((0, run.in_channels, run.image_size, run.image_size), dtype=torch.uint8)
    unlabeled, labeled, labels, skipped = empty, None, None, []
    # An empty --data beside a --labeled folder is a silo with labeled images only (the start-up check allows it).
    if s.data is not None and (s.labeled is None or count_image_files(s.data)):
        images = load_unlabeled_folder(s.data, run.image_size, run.in_channels, **loading)
        unlabeled, skipped = images.images, list(images.skipped)
        log.info("loaded %d images from %s (%d skipped)%s", len(images), s.data, len(images.skipped),
                 how_read(images.images, s.cache_mb))
    skipped_unlabeled = list(skipped)
    if s.labeled is not None:
        folder = load_labeled_folder(s.labeled, run.image_size, run.in_channels, **loading)
        check_labeled_classes(s.labeled, folder.classes, run)
        labeled, labels = folder.images, folder.labels
        skipped += [x for x in folder.skipped if not x[1].startswith("not inside")]
        loose = [path for path, reason in folder.skipped if reason.startswith("not inside")]
        if loose:
            log.warning("%d image files directly in %s belong to no class sub-folder and are not used (e.g. %s); "
                        "move each into its class's folder", len(loose), s.labeled, loose[0])
        log.info("loaded %d labeled images from %s%s", len(folder), s.labeled, how_read(folder.images, s.cache_mb))
    for path, reason in skipped[:5]:
        log.warning("skipped unreadable image %s: %s", path, reason)
    if skipped:
        log.warning("%d of %d image files skipped as unreadable", len(skipped), files)
    data = SiloData(images=unlabeled, true_labels=simulation_labels(s, len(unlabeled), skipped_unlabeled, log),
                    state_dir=state_dir, silo_id=silo_id, labeled_images=labeled, labeled_labels=labels)
    return data, len(skipped)


def usable_count(images: Images | None) -> int:
    """Images a silo trains on: read from disk, less the files found unreadable since (they were counted as images
    at load, where only their headers were checked, and then as skipped); all of them in memory."""
    return 0 if images is None else int(readable(images).sum())


def how_read(images: torch.Tensor | ImageFiles, cache_mb: float) -> str:
    if isinstance(images, ImageFiles):
        return (f", read from disk as training goes by {images.workers} loader workers (more than "
                f"--cache-mb {cache_mb:g} MiB decoded)")
    return ", decoded into memory"


def simulation_labels(s: SiloSettings, n: int, skipped: list[tuple[str, str]],
                      log: logging.Logger) -> torch.Tensor | None:
    """silo-sim's true labels of the unlabeled images (for the pseudo-label accuracy), one per staged file in
    list_image_files order: those of files the loader skipped as unreadable are dropped, not all of them."""
    if s.sim_labels is None:
        return None
    labels = json.loads(Path(s.sim_labels).read_text())
    if skipped and s.data is not None and len(labels) == n + len(skipped):
        gone = {Path(path).resolve() for path, _ in skipped}
        files = list_image_files(s.data)
        if len(files) == len(labels):
            labels = [label for path, label in zip(files, labels, strict=True) if path.resolve() not in gone]
    if len(labels) != n:
        log.warning("simulation labels (%d) do not match the %d images loaded; ignoring them", len(labels), n)
        return None
    return torch.tensor(labels, dtype=torch.int64)
