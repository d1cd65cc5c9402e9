"""Stage a whole federation on one machine: real image files on disk, a CA with a certificate per party, hub.yaml.

Layout under root:
    pki/ca, pki/hub, pki/silos/<silo>      certificates (silo-certs' layout)
    hub/labeled/<class>/*.png              the hub's labeled images
    hub/test/<class>/*.png                 the hub's test set
    hub/validation/<class>/*.png           a held-out labeled split (only when asked for: FedSEAL's thresholds)
    silos/<silo>/images/*.png              each silo's unlabeled images
    silos/<silo>/labeled/<class>/*.png     labeled images of a partly labeled silo (HASSLE), when asked for
    silos/<silo>/labels.json               simulation only: true labels of images/, for pseudo-label accuracy
    hub.yaml                               the hub's config, as an operator would write it

The images come from a SimData source (load_source): the bundled demo subset, a torchvision dataset on disk (all
of its training split) or any folder of class sub-folders. Images held in memory are written as PNG files; the
files of a folder source are linked (hard links, copies across file systems), never decoded or re-encoded.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import ipaddress
import json
import os
import shutil
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import yaml

from security.pki import init_ca, issue_hub, issue_silos
from silo_core.data import (
    TORCHVISION_DATASETS,
    DataError,
    ImageFiles,
    ImageSet,
    class_folder_name,
    image_form,
    list_image_files,
    load_demo,
    load_torchvision,
    save_png_folder,
)
from silo_core.partition import make_partition, split_labeled_per_class
from silo_sim.staged import DATA_HELP, SiloSpec, StagedFederation


@dataclass
class SimData:
    """Where a simulated federation's images come from: its training pool (hub labels, validation split, silo
    shards), its test set (None: held out from the pool) and the size and channels the model takes."""

    train: ImageSet
    test: ImageSet | None
    image_size: int
    channels: int
    description: str


def load_source(source: str = "demo", image_size: int | None = None) -> SimData:
    """The images named by silo-sim's --data (DATA_HELP). `image_size` overrides the size the model takes.
    Images decoded into memory (the demo, a torchvision dataset) come back as PNG files of the cache (as_files)."""
    if source == "demo":
        size = image_size or 28
        return SimData(as_files(load_demo("train"), "demo"), as_files(load_demo("test"), "demo"), size, 1,
                       "the bundled demo subset")
    named = torchvision_source(source)
    if named is not None:
        canonical, root = named
        channels = 1 if canonical in ("FashionMNIST", "MNIST") else 3
        size = image_size or (28 if channels == 1 else 32)
        train = as_files(load_torchvision(canonical, root, True, size, channels), canonical)
        test = as_files(load_torchvision(canonical, root, False, size, channels), canonical)
        return SimData(train, test, size, channels, f"{canonical} under {root}")
    folder = Path(source)
    if not folder.is_dir():
        raise DataError(f"--data {source}: not a folder nor one of the known sources; use {DATA_HELP}")
    return _folder_source(folder, image_size)


def torchvision_source(source: str) -> tuple[str, str] | None:
    """(torchvision's name of the data set, ROOT) for --data NAME:ROOT naming one of TORCHVISION_DATASETS, else None."""
    name, sep, root = source.partition(":")
    datasets = {d.lower().replace("fashionmnist", "fashion-mnist"): d for d in TORCHVISION_DATASETS}
    return (datasets[name.lower()], root) if sep and name.lower() in datasets else None


def cache_dir() -> Path:
    """Where silo-sim keeps PNG copies of in-memory datasets between runs: $SILOKIT_CACHE_DIR, else
    $XDG_CACHE_HOME/silokit, else ~/.cache/silokit."""
    if os.environ.get("SILOKIT_CACHE_DIR"):
        return Path(os.environ["SILOKIT_CACHE_DIR"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "silokit"


def as_files(images: ImageSet, name: str) -> ImageSet:
    """`images` as PNG files in the cache, written once per content (a fingerprint of the pixels and labels names
    the folder) and hard-linked by every later staging: encoding 60,000 PNGs took a minute of every silo-sim run
    on the whole Fashion-MNIST. A folder is used only once complete (written aside, then renamed into place), so
    two runs writing the same one at once both end with a whole copy."""
    pixels = images.images.contiguous()
    digest = hashlib.sha256(pixels.numpy().tobytes())
    digest.update(images.labels.numpy().astype("<i8").tobytes())
    digest.update(json.dumps(images.classes).encode())
    shape = "x".join(str(n) for n in pixels.shape)
    folder = cache_dir() / "sim-data" / f"{name}-{shape}-{digest.hexdigest()[:16]}"
    if not (folder / "complete").is_file():
        aside = folder.with_name(f".{folder.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}")
        save_png_folder(images, aside, labeled=True)
        (aside / "complete").write_text("")
        try:
            aside.rename(folder)
        except OSError:  # another run put a complete copy there first
            shutil.rmtree(aside, ignore_errors=True)
    width = len(str(max(len(images) - 1, 0)))
    names = [class_folder_name(k, c, len(images.classes)) for k, c in enumerate(images.classes)]
    paths = [f"{folder}/{names[y]}/{i:0{width}d}.png" for i, y in enumerate(images.labels.tolist())]  # 70,000: no Paths
    size, channels = int(pixels.shape[2]), int(pixels.shape[1])
    return ImageSet(ImageFiles(paths, size, channels, workers=0), images.labels, list(images.classes))


def _folder_source(folder: Path, image_size: int | None) -> SimData:
    """A folder of class sub-folders, listed (not decoded): its files are linked into the staged folders."""
    class_dirs = sorted(d for d in folder.iterdir() if d.is_dir() and not d.name.startswith("."))
    paths, labels = [], []
    for label, class_dir in enumerate(class_dirs):
        found = list_image_files(class_dir)
        paths.extend(found)
        labels.extend([label] * len(found))
    if len(class_dirs) < 2 or not paths:
        raise DataError(f"--data {folder}: needs a folder of class sub-folders (at least two) holding images, "
                        f"e.g. {folder}/cat/1.jpg and {folder}/dog/2.jpg")
    # The model's input follows the data, read as the loader reads it: grayscale or colour, its size.
    channels, side = image_form(paths[0])
    size = image_size or side
    images = ImageFiles(paths, size, channels, workers=0)
    train = ImageSet(images, torch.tensor(labels, dtype=torch.int64), [d.name for d in class_dirs])
    return SimData(train, None, size, channels, f"{len(paths)} images in {len(class_dirs)} classes under {folder}")


def write_images(images: ImageSet, folder: Path, labeled: bool) -> None:
    """Images in memory become PNG files (save_png_folder); files of a folder source are linked under the same
    layout (a class sub-folder each when labeled), keeping their format."""
    if not isinstance(images.images, ImageFiles):
        save_png_folder(images, folder, labeled=labeled)
        return
    width = len(str(max(len(images) - 1, 0)))
    # Strings, not Paths: staging 1,000 silos links 60,000 files, and Path objects were most of its time.
    if labeled:
        # Every class gets its folder, empty where this shard has none of it: a labeled folder's classes are its
        # sub-folders, and a silo refuses one whose names differ from the run's.
        class_dirs = {y: str(folder / name) for y, name in enumerate(staged_class_names(images.classes))}
        targets = [class_dirs[y] for y in images.labels.tolist()]
        for d in class_dirs.values():
            os.makedirs(d, exist_ok=True)
    else:
        targets = [str(folder)] * len(images)
    for d in set(targets):
        os.makedirs(d, exist_ok=True)
    for i, (path, target) in enumerate(zip(images.images.path_strings(), targets, strict=True)):
        link = f"{target}/{i:0{width}d}{os.path.splitext(path)[1].lower()}"
        try:
            os.link(path, link)
        except OSError:  # another file system (or links not allowed): a copy
            shutil.copyfile(path, link)


def staged_class_names(classes: list[str]) -> list[str]:
    """The class folders' names: the classes' own where each is a plain folder name and they sort in label order
    (a folder source's class folders), so the hub's model card names the user's classes and silo-predict takes the
    user's own folders; else silokit's written form for all (class_folder_name: "0_T-shirt_top")."""
    plain = all(c and c == os.path.basename(c) and not c.startswith(".") for c in classes)
    return list(classes) if plain and classes == sorted(classes) else [
        class_folder_name(k, c, len(classes)) for k, c in enumerate(classes)]


def silo_name(i: int) -> str:
    return f"silo-{i:03d}"


def _stratified(images: ImageSet, per_class: int | None, seed: int) -> ImageSet:
    if per_class is None:
        return images
    idx, _ = split_labeled_per_class(images.labels.numpy(), per_class, seed)
    return images.subset(np.sort(idx))


def _take_per_class(labels: np.ndarray, per_class: int, rng: np.random.Generator) -> np.ndarray:
    """Up to per_class random positions of every class present (a silo's shard may hold few of a class)."""
    taken = [rng.permutation(np.flatnonzero(labels == c))[:per_class] for c in np.unique(labels)]
    return np.sort(np.concatenate(taken)) if taken else np.zeros(0, dtype=np.int64)


def stage_federation(
    root: Path,
    *,
    num_silos: int,
    labels_per_class: int,
    partition: str = "iid",
    alpha: float = 0.3,
    classes_per_silo: int = 2,
    unlabeled_limit: int | None = None,
    test_per_class: int | None = None,
    seed: int = 0,
    hub_config: dict[str, Any] | None = None,
    validation_per_class: int | None = None,
    labeled_silos: int = 0,
    silo_labels_per_class: int = 0,
    source: SimData | None = None,
    hub_host: str = "127.0.0.1",
    hub_staged: Callable[[StagedFederation], None] | None = None,
    files: Path | None = None,
) -> StagedFederation:
    """Stage images, certificates and hub.yaml under root. `validation_per_class` adds a held-out labeled split at
    the hub (disjoint from its labels and from the silos' images); the first `labeled_silos` silos keep up to
    `silo_labels_per_class` images per class of their shard as labeled images (partly labeled sites). The images
    come from `source` (default: the bundled demo subset); a source without a test set gives `test_per_class`
    images per class of its pool to the test set (default 100). The hub listens on `hub_host` (loopback unless
    silos on other machines must reach it), which its certificate names beside localhost and 127.0.0.1.
    `hub_staged(staged)` is called once the hub's files and hub.yaml are written, before the silos' (staged.silos
    still empty): silo-sim starts the hub there.

    `files`: where the images and certificates go (default: root; hub.yaml, the hub's and the silos' state always
    go under root): silo_sim/staging_cache.py keeps them there for later runs."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    files = Path(files) if files is not None else root
    source = source or load_source("demo")
    train, test = source.train, source.test
    if test is None:  # held out from the pool before anything else is drawn from it
        test_idx, keep_idx = split_labeled_per_class(train.labels.numpy(), test_per_class or 100, seed + 7)
        train, test = train.subset(np.sort(keep_idx)), train.subset(np.sort(test_idx))
    else:
        test = _stratified(test, test_per_class, seed)
    labeled_idx, rest_idx = split_labeled_per_class(train.labels.numpy(), labels_per_class, seed)
    rng = np.random.default_rng(seed)
    validation = None
    if validation_per_class:
        val_pos, keep_pos = split_labeled_per_class(train.labels[rest_idx].numpy(), validation_per_class, seed + 1)
        validation = train.subset(np.sort(rest_idx[val_pos]))
        rest_idx = rest_idx[keep_pos]
    rest_idx = rng.permutation(rest_idx)
    if unlabeled_limit is not None:
        rest_idx = rest_idx[:unlabeled_limit]
    hub_labeled = train.subset(np.sort(labeled_idx))
    pool = train.subset(rest_idx)
    parts = make_partition(pool.labels.numpy(), num_silos, partition, seed,
                           classes_per_silo=classes_per_silo, alpha=alpha)

    ca_dir = files / "pki" / "ca"
    init_ca(ca_dir)
    dns, ips = ["localhost"], ["127.0.0.1"]
    try:
        ipaddress.ip_address(hub_host)
        ips += [hub_host] if hub_host not in ips else []
    except ValueError:
        dns += [hub_host] if hub_host not in dns else []
    issue_hub(ca_dir, files / "pki" / "hub", dns=dns, ips=ips)
    write_images(hub_labeled, files / "hub" / "labeled", labeled=True)
    write_images(test, files / "hub" / "test", labeled=True)
    if validation is not None:
        write_images(validation, files / "hub" / "validation", labeled=True)

    staged = StagedFederation(root=root, hub_config=root / "hub.yaml", hub_state_dir=root / "hub" / "state",
                              ca_dir=ca_dir, hub_labeled=hub_labeled, test=test)
    write_hub_yaml(staged.hub_config, files, hub_host=hub_host, validation=validation is not None,
                   image_size=source.image_size, channels=source.channels, num_silos=num_silos, seed=seed,
                   hub_config=hub_config)
    if hub_staged is not None:  # the hub's part is complete: its files, its certificate, hub.yaml
        hub_staged(staged)

    # The silos' certificates are issued (one pass over the CA's inventory) while their images are linked or
    # written: the one is mostly cryptography, the other file-system calls.
    names = [silo_name(i) for i in range(1, len(parts) + 1)]
    # The links are made on two threads: os.link waits in the kernel without the GIL, one silo's folder apart from
    # another's, and the hub is the only other process busy at this time.
    with concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="stage-certs") as certs_thread, \
            concurrent.futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="stage-links") as linkers:
        issued = certs_thread.submit(issue_silos, ca_dir, [(name, files / "pki" / "silos" / name) for name in names])
        written = []
        for i, idx in enumerate(parts, start=1):
            name = silo_name(i)
            base = files / "silos" / name
            shard = pool.subset(np.sort(idx))
            labeled, labeled_dir = None, None
            if i <= labeled_silos and silo_labels_per_class > 0:
                picked = _take_per_class(shard.labels.numpy(), silo_labels_per_class, rng)
                labeled, labeled_dir = shard.subset(picked), base / "labeled"
                shard = shard.subset(np.setdiff1d(np.arange(len(shard)), picked))
            data_dir = base / "images" if len(shard) else None
            written.append(linkers.submit(_write_silo_files, base, shard, data_dir, labeled, labeled_dir))
            staged.silos.append(SiloSpec(name, files / "pki" / "silos" / name, data_dir,
                                         root / "silos" / name / "state", base / "labels.json", len(shard),
                                         labeled_dir, len(labeled) if labeled is not None else 0))
        for done in written:
            done.result()  # raises what writing one silo's files raised
        issued.result()
    staged.write()
    return staged


def write_hub_yaml(path: Path, files: Path, *, hub_host: str, validation: bool, image_size: int, channels: int,
                   num_silos: int, seed: int, hub_config: dict[str, Any] | None) -> None:
    """The hub's config at `path`, as an operator would write it, `hub_config` merged over silo-sim's defaults; the
    hub's certificates and folders are those under `files` (relative paths when they sit beside hub.yaml)."""
    def at(rel: str) -> str:
        return rel if files == path.parent else str(files / rel)

    config = {
        "run": {"name": "silo-sim", "seed": seed, "device": "auto", "state_dir": "hub/state"},
        "server": {"host": hub_host, "port": 0, "certs": at("pki/hub"), "linger_s": 10.0},
        "data": {"labeled": {"kind": "imagefolder", "path": at("hub/labeled")},
                 "test": {"kind": "imagefolder", "path": at("hub/test")},
                 **({"validation": {"kind": "imagefolder", "path": at("hub/validation")}} if validation else {})},
        "model": {"name": "small_cnn", "image_size": image_size, "in_channels": channels},
        "algorithm": {"name": "semifl", "options": {}},
        # Sampling and quorum are left to the hub's defaults (every silo, half of them), so that hub_config may set
        # either the fraction or the count key of each (setting both is an error).
        "rounds": {"total": 5, "min_silos": num_silos},
        "metrics": {"host": "127.0.0.1", "port": 0},
    }
    for section, values in (hub_config or {}).items():
        if isinstance(values, dict) and isinstance(config.get(section), dict):
            config[section] = _merge(config[section], values)
        else:
            config[section] = values
    if "factory" in config["model"]:  # the user's own network replaces the default name (setting both is an error)
        config["model"].pop("name", None)
    path.write_text(yaml.safe_dump(config, sort_keys=False))


def _write_silo_files(base: Path, shard: ImageSet, data_dir: Path | None, labeled: ImageSet | None,
                      labeled_dir: Path | None) -> None:
    """One silo's images (unlabeled, and labeled when it has some) and the true labels of the unlabeled ones."""
    if labeled is not None:
        write_images(labeled, labeled_dir, labeled=True)
    if data_dir is not None:
        write_images(shard, data_dir, labeled=False)
    os.makedirs(base, exist_ok=True)
    (base / "labels.json").write_text(json.dumps(shard.labels.tolist()))


def _merge(base: dict, extra: dict) -> dict:
    out = dict(base)
    for k, v in extra.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out
