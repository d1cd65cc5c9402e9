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

The key names the data by its own files (the bundled demo file, or the torchvision data set's files, with their
sizes and modification times), so a run whose federation is kept reads no image before its hub starts; the
federation's own description (federation.json: the model's input size and channels, every silo's files) is kept
beside it. Only those sources are kept: a folder of the user's own images could change under the same paths, so
it is staged afresh each run.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import fcntl
import hashlib
import importlib.resources
import json
import shutil
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

from cryptography import x509

from security.pki.store import BUNDLE_CERT
from silo_core.data.datasets import DEMO_FILE
from silo_sim.stage import SimData, cache_dir, torchvision_source, write_hub_yaml
from silo_sim.staged import SiloSpec, StagedFederation

LAYOUT = 3  # bump when what stage_federation writes changes (3: class folders under their own names)
KEEP = 3  # staged federations kept, the most recently used
MIN_DAYS_LEFT = 30  # a kept federation whose certificates expire sooner is staged again
COMPLETE = "complete"
FEDERATION_FILE = "federation.json"  # what a later run needs to use the federation without the data set
# The staging options that change what is written (hub_config and the hub's port do not: they go to hub.yaml).
KEYED_OPTIONS = ("num_silos", "labels_per_class", "partition", "alpha", "classes_per_silo", "unlabeled_limit",
                 "test_per_class", "seed", "validation_per_class", "labeled_silos", "silo_labels_per_class",
                 "hub_host")


def federations_dir() -> Path:
    return cache_dir() / "sim-federations"


def source_identity(data: str) -> list[Any] | None:
    """What --data names, without reading an image: the files its images come from, with their sizes and
    modification times (the bundled demo file, or the torchvision data set's own files). None for a folder of the
    user's own images, which is never kept."""
    named = torchvision_source(data)
    if data == "demo":
        files = [Path(str(importlib.resources.files("silo_core").joinpath("demo_data", DEMO_FILE)))]
    elif named is not None:
        canonical, root = named
        folder = {"FashionMNIST": Path(root) / "FashionMNIST" / "raw", "MNIST": Path(root) / "MNIST" / "raw",
                  "CIFAR10": Path(root) / "cifar-10-batches-py"}.get(canonical)
        files = sorted(folder.iterdir()) if folder is not None and folder.is_dir() else sorted(
            Path(root).glob("*_32x32.mat"))
    else:
        return None
    stamps = []
    for path in files:
        try:
            st = path.stat()
        except OSError:
            return None
        stamps.append([str(path.resolve()), st.st_size, st.st_mtime_ns])
    return [data, stamps] if stamps else None


def federation_key(data: str, image_size: int | None, options: dict[str, Any]) -> str | None:
    """The key of the federation `options` stage from --data `data` (and --image-size), or None when `data` is a
    folder of the user's own images (nothing is kept). Reads no image, so that a run whose federation is kept
    starts its hub without loading the data set."""
    identity = source_identity(data)
    if identity is None:
        return None
    described = {"layout": LAYOUT, "source": identity, "image_size": image_size,
                 **{k: options.get(k) for k in KEYED_OPTIONS}}
    return hashlib.sha256(json.dumps(described, sort_keys=True).encode()).hexdigest()[:24]


def describe(files: Path, source: SimData, staged: StagedFederation) -> None:
    """Write what a later run needs to use the federation just staged under `files` without the data set: the
    model's input, the words for the data, whether there is a validation split, and every silo's files."""
    (files / FEDERATION_FILE).write_text(json.dumps({
        "image_size": source.image_size, "channels": source.channels, "description": source.description,
        "validation": (files / "hub" / "validation").is_dir(), "silos": [s.to_json() for s in staged.silos]}))


def restore(root: Path, files: Path, *, hub_config: dict[str, Any] | None, hub_host: str, seed: int,
            hub_staged: Callable[[StagedFederation], None] | None = None) -> tuple[StagedFederation, str]:
    """The federation kept under `files` as this run's, in `root`: its hub.yaml (`hub_config` merged as when
    staging), staged.json and each silo's state folder there; `hub_staged` is called once hub.yaml is written, as
    stage_federation calls it. Returns it and the words for its data."""
    saved = json.loads((files / FEDERATION_FILE).read_text())
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    staged = StagedFederation(root=root, hub_config=root / "hub.yaml", hub_state_dir=root / "hub" / "state",
                              ca_dir=files / "pki" / "ca")
    write_hub_yaml(staged.hub_config, files, hub_host=hub_host, validation=bool(saved["validation"]),
                   image_size=int(saved["image_size"]), channels=int(saved["channels"]),
                   num_silos=len(saved["silos"]), seed=seed, hub_config=hub_config)
    if hub_staged is not None:
        hub_staged(staged)
    staged.silos = [replace(SiloSpec.from_json(s), state_dir=root / "silos" / s["name"] / "state")
                    for s in saved["silos"]]
    staged.write()
    return staged, str(saved["description"])


def _usable(folder: Path, hub_cert: Path) -> bool:
    """Complete, and its certificates valid for MIN_DAYS_LEFT days more (the hub's and the silos' were issued
    together, for the same days)."""
    if not (folder / COMPLETE).is_file() or not (folder / FEDERATION_FILE).is_file():
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


@contextlib.contextmanager
def in_use(key: str) -> Iterator[None]:
    """Held by a silo-sim run for as long as its hub and silos read the kept federation `key` (a shared lock, so
    runs of the same federation go side by side): evict leaves it alone. The key's staging lock is held only while
    staging, so a benchmark's other cells, staging federations of their own, evicted one a cell was training on."""
    root = federations_dir()
    root.mkdir(parents=True, exist_ok=True)
    with open(root / f"{key}.inuse", "w") as using:
        fcntl.flock(using, fcntl.LOCK_SH)
        yield


def evict(keep: int = KEEP) -> list[Path]:
    """Remove all but the `keep` most recently used kept federations (one being staged or checked, or in use by a
    run, is left alone); returns those removed."""
    root = federations_dir()
    if not root.is_dir():
        return []
    done = sorted((p for p in root.iterdir() if (p / COMPLETE).is_file()),
                  key=lambda p: (p / COMPLETE).stat().st_mtime, reverse=True)
    removed = []
    for folder in done[keep:]:
        with open(root / f"{folder.name}.lock", "w") as lock, open(root / f"{folder.name}.inuse", "w") as using:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                fcntl.flock(using, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue  # a run is staging, checking or using it now
            shutil.rmtree(folder, ignore_errors=True)
        removed.append(folder)  # its lock files stay: unlinking one could split the lock between two runs
    return removed
