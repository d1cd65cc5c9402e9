"""A pretrained backbone made here: a network (torchvision/resnet18 or small_cnn) trained supervised on CIFAR-10.

The "bring your own task" question needs a hub that starts from pretrained weights, and nothing may be downloaded,
so this trains one on the CIFAR-10 JPEG folders in ../shared/data (README there) and writes its weights without the
classifier (the network's last linear layer: resnet18's `fc`, small_cnn's `classifier`): loaded with
model.init_weights into a 1-channel Fashion-MNIST model, the stem is summed over colour and the head starts fresh.
500 images per class are held out and never trained on; the accuracy on them is what this script reports (the
CIFAR-10 test split is not here).

    mkdir -p /tmp/cifar10 && tar -xzf ../shared/data/CIFAR10/cifar10-train-jpeg.tar.gz -C /tmp/cifar10
    python bench/quality/pretrain_cifar.py --data /tmp/cifar10/train --epochs 3 --train-per-class 2000 \
        --out bench/quality/results/pretrained/resnet18_cifar10_backbone.safetensors
    python bench/quality/pretrain_cifar.py --data /tmp/cifar10/train --model small_cnn --epochs 10 \
        --out bench/quality/results/pretrained/small_cnn_cifar10_backbone.safetensors
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from silo_core.data import load_labeled_folder  # noqa: E402
from silo_core.models import ModelSpec  # noqa: E402
from silo_core.partition import split_labeled_per_class  # noqa: E402
from silo_core.sbn import compute_static_bn  # noqa: E402
from silo_core.training import (  # noqa: E402
    OptimizerSettings,
    clean_batches,
    cosine_lr,
    evaluate,
    resolve_device,
    seeded_generator,
    train_supervised,
)

CIFAR_MEAN, CIFAR_STD = [0.49, 0.48, 0.45], [0.25, 0.24, 0.26]
MODELS = ("torchvision/resnet18", "small_cnn")


def classifier_prefix(model: torch.nn.Module) -> str:
    """The name of the network's last linear layer, its classifier, with a trailing dot ("fc.", "classifier.")."""
    linear = [name for name, module in model.named_modules() if isinstance(module, torch.nn.Linear)]
    if not linear:
        raise ValueError("the network has no linear layer to leave out as its classifier")
    return linear[-1] + "."


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", type=Path, required=True, help="the unpacked train/ folder (train/<class>/*.jpg)")
    p.add_argument("--out", type=Path, required=True, help="where to write the backbone's safetensors")
    p.add_argument("--model", choices=MODELS, default=MODELS[0])
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--held-out-per-class", type=int, default=500)
    p.add_argument("--train-per-class", type=int, help="train on this many images per class (default: all the rest)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--device", default="auto")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    device = resolve_device(args.device)
    started = time.time()
    data = load_labeled_folder(args.data, 32, 3)
    held_idx, train_idx = split_labeled_per_class(data.labels.numpy(), args.held_out_per_class, args.seed)
    if args.train_per_class is not None:  # a smaller budget for a CPU: the same classes, fewer images of each
        keep, _ = split_labeled_per_class(data.labels.numpy()[train_idx], args.train_per_class, args.seed + 1)
        train_idx = train_idx[keep]
    train, held = data.subset(np.sort(train_idx)), data.subset(np.sort(held_idx))
    print(f"{len(train)} training and {len(held)} held-out images ({time.time() - started:.0f}s to load)", flush=True)
    spec = ModelSpec(args.model, num_classes=len(data.classes), in_channels=3, image_size=32,
                     mean=CIFAR_MEAN, std=CIFAR_STD)
    torch.manual_seed(args.seed)
    model = spec.build()
    generator = seeded_generator(args.seed)
    log = []
    for epoch in range(1, args.epochs + 1):
        lr = cosine_lr(args.lr, epoch, args.epochs)
        loss = train_supervised(model, train.images, train.labels, epochs=1, batch_size=args.batch_size, lr=lr,
                                opt=OptimizerSettings(), mean=spec.mean, std=spec.std, device=device,
                                generator=generator)
        # Static BN, as the kit's hub does: the global statistics from one clean pass over the training images.
        compute_static_bn(model, clean_batches(train.images, spec.mean, spec.std, device))
        scores = evaluate(model, held.images, held.labels, spec.mean, spec.std, device)
        log.append({"epoch": epoch, "lr": lr, "loss": loss, "held_out_accuracy": scores["accuracy"],
                    "seconds": time.time() - started})
        print(f"epoch {epoch}: loss {loss:.3f}, held-out accuracy {100 * scores['accuracy']:.2f}% "
              f"({time.time() - started:.0f}s)", flush=True)
    head = classifier_prefix(model)
    backbone = {k: v.contiguous() for k, v in model.state_dict().items() if not k.startswith(head)}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    save_file(backbone, str(args.out))
    args.out.with_suffix(".json").write_text(json.dumps({
        "model": spec.name, "trained_on": "CIFAR-10 training split (JPEG q75), 32x32 RGB, less the held-out images",
        "held_out_per_class": args.held_out_per_class, "train_images": len(train), "epochs": args.epochs, "lr": args.lr,
        "batch_size": args.batch_size, "seed": args.seed, "device": str(device), "threads": args.threads,
        "log": log, "left_out": f"{head}* (the classifier): the target task's head starts fresh",
    }, indent=2))
    print(f"wrote {args.out} ({len(backbone)} tensors)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
