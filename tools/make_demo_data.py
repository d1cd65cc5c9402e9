"""Build silo_core/demo_data/fashion_mnist_demo.npz, the small image set the offline demo runs on.

A stratified, deterministic (seed 0) subset of the official Fashion-MNIST files: 600 train and 200 test images
per class. Reads the torchvision layout (ROOT/FashionMNIST/raw/*-idx?-ubyte[.gz]) and never downloads.

    python tools/make_demo_data.py --root /path/to/data
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from silo_core.data import DEMO_FILE, load_torchvision

TRAIN_PER_CLASS = 600
TEST_PER_CLASS = 200
SEED = 0
OUT = Path(__file__).resolve().parent.parent / "silo_core" / "demo_data" / DEMO_FILE


def stratified(labels: np.ndarray, per_class: int, rng: np.random.Generator) -> np.ndarray:
    """``per_class`` random indices of every class, returned in the original (sorted) order."""
    picks = []
    for c in np.unique(labels):
        members = np.flatnonzero(labels == c)
        if len(members) < per_class:
            raise SystemExit(f"class {c} has only {len(members)} images, {per_class} needed")
        picks.append(rng.choice(members, size=per_class, replace=False))
    return np.sort(np.concatenate(picks))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--root", default="/work/shared/data", help="folder holding FashionMNIST/raw")
    parser.add_argument("--out", type=Path, default=OUT, help="npz file to write")
    args = parser.parse_args(argv)

    rng = np.random.default_rng(SEED)
    arrays: dict[str, np.ndarray] = {}
    classes: list[str] = []
    for split, train, per_class in (("train", True, TRAIN_PER_CLASS), ("test", False, TEST_PER_CLASS)):
        full = load_torchvision("FashionMNIST", args.root, train=train, image_size=28, channels=1)
        labels = full.labels.numpy()
        idx = stratified(labels, per_class, rng)
        arrays[f"{split}_images"] = full.images[idx, 0].numpy().astype(np.uint8)
        arrays[f"{split}_labels"] = labels[idx].astype(np.uint8)
        classes = full.classes
    args.out.parent.mkdir(parents=True, exist_ok=True)
    # Fixed-width unicode, not an object array, so np.load works with allow_pickle=False.
    np.savez_compressed(args.out, classes=np.array(classes, dtype=np.str_), **arrays)
    sizes = {k: v.shape for k, v in arrays.items()}
    print(f"wrote {args.out} ({args.out.stat().st_size / 1e6:.2f} MB): {sizes}")


if __name__ == "__main__":
    main()
