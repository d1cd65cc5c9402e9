"""Where does SemiFL's lift go? Test accuracy of the silos' aggregate before and after the hub's fine-tune.

    python bench/quality/diagnose_semifl.py --rounds 15

Runs the full profile's SemiFL IID cell (seed 0) and, every round, evaluates on 2,000 test images (a) the model the
hub sends, (b) the average of the silos' models after the hub's momentum step (with static BN statistics from the
hub's labels, as the hub would use them) and (c) the same after the hub's fine-tune. If (b) < (a), the silos'
round made the model worse and the hub's fine-tune had to win the accuracy back.
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import run as quality  # noqa: E402

from silo_core.algorithms import semifl  # noqa: E402
from silo_core.sbn import compute_static_bn  # noqa: E402
from silo_core.training import clean_batches, evaluate  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--data-root", type=Path, default=Path(os.environ.get("SILOKIT_DATA", ROOT.parent / "shared" / "data")))
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    train = quality.load_torchvision("FashionMNIST", args.data_root, True, 28, 1)
    test = quality.load_torchvision("FashionMNIST", args.data_root, False, 28, 1).subset(list(range(2000)))
    fine_tune = semifl.SemiFLHub._server_update
    sent: dict[str, float] = {}
    calls = {"n": 0}  # the first call is init_state's; call k + 1 ends round k

    def measured(self, model, round_number, epochs):
        spec = self.model_spec
        calls["n"] += 1
        finished = calls["n"] - 1
        if finished >= 1:  # called in finish_round: `model` is the aggregate after the momentum step
            compute_static_bn(model, clean_batches(self.data.labeled_images, spec.mean, spec.std, self.device))
            before = evaluate(model, test.images, test.labels, spec.mean, spec.std, self.device)["accuracy"]
        loss = fine_tune(self, model, round_number, epochs)
        after = evaluate(model, test.images, test.labels, spec.mean, spec.std, self.device)["accuracy"]
        if finished >= 1:
            print(f"round {finished}: sent {sent['accuracy']:.3f}, silos' aggregate {before:.3f}, "
                  f"after the hub's fine-tune {after:.3f}", flush=True)
        sent["accuracy"] = after
        return loss

    semifl.SemiFLHub._server_update = measured
    profile = copy.deepcopy(quality.PROFILES["full"])
    profile.rounds, profile.eval_every = args.rounds, args.rounds
    quality.run_cell("semifl", "iid", 0, profile, train, test, quality.resolve_device("auto"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
