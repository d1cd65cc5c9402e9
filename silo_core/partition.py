"""Splitting a labeled pool into the hub's labeled set and the silos' (unlabeled) shards.

Every function is deterministic given ``seed`` (``np.random.default_rng(seed)``) and every partition is a
disjoint cover: each item index lands in exactly one silo. Indices within a silo are returned sorted.
"""

from __future__ import annotations

import numpy as np

SCHEMES = ("iid", "classes", "dirichlet")


def _as_labels(labels: np.ndarray) -> np.ndarray:
    arr = np.asarray(labels)
    if arr.ndim != 1:
        raise ValueError(f"labels must be a 1-D array, got shape {arr.shape}")
    if arr.size and not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"labels must be integers, got dtype {arr.dtype}")
    return arr


def _check_silos(num_items: int, num_silos: int) -> None:
    if num_silos < 1:
        raise ValueError(f"num_silos must be at least 1, got {num_silos}")
    if num_items < num_silos:
        raise ValueError(f"cannot give {num_silos} silos at least one item each from only {num_items} items; "
                         f"use fewer silos or more data")


def split_labeled_per_class(labels: np.ndarray, per_class: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Stratified split: ``per_class`` random items of every class (labeled) and the rest, both sorted."""
    labels = _as_labels(labels)
    if per_class < 0:
        raise ValueError(f"per_class must be >= 0, got {per_class}")
    rng = np.random.default_rng(seed)
    picked = []
    for c in np.unique(labels):
        members = np.flatnonzero(labels == c)
        if len(members) < per_class:
            raise ValueError(f"class {c} has only {len(members)} items, fewer than the {per_class} labeled "
                             f"per class asked for; lower labels per class")
        picked.append(rng.choice(members, size=per_class, replace=False))
    labeled = np.sort(np.concatenate(picked)).astype(np.int64) if picked else np.zeros(0, dtype=np.int64)
    mask = np.ones(len(labels), dtype=bool)
    mask[labeled] = False
    return labeled, np.flatnonzero(mask).astype(np.int64)


def partition_iid(num_items: int, num_silos: int, seed: int) -> list[np.ndarray]:
    """Uniformly random shards whose sizes differ by at most one."""
    _check_silos(num_items, num_silos)
    perm = np.random.default_rng(seed).permutation(num_items)
    return [np.sort(part).astype(np.int64) for part in np.array_split(perm, num_silos)]


def partition_classes(labels: np.ndarray, num_silos: int, classes_per_silo: int, seed: int) -> list[np.ndarray]:
    """Pathological non-IID split (FedAvg / SemiFL shards): each silo holds exactly ``classes_per_silo`` classes.

    Classes are dealt to silos so that every class is used and class popularity differs by at most one
    (each silo takes the least-used classes, ties broken at random); then each class's items are shuffled and
    cut into equal shards, one per silo holding that class.
    """
    labels = _as_labels(labels)
    _check_silos(len(labels), num_silos)
    classes = np.unique(labels)
    k, num_classes = classes_per_silo, len(classes)
    if not 1 <= k <= num_classes:
        raise ValueError(f"classes_per_silo must be between 1 and the number of classes ({num_classes}), got {k}")
    if num_silos * k < num_classes:
        raise ValueError(f"{num_silos} silos x {k} classes each cannot cover all {num_classes} classes; "
                         f"use more silos or more classes per silo")
    rng = np.random.default_rng(seed)
    uses = np.zeros(num_classes, dtype=np.int64)
    silo_classes: list[np.ndarray] = []
    for _ in range(num_silos):
        order = np.lexsort((rng.random(num_classes), uses))  # least used first, random among equals
        chosen = order[:k]
        uses[chosen] += 1
        silo_classes.append(chosen)
    parts: list[list[np.ndarray]] = [[] for _ in range(num_silos)]
    for ci, c in enumerate(classes):
        holders = [s for s in range(num_silos) if ci in silo_classes[s]]
        members = rng.permutation(np.flatnonzero(labels == c))
        if len(members) < len(holders):
            raise ValueError(f"class {c} has {len(members)} items but {len(holders)} silos should hold it; "
                             f"use fewer silos or fewer classes per silo")
        for silo, shard in zip(holders, np.array_split(members, len(holders)), strict=True):
            parts[silo].append(shard)
    return [np.sort(np.concatenate(p)).astype(np.int64) for p in parts]


def partition_dirichlet(labels: np.ndarray, num_silos: int, alpha: float, seed: int,
                        min_size: int = 1, max_tries: int = 1000) -> list[np.ndarray]:
    """Label-skewed split: every class's items are shared out in proportions drawn from Dir(alpha, ..., alpha).

    Small ``alpha`` (e.g. 0.1) gives each silo a few dominant classes; large ``alpha`` tends to IID.
    Whole draws are repeated until every silo holds at least ``min_size`` items.
    """
    labels = _as_labels(labels)
    _check_silos(len(labels), num_silos)
    if alpha <= 0:
        raise ValueError(f"alpha must be positive, got {alpha}")
    if min_size * num_silos > len(labels):
        raise ValueError(f"{num_silos} silos x min_size {min_size} exceeds the {len(labels)} items")
    rng = np.random.default_rng(seed)
    classes = np.unique(labels)
    for _ in range(max_tries):
        parts: list[list[np.ndarray]] = [[] for _ in range(num_silos)]
        for c in classes:
            members = rng.permutation(np.flatnonzero(labels == c))
            share = rng.dirichlet(np.full(num_silos, float(alpha)))
            cuts = (np.cumsum(share)[:-1] * len(members)).astype(np.int64)
            for silo, shard in enumerate(np.split(members, cuts)):
                parts[silo].append(shard)
        result = [np.sort(np.concatenate(p)).astype(np.int64) for p in parts]
        if min(len(r) for r in result) >= min_size:
            return result
    raise ValueError(f"no Dirichlet(alpha={alpha}) draw gave all {num_silos} silos at least {min_size} items in "
                     f"{max_tries} tries; raise alpha, lower min_size or use fewer silos")


def make_partition(labels: np.ndarray, num_silos: int, scheme: str, seed: int,
                   classes_per_silo: int = 2, alpha: float = 0.3) -> list[np.ndarray]:
    """Dispatch on ``scheme``: "iid", "classes" (``classes_per_silo`` each) or "dirichlet" (``alpha``)."""
    labels = _as_labels(labels)
    if scheme == "iid":
        return partition_iid(len(labels), num_silos, seed)
    if scheme == "classes":
        return partition_classes(labels, num_silos, classes_per_silo, seed)
    if scheme == "dirichlet":
        return partition_dirichlet(labels, num_silos, alpha, seed)
    raise ValueError(f"unknown partition scheme {scheme!r}; choose one of {', '.join(SCHEMES)}")
