"""silo-predict --model STATE_DIR DIR: classify every image under a folder with a hub's trained model.

Writes one CSV row per readable image: its path (relative to the folder), the predicted class and its softmax
confidence, then the next most likely classes (--top-k in all). Unreadable files are skipped, counted and named on
stderr, never fatal. With --labeled DIR (one sub-folder per class, named as the model card's classes) it also
reports the accuracy, each class's recall and the confusion matrix: as text, as a PNG and in a JSON file.

Images are read in batches (memory stays flat however large the folder) exactly as the hub reads its test set:
decoded, converted to the card's channel count, resized to its image size, normalised with its mean/std."""

from __future__ import annotations

import argparse
import csv
import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from PIL import Image, ImageDraw, ImageFont
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from silo_core.data import IMAGE_EXTENSIONS, DataError, class_folder_name, list_image_files, load_image_file
from silo_core.training import resolve_device
from silo_tools.card import CardError, TrainedModel, add_model_arguments, error, load_trained_model

SHOW_SKIPPED = 20  # unreadable files named one per line on stderr; the rest counted


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="silo-predict",
        description="Classify a folder of images (recursively) with the model in a silokit hub's state folder and "
                    "write a CSV: path, class, confidence and the next most likely classes. With --labeled, also "
                    "report accuracy, per-class recall and the confusion matrix (text, PNG, JSON).")
    add_model_arguments(p)
    p.add_argument("images", nargs="?", metavar="DIR", help="a folder of images, searched recursively "
                   f"({', '.join(IMAGE_EXTENSIONS)})")
    p.add_argument("--labeled", metavar="DIR", type=Path,
                   help="instead of DIR: a labeled folder (one sub-folder per class, named as the model card's "
                        "classes); also writes OUT_metrics.json and OUT_confusion.png beside the CSV")
    p.add_argument("--out", type=Path, default=Path("predictions.csv"), help="the CSV to write "
                   "(default: predictions.csv)")
    p.add_argument("--force", action="store_true", help="overwrite the output files if they exist")
    p.add_argument("--top-k", type=int, default=3, help="classes per image in the CSV, most likely first "
                   "(default: 3)")
    p.add_argument("--batch-size", type=int, default=64, help="images per forward pass (default: 64)")
    p.add_argument("--device", default="auto", help="auto (CUDA when present), cpu, cuda or cuda:N")
    p.add_argument("--quiet", "-q", action="store_true", help="no progress bar and no summary on stderr")
    return p


def labeled_files(root: Path, classes: list[str]) -> tuple[list[tuple[Path, int]], list[tuple[Path, str]]]:
    """(image, class index) for every image in root's class sub-folders, and the loose images directly under
    root, which belong to no class. Every sub-folder must be one of the model's classes."""
    folders = sorted((d for d in root.iterdir() if d.is_dir() and not d.name.startswith(".")), key=lambda d: d.name)
    if not folders:
        raise DataError(f"labeled folder {root} has no class sub-folders; put each class's images in a sub-folder "
                        f"named as the model's class (e.g. {root}/{classes[0]}/1.png), or pass it as DIR instead")
    # A folder is named as its class, or as silokit writes class folders (class_folder_name: "0_T-shirt_top", as a
    # class name may hold a "/" no folder can).
    index = {**{class_folder_name(k, c, len(classes)): k for k, c in enumerate(classes)},
             **{c: k for k, c in enumerate(classes)}}
    unknown = [d.name for d in folders if d.name not in index]
    if unknown:
        written = ", ".join(class_folder_name(k, c, len(classes)) for k, c in enumerate(classes))
        raise DataError(f"{root}/{unknown[0]} is not one of the model's classes ({', '.join(classes)}); name each "
                        f"class folder as the model card's class, or as silokit writes them ({written})")
    files = [(path, index[d.name]) for d in folders for path in list_image_files(d)]
    loose = [(f, "not inside a class sub-folder; ignored") for f in sorted(root.iterdir())
             if f.is_file() and not f.name.startswith(".") and f.name.lower().endswith(IMAGE_EXTENSIONS)]
    return files, loose


def output_paths(out: Path, labeled: bool) -> list[Path]:
    paths = [out]
    if labeled:
        paths += [out.with_name(out.stem + "_metrics.json"), out.with_name(out.stem + "_confusion.png")]
    return paths


def batches(items: list[tuple[Path, int]], size: int) -> Iterator[list[tuple[Path, int]]]:
    for start in range(0, len(items), size):
        yield items[start:start + size]


def csv_header(top_k: int, labeled: bool) -> list[str]:
    header = ["path"] + (["label"] if labeled else []) + ["class", "confidence"]
    for j in range(2, top_k + 1):
        header += [f"class_{j}", f"confidence_{j}"]
    return header


