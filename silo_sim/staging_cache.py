"""Staged federations kept between silo-sim runs (issue 38): the silos' image folders and every certificate of a
federation, keyed by the data, the partition, the seed and every other staging option, so that a second run with
the same options links nothing and issues nothing. At 1,000 silos that staging (61,000 links, 1,002 certificates)
took about 2 s of every run's start.

What is kept: the CA, the hub's and every silo's certificate bundle, the hub's labeled, test and validation
folders, and each silo's images, labels.json and labeled folder, in one folder under the cache
(cache_dir()/sim-federations/KEY). What never is: hub.yaml, the hub's state, the silos' state (ledger, audit),
logs; those are written for each run in its --workdir, so no run sees another's state. The folder is written
under a lock and used only once complete; one whose certificates have fewer than MIN_DAYS_LEFT days left is staged
again; the KEEP most recently used are kept.

Only sources whose files are content-addressed are kept (the demo and torchvision data sets, written once as PNG
files named by a fingerprint of their pixels): a folder of the user's own images could change under the same
paths, so it is staged afresh each run.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import fcntl
import hashlib
import json
import logging
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from cryptography import x509

from security.pki.store import BUNDLE_CERT
from silo_sim.stage import SimData, cache_dir

log = logging.getLogger("silo_sim")

LAYOUT = 1  # bump when what stage_federation writes changes, so older folders are not reused
KEEP = 3  # staged federations kept, the most recently used
MIN_DAYS_LEFT = 30  # a kept federation whose certificates expire sooner is staged again
COMPLETE = "complete"
# The staging options that change what is written (hub_config and the hub's port do not: they go to hub.yaml).
KEYED_OPTIONS = ("num_silos", "labels_per_class", "partition", "alpha", "classes_per_silo", "unlabeled_limit",
                 "test_per_class", "seed", "validation_per_class", "labeled_silos", "silo_labels_per_class",
                 "hub_host")


def federations_dir() -> Path:
    return cache_dir() / "sim-federations"


def federation_key(source: SimData, options: dict[str, Any]) -> str | None:
    """The key of the federation `options` stage from `source`, or None when the source's files are not the
    content-addressed PNG cache (then nothing is kept)."""
    sim_data = f"{cache_dir() / 'sim-data'}{os.sep}"
    digest = hashlib.sha256(json.dumps({"layout": LAYOUT, "size": source.image_size, "channels": source.channels,
                                        **{k: options.get(k) for k in KEYED_OPTIONS}}, sort_keys=True).encode())
    for images in (source.train, source.test):
        if images is None:
            digest.update(b"no test set")
            continue
        path_strings = getattr(images.images, "path_strings", None)  # files on disk (ImageFiles), not tensors
        paths = path_strings() if path_strings is not None else None  # strings: 70,000 Paths took half a second
        if paths is None or not all(p.startswith(sim_data) for p in paths):
            return None
        digest.update("\n".join(paths).encode())
        digest.update(images.labels.numpy().astype("<i8").tobytes())
    return digest.hexdigest()[:24]


def _usable(folder: Path, hub_cert: Path) -> bool:
    """Complete, and its certificates valid for MIN_DAYS_LEFT days more (the hub's and the silos' were issued
    together, for the same days)."""
    if not (folder / COMPLETE).is_file():
        return False
    try:
        cert = x509.load_pem_x509_certificate(hub_cert.read_bytes())
    except (OSError, ValueError):
        return False
    left = cert.not_valid_after_utc - dt.datetime.now(dt.UTC)
    return left > dt.timedelta(days=MIN_DAYS_LEFT)


@contextlib.contextmanager
def kept_federation(key: str) -> Iterator[tuple[Path, bool]]:
    """(folder, reuse) under the key's lock: `reuse` True when a complete, valid federation is there to use as it
    is; else the folder is empty and the caller stages into it, and it is marked complete when the block ends
    without an error (a run that failed half-way leaves a folder the next one clears)."""
    root = federations_dir()
    root.mkdir(parents=True, exist_ok=True)
    folder = root / key
    with open(root / f"{key}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        reuse = _usable(folder, folder / "pki" / "hub" / BUNDLE_CERT)
        if not reuse:
            shutil.rmtree(folder, ignore_errors=True)
            folder.mkdir()
        yield folder, reuse
        (folder / COMPLETE).write_text(dt.datetime.now(dt.UTC).isoformat())  # also: last used


def evict(keep: int = KEEP) -> list[Path]:
    """Remove all but the `keep` most recently used kept federations (a busy one is left alone); returns those
    removed."""
    root = federations_dir()
    if not root.is_dir():
        return []
    done = sorted((p for p in root.iterdir() if (p / COMPLETE).is_file()),
                  key=lambda p: (p / COMPLETE).stat().st_mtime, reverse=True)
    removed = []
    for folder in done[keep:]:
        with open(root / f"{folder.name}.lock", "w") as lock:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue  # a run is staging or checking it now
            shutil.rmtree(folder, ignore_errors=True)
        removed.append(folder)  # its lock file stays: unlinking it could split the lock between two runs
    return removed
