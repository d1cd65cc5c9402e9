"""SemiFL's CIFAR-10 setting (its paper's Table 1, N_S = 250, IID), on the CIFAR-10 JPEG folders in ../shared/data.

    python bench/quality/cifar10.py --tar ../shared/data/CIFAR10/cifar10-train-jpeg.tar.gz --device cuda \
        --stop-after 30 --out bench/quality/results/cifar10-semifl            # a GPU's first 30 of 800 rounds
    python bench/quality/cifar10.py --data /tmp/cifar10/train ...          # an unpacked train/ folder instead

The paper's federation and budget: 250 labels at the hub (25 per class), 100 silos of the other images, 10 of them a
round, WRN-28-2, SemiFL's own options (tau 0.95, 5 local epochs in batches of 10, 5 hub epochs in batches of 10,
SGD lr 0.03 with Nesterov momentum on a cosine schedule over the planned rounds, 800 in the paper). Only the
training split is in ../shared/data, so 500 images per class are held out of it as the test set (the same ones for
every seed and method; JPEG quality 75, so expect to sit a little below published numbers), and the quality
benchmark's validation split (25 per class, for the round the hub keeps) comes out of the rest. `--stop-after N`
runs the first N rounds of that schedule: a point on the paper's curve, not its final number. Each cell runs the
deployment's algorithm objects in one process, as every cell of bench/quality/run.py does (run_cell).

Writes results.json (every cell, every round; a rerun keeps cells already run with the same settings) and table.md
beside the paper's numbers (server-only 42.4%, SemiFL 88.2% after 800 rounds).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tarfile
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import run as quality  # noqa: E402

from silo_core.data import load_labeled_folder  # noqa: E402
from silo_core.files import write_json_atomic  # noqa: E402
from silo_core.partition import split_labeled_per_class  # noqa: E402
from silo_core.training import resolve_device  # noqa: E402

CIFAR_MEAN, CIFAR_STD = [0.4914, 0.4822, 0.4465], [0.2470, 0.2435, 0.2616]  # the training split's, per channel
PAPER = {"server-only": 42.4, "semifl": 88.2}  # SemiFL paper Table 1: CIFAR-10, N_S = 250, IID, 800 rounds
TEST_SEED = 12345  # which images are held out as the test set: one draw for every cell


def unpack(tar: Path, into: Path, per_class: int | None) -> Path:
    """The tarball's train/<class>/*.jpg under `into` (at most `per_class` images a class); returns train/."""
    taken: Counter[str] = Counter()
    with tarfile.open(tar) as archive:
        for member in archive:
            parts = Path(member.name).parts
            if not member.isfile() or len(parts) != 3 or parts[0] != "train":
                continue
            if per_class is not None and taken[parts[1]] >= per_class:
                continue
            archive.extract(member, into, filter="data")  # no absolute paths, links or device files
            taken[parts[1]] += 1
    if not taken:
        raise SystemExit(f"{tar} holds no train/<class>/<image> files; is it the CIFAR-10 tarball of ../shared/data?")
    return into / "train"


def split_test(dataset, per_class: int):
    """(the rest, the held-out test set): `per_class` images of every class, the same draw for every cell."""
    test_idx, rest_idx = split_labeled_per_class(dataset.labels.numpy(), per_class, TEST_SEED)
    return dataset.subset(np.sort(rest_idx)), dataset.subset(np.sort(test_idx))


def machine_line(info: dict[str, Any]) -> str:
    """"NVIDIA H200, torch 2.11.0+cu130" or "Intel(R) Xeon(R) Processor (2 cores), torch ...": where a cell ran."""
    where = info.get("gpu") or f"{info.get('cpu', 'CPU')} ({info.get('cpu_count')} cores)"
    return f"{where}, torch {info.get('torch')}"