def predict(trained: TrainedModel, files: list[tuple[Path, int]], root: Path, writer: Any, top_k: int,
            batch_size: int, device: torch.device, labeled: bool, progress: Progress
            ) -> tuple[int, torch.Tensor, list[tuple[Path, str]]]:
    """Write one row per readable image; returns how many, the confusion matrix (rows: true class, columns:
    predicted; zeros without labels) and the skipped files with the reason."""
    k = len(trained.classes)
    confusion = torch.zeros(k, k, dtype=torch.int64)
    skipped: list[tuple[Path, str]] = []
    done = 0
    model = trained.model.to(device)
    task = progress.add_task("predicting", total=len(files))
    for chunk in batches(files, batch_size):
        images, kept = [], []
        for path, label in chunk:
            try:
                images.append(load_image_file(path, trained.spec.image_size, trained.spec.in_channels))
                kept.append((path, label))
            except DataError as err:  # one bad file never stops the run
                skipped.append((path, str(err).removeprefix(f"cannot read image {path}: ")))
        if images:
            with torch.inference_mode():
                logits = model(trained.inputs(torch.stack(images)).to(device)).float()
            probs = torch.softmax(logits, dim=1).cpu()
            conf, idx = probs.topk(top_k, dim=1)
            for (path, label), c_row, i_row in zip(kept, conf.tolist(), idx.tolist(), strict=True):
                row = [path.relative_to(root).as_posix()] + ([trained.classes[label]] if labeled else [])
                for c, i in zip(c_row, i_row, strict=True):
                    row += [trained.classes[i], f"{c:.6f}"]
                writer.writerow(row)
                if labeled:
                    confusion[label, i_row[0]] += 1
            done += len(kept)
        progress.advance(task, len(chunk))
    return done, confusion, skipped


def labeled_metrics(confusion: torch.Tensor, classes: list[str]) -> dict[str, Any]:
    """Accuracy, each class's recall (None for a class without images) and their mean, from the confusion
    matrix (rows: true class, columns: predicted class)."""
    total = int(confusion.sum())
    correct = int(confusion.diagonal().sum())
    per_class = {}
    for i, name in enumerate(classes):
        n, hit = int(confusion[i].sum()), int(confusion[i, i])
        per_class[name] = {"images": n, "correct": hit, "recall": hit / n if n else None}
    recalls = [v["recall"] for v in per_class.values() if v["recall"] is not None]
    return {
        "images": total,
        "correct": correct,
        "accuracy": correct / total if total else None,
        "mean_recall": sum(recalls) / len(recalls) if recalls else None,
        "per_class": per_class,
        "confusion_matrix": {"rows": "true class", "columns": "predicted class", "classes": classes,
                             "counts": confusion.tolist()},
    }


def metrics_text(metrics: dict[str, Any]) -> str:
    classes = metrics["confusion_matrix"]["classes"]
    counts = metrics["confusion_matrix"]["counts"]
    acc = metrics["accuracy"]
    lines = [f"accuracy {100 * acc:.2f}% ({metrics['correct']} of {metrics['images']} images)" if acc is not None
             else "accuracy: no images"]
    if metrics["mean_recall"] is not None:
        lines.append(f"mean per-class recall {100 * metrics['mean_recall']:.2f}%")
    lines.append("per-class recall:")
    width = max(len(c) for c in classes)
    for i, (name, v) in enumerate(metrics["per_class"].items()):
        recall = f"{100 * v['recall']:6.2f}%" if v["recall"] is not None else "     -  "
        lines.append(f"  {i:>3} {name:<{width}}  {recall} ({v['correct']} of {v['images']})")
    cell = max(4, len(str(max(max(r) for r in counts))) + 1, len(str(len(classes) - 1)) + 1)
    lines.append("confusion matrix (rows: true class, columns: predicted class, numbered as above):")
    lines.append("     " + "".join(f"{j:>{cell}}" for j in range(len(classes))))
    for i, row in enumerate(counts):
        lines.append(f"  {i:>3}" + "".join(f"{v:>{cell}}" for v in row))
    return "\n".join(lines)


