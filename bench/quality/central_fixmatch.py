"""What could this network learn from the same images if they were not federated? FixMatch in one place.

    python bench/quality/central_fixmatch.py --steps 24000 --out bench/quality/results/ablations/central-fixmatch
    python bench/quality/central_fixmatch.py ... --head flatten   # small_cnn's flatten head, as run.py's --head

A reference row for the quality table, not a federated method. It takes the full profile's data for one seed (the
hub's 250 labels, the 59,500 silo images pooled in one place without their labels, the 10,000 test images), the
same small_cnn, augmentations, optimiser and static batch norm, and trains FixMatch's joint loss (Sohn et al. 2020):

    every step: a batch of B labeled images (weak view) and mu * B unlabeled ones (weak and strong views)
        loss = CE(f(a(x_l)), y_l)
             + lambda_u * mean over the unlabeled batch of [max p(a(u)) >= tau] * CE(f(A(u)), argmax p(a(u)))
    one forward pass over all three views (batch norm sees them together, as in FixMatch), pseudo-labels detached
    evaluation: an exponential moving average of the weights (FixMatch's), with static BN statistics of the hub's
    labeled images (as SemiFL serves its model)

The distance from SemiFL to this row is what federating the unlabeled images costs; from this row to the fully
labeled ceiling, what having 250 labels costs this network and augmentation recipe even with every image in one
place. Writes results.json (every evaluation) into --out.
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
import time
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import run as quality  # noqa: E402

from silo_core.algorithms.fedavg_fixmatch import fixmatch_loss as unlabeled_fixmatch_loss  # noqa: E402
from silo_core.augment import strong_augment, to_float, weak_augment  # noqa: E402
from silo_core.files import write_json_atomic  # noqa: E402
from silo_core.models import HEADS, ModelSpec, count_parameters  # noqa: E402
from silo_core.sbn import compute_static_bn  # noqa: E402
from silo_core.training import (  # noqa: E402
    OptimizerSettings,
    clean_batches,
    cosine_lr,
    evaluate,
    make_sgd,
    resolve_device,
    seeded_generator,
    sgd_step,
)


@torch.no_grad()
def update_ema(ema: nn.Module, model: nn.Module, decay: float) -> None:
    for e, p in zip(ema.parameters(), model.parameters(), strict=True):
        e.mul_(decay).add_(p.detach(), alpha=1.0 - decay)


def fixmatch_loss(logits_labeled: torch.Tensor, labels: torch.Tensor, logits_weak: torch.Tensor,
                  logits_strong: torch.Tensor, tau: float, unlabeled_weight: float) -> tuple[torch.Tensor, torch.Tensor]:
    """FixMatch's joint loss (the labeled batch's CE plus the silos' unlabeled FixMatch term, the same function
    FedAvg+FixMatch trains with) and the mask of unlabeled images whose weak-view confidence reaches tau (1.0 or 0.0)."""
    unlabeled, _, mask = unlabeled_fixmatch_loss(logits_weak, logits_strong, tau)
    return F.cross_entropy(logits_labeled, labels) + unlabeled_weight * unlabeled, mask.float()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True, help="folder for results.json")
    p.add_argument("--steps", type=int, default=24000, help="training steps (the cosine schedule spans them)")
    p.add_argument("--seed", type=int, default=0, help="the full profile's seed whose data split is used")
    p.add_argument("--labeled-batch", type=int, default=16, help="B: labeled images per step (the hub's batch)")
    p.add_argument("--mu", type=int, default=7, help="unlabeled images per labeled image in a step (FixMatch: 7)")
    p.add_argument("--tau", type=float, default=0.95, help="pseudo-label confidence threshold (FixMatch: 0.95)")
    p.add_argument("--unlabeled-weight", type=float, default=1.0, help="lambda_u (FixMatch: 1)")
    p.add_argument("--lr", type=float, default=0.03)
    p.add_argument("--ema", type=float, default=0.999, help="decay of the evaluated weight average (FixMatch)")
    p.add_argument("--eval-every", type=int, default=1000)
    p.add_argument("--unlabeled-limit", type=int, help="use only this many unlabeled images (smoke tests)")
    p.add_argument("--test-limit", type=int, help="evaluate on only this many test images (smoke tests)")
    p.add_argument("--data-root", type=Path,
                   default=Path(os.environ.get("SILOKIT_DATA", ROOT.parent / "shared" / "data")),
                   help="folder holding FashionMNIST/raw (torchvision layout; never downloads)")
    p.add_argument("--head", choices=list(HEADS), default="pool",
                   help="small_cnn's classifier head, as run.py's --head (default pool)")
    p.add_argument("--device", default="auto")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    args = p.parse_args(argv)
    for name in ("steps", "labeled_batch", "mu", "eval_every"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if not 0.0 <= args.tau <= 1.0 or not 0.0 <= args.ema < 1.0:
        p.error(f"--tau must be in [0, 1] and --ema in [0, 1), got {args.tau} and {args.ema}")
    torch.set_num_threads(args.threads)
    device = resolve_device(args.device)

    train = quality.load_torchvision("FashionMNIST", args.data_root, True, 28, 1)
    test = quality.load_torchvision("FashionMNIST", args.data_root, False, 28, 1)
    if args.test_limit:
        test = test.subset(list(range(args.test_limit)))
    hub_idx, _, rest = quality.split_data(train.labels.numpy(), args.seed)
    if args.unlabeled_limit:
        rest = rest[: args.unlabeled_limit]
    x_labeled, y_labeled = train.images[hub_idx], train.labels[hub_idx]
    x_unlabeled = train.images[rest]  # their labels are never read

    spec = ModelSpec(name="small_cnn", num_classes=len(train.classes),
                     options={"head": args.head} if args.head != "pool" else {})
    torch.manual_seed(args.seed)
    model = spec.build().to(device)
    ema = copy.deepcopy(model)
    opt = OptimizerSettings()  # SemiFL's: momentum 0.9, Nesterov, weight decay 5e-4, gradient clip 1
    optimizer = make_sgd(model, args.lr, opt)
    gen = seeded_generator(args.seed, 7)
    unlabeled_batch = args.mu * args.labeled_batch

    def evaluate_ema() -> float:
        compute_static_bn(ema, clean_batches(x_labeled, spec.mean, spec.std, device))
        return evaluate(ema, test.images, test.labels, spec.mean, spec.std, device)["accuracy"]

    history, started, passed, losses = [], time.time(), [], []
    for step in range(1, args.steps + 1):
        for group in optimizer.param_groups:  # cosine over the steps, as the profile's is over its rounds
            group["lr"] = cosine_lr(args.lr, step, args.steps)
        li = torch.randint(len(x_labeled), (args.labeled_batch,), generator=gen)
        ui = torch.randint(len(x_unlabeled), (unlabeled_batch,), generator=gen)
        views = [weak_augment(x_labeled[li], generator=gen), weak_augment(x_unlabeled[ui], generator=gen),
                 strong_augment(x_unlabeled[ui], generator=gen)]
        model.train()
        logits = model(torch.cat([to_float(v, spec.mean, spec.std) for v in views]).to(device))
        loss, mask = fixmatch_loss(logits[: args.labeled_batch], y_labeled[li].to(device),
                                       logits[args.labeled_batch: args.labeled_batch + unlabeled_batch],
                                       logits[args.labeled_batch + unlabeled_batch:], args.tau, args.unlabeled_weight)
        sgd_step(model, optimizer, loss, opt.grad_clip)
        update_ema(ema, model, args.ema)
        passed.append(float(mask.mean()))
        losses.append(loss.item())
        if step % args.eval_every == 0 or step == args.steps:
            accuracy = evaluate_ema()
            history.append({"step": step, "test_accuracy": accuracy, "pass_share": sum(passed) / len(passed),
                            "train_loss": sum(losses) / len(losses), "seconds": time.time() - started})
            passed, losses = [], []
            print(f"step {step}: test accuracy {100 * accuracy:.2f}% (EMA), {100 * history[-1]['pass_share']:.0f}% "
                  f"of unlabeled images pass tau, loss {history[-1]['train_loss']:.3f}", flush=True)
            args.out.mkdir(parents=True, exist_ok=True)
            write_json_atomic(args.out / "results.json", {
                "method": "central FixMatch (reference, not federated)", "seed": args.seed,
                "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
                "labeled": len(x_labeled), "unlabeled": len(x_unlabeled), "test": len(test.labels),
                "model": "small_cnn", "model_options": spec.options, "parameters": count_parameters(spec.build()),
                "final_accuracy": accuracy, "history": history, "machine": quality.machine()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