def table(cells: list[dict[str, Any]], settings: dict[str, Any]) -> str:
    rounds = f"the first {settings['stop_after']} of {settings['rounds']}" if settings["stop_after"] else \
        str(settings["rounds"])
    machines = sorted({machine_line(c["machine"]) for c in cells})
    lines = [f"# SemiFL's CIFAR-10 setting ({settings['model']}, 250 labels, IID, {rounds} rounds)", "",
             f"Test: {settings['test_per_class']} held-out training images per class. Machine: "
             f"{'; '.join(machines) or '-'}.", "",
             "| method | seed | final accuracy | best validation round (its test accuracy) | paper, 800 rounds | "
             "seconds |", "|---|---|---|---|---|---|"]
    for c in cells:
        lines.append(f"| {c['method']} | {c['seed']} | {100 * c['final_accuracy']:.2f}% | {c['best_round']} "
                     f"({100 * c['best_round_test_accuracy']:.2f}%) | {PAPER.get(c['method'], '-')}% | "
                     f"{c['seconds']:.0f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--tar", type=Path, help="../shared/data/CIFAR10/cifar10-train-jpeg.tar.gz (unpacked to a "
                        "temporary folder)")
    source.add_argument("--data", type=Path, help="an unpacked train/ folder (train/<class>/*.jpg)")
    p.add_argument("--out", type=Path, required=True, help="folder for results.json and table.md")
    p.add_argument("--methods", nargs="+", default=["server-only", "semifl"], choices=["server-only", "semifl"])
    p.add_argument("--seeds", nargs="+", type=int, default=[0])
    p.add_argument("--rounds", type=int, default=800, help="the rounds the schedule is planned over (paper: 800)")
    p.add_argument("--stop-after", type=int, help="run only this many of them")
    p.add_argument("--model", default="wrn28_2", help="a model name as run.py's --model (paper: wrn28_2)")
    p.add_argument("--test-per-class", type=int, default=500)
    p.add_argument("--per-class", type=int, help="use only this many images of each class (smoke tests)")
    p.add_argument("--silos", type=int, default=100)
    p.add_argument("--eval-every", type=int, default=10)
    p.add_argument("--device", default="auto")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    args = p.parse_args(argv)
    if args.stop_after is not None and not 1 <= args.stop_after <= args.rounds:
        p.error(f"--stop-after must be between 1 and --rounds ({args.rounds}), got {args.stop_after}")
    torch.set_num_threads(args.threads)
    device = resolve_device(args.device)

    with tempfile.TemporaryDirectory() as tmp:
        folder = unpack(args.tar, Path(tmp), args.per_class) if args.tar else args.data
        started = time.time()
        images = load_labeled_folder(folder, 32, 3, cache_mb=1 << 20)  # 50,000 x 3 x 32 x 32 bytes: in memory
        print(f"loaded {len(images)} images of {len(images.classes)} classes in {time.time() - started:.0f} s",
              flush=True)
    train, test = split_test(images, args.test_per_class)
    profile = quality.Profile(rounds=args.rounds, num_silos=args.silos, silos_per_round=0.1, unlabeled_limit=None,
                              test_limit=None, seeds=list(args.seeds), headline_seeds=list(args.seeds),
                              eval_every=args.eval_every, methods=list(args.methods), partitions=["iid"])
    settings = {"rounds": args.rounds, "stop_after": args.stop_after, "model": args.model, "silos": args.silos,
                "test_per_class": args.test_per_class, "per_class": args.per_class, "train_images": len(train)}
    args.out.mkdir(parents=True, exist_ok=True)
    results = args.out / "results.json"
    kept = [c for c in (json.loads(results.read_text()).get("cells", []) if results.exists() else [])
            if c.get("settings") == settings]
    for method in args.methods:
        for seed in args.seeds:
            if any(c["method"] == method and c["seed"] == seed for c in kept):
                print(f"{method} seed {seed}: kept from {results}")
                continue
            cell = quality.run_cell(method, "iid", seed, profile, train, test, device, model=args.model,
                                    normalize=(CIFAR_MEAN, CIFAR_STD), stop_after=args.stop_after)
            cell.update(settings=settings, machine=quality.machine())
            kept.append(cell)
            write_json_atomic(results, {"cells": kept})
            print(f"{method} seed {seed}: {100 * cell['final_accuracy']:.2f}% after {cell['history'][-1]['round']} "
                  f"rounds ({cell['seconds']:.0f} s)", flush=True)
    (args.out / "table.md").write_text(table(kept, settings))
    print(table(kept, settings))
    return 0


if __name__ == "__main__":
    sys.exit(main())