def draw_confusion(metrics: dict[str, Any], path: Path, title: str) -> None:
    """The confusion matrix as a PNG, drawn with Pillow: each cell's shade is its share of the true class's
    images, with the count written in it; rows are true classes (named), columns predicted (numbered)."""
    classes = metrics["confusion_matrix"]["classes"]
    counts = metrics["confusion_matrix"]["counts"]
    font = ImageFont.load_default()
    k, cell, pad = len(classes), 40, 10
    labels = [f"{i} {name[:28]}" for i, name in enumerate(classes)]
    probe = ImageDraw.Draw(Image.new("RGB", (1, 1)))

    def text_width(s: str) -> int:
        return int(probe.textbbox((0, 0), s, font=font)[2])

    left = pad + max(text_width(s) for s in labels) + pad
    top = pad + 3 * 16
    width = max(left + k * cell + pad, pad + text_width(title) + pad)
    image = Image.new("RGB", (width, top + k * cell + pad + 16), "white")
    draw = ImageDraw.Draw(image)
    draw.text((pad, pad), title, fill="black", font=font)
    draw.text((pad, pad + 16), "rows: true class, columns: predicted class", fill="black", font=font)
    for j in range(k):
        draw.text((left + j * cell + cell // 2 - text_width(str(j)) // 2, top - 16), str(j), fill="black", font=font)
    for i, row in enumerate(counts):
        total = sum(row)
        y = top + i * cell
        draw.text((pad, y + cell // 2 - 6), labels[i], fill="black", font=font)
        for j, v in enumerate(row):
            share = v / total if total else 0.0
            shade = (int(255 - 200 * share), int(255 - 140 * share), 255)  # white to blue
            x = left + j * cell
            draw.rectangle((x, y, x + cell - 1, y + cell - 1), fill=shade, outline=(200, 200, 200))
            text = str(v)
            draw.text((x + cell // 2 - text_width(text) // 2, y + cell // 2 - 6), text,
                      fill="white" if share > 0.6 else "black", font=font)
    acc = metrics["accuracy"]
    if acc is not None:
        draw.text((pad, top + k * cell + 4), f"accuracy {100 * acc:.2f}% of {metrics['images']} images",
                  fill="black", font=font)
    image.save(path)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if (args.images is None) == (args.labeled is None):
        return error("give a folder of images (DIR) or a labeled folder (--labeled DIR), one of the two")
    if args.top_k < 1:
        return error(f"--top-k must be at least 1, got {args.top_k}")
    if args.batch_size < 1:
        return error(f"--batch-size must be at least 1, got {args.batch_size}")
    labeled = args.labeled is not None
    outputs = output_paths(args.out, labeled)
    existing = [p for p in outputs if p.exists()]
    if existing and not args.force:
        return error(f"{existing[0]} exists; pass --force to overwrite it, or --out another file")
    try:
        device = resolve_device(args.device)
        trained = load_trained_model(args.model, final=args.final, model_factory=args.model_factory)
        root = Path(args.labeled if labeled else args.images)
        if not root.is_dir():
            raise DataError(f"{root} is not a folder of images; check the path")
        if labeled:
            files, skipped = labeled_files(root, trained.classes)
        else:
            files, skipped = [(p, -1) for p in list_image_files(root)], []
        if not files:
            raise DataError(f"no images found under {root} (looked recursively for {', '.join(IMAGE_EXTENSIONS)})")
    except (CardError, DataError, ValueError) as err:
        return error(str(err))

    top_k = min(args.top_k, len(trained.classes))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    tmp = args.out.with_name(args.out.name + ".tmp")
    console = Console(stderr=True)
    show = not args.quiet and sys.stderr.isatty()
    with open(tmp, "w", newline="") as f, Progress(TextColumn("{task.description}"), BarColumn(),
                                                   MofNCompleteColumn(), TimeRemainingColumn(), console=console,
                                                   disable=not show) as progress:
        writer = csv.writer(f)
        writer.writerow(csv_header(top_k, labeled))
        done, confusion, unreadable = predict(trained, files, root, writer, top_k, args.batch_size, device, labeled,
                                              progress)
    skipped += unreadable
    for path, reason in skipped[:SHOW_SKIPPED]:
        print(f"skipped {path}: {reason}", file=sys.stderr)
    if len(skipped) > SHOW_SKIPPED:
        print(f"... and {len(skipped) - SHOW_SKIPPED} more skipped files", file=sys.stderr)
    if done == 0:
        tmp.unlink()
        path, reason = (unreadable or skipped)[0]  # the reason the files could not be read, not a loose file's
        return error(f"none of the {len(files)} image files under {root} could be read (e.g. {path}: {reason})")
    os.replace(tmp, args.out)

    if labeled:
        metrics = labeled_metrics(confusion, trained.classes)
        metrics["skipped"] = [{"path": str(p), "reason": r} for p, r in skipped]
        metrics["model"] = {"state_dir": str(args.model), "weights_file": trained.weights.name,
                            "weights_sha256": trained.weights_sha256, "round": trained.round, "which": trained.which}
        outputs[1].write_text(json.dumps(metrics, indent=2) + "\n")
        draw_confusion(metrics, outputs[2], f"{trained.spec.label}, {trained.weights.name} (round {trained.round}) "
                                            f"on {root.name}")
        print(metrics_text(metrics))
    if not args.quiet:
        extra = f", {outputs[1]}, {outputs[2]}" if labeled else ""
        print(f"{done} images classified with {trained.describe()}; {len(skipped)} skipped; wrote {args.out}{extra}",
              file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
