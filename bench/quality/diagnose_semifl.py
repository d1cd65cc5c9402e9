"""Where does SemiFL's lift go? Each round's model at each stage, against server-only's and the hub alone.

    python bench/quality/diagnose_semifl.py --profile quick --threads 1     # about a minute on one core
    python bench/quality/diagnose_semifl.py --profile full --rounds 15      # the full profile's first check
    python bench/quality/diagnose_semifl.py --profile quick --unlabeled-limit 12000 --option local_epochs=2

Runs one server-only cell and then the SemiFL cell of the same profile, partition and seed (the benchmark's
own run_cell, so the same data, options and round loop) and prints, for every round:
- test accuracy of (a) the model the hub sent, (b) the silos' aggregate after the hub's momentum step (with
  static BN statistics from the hub's labels, as the hub would serve it), (c) the same after the hub's
  fine-tune: the model the round ends with, which is scored, (d) the hub's fine-tune alone: the same fine-tune
  (same batches and augmentations, same learning rate) from the model it sent, without the silos' step, and
  (e) server-only's model of the same round;
- the learning rate of the round's fine-tune, and parameter distances (L2 over every weight): the silos' step
  |b - a|, the fine-tune's step |c - b|, what survives of the silos' work |c - d|, and |c - e|.
(b) < (a): the silos' round made the model worse and the fine-tune had to win it back. |c - d| near 0 would
mean the fine-tune erases the silos' work; c equal to e, that the scored model is the hub-only one. Issue 37
asked both of the quick profile, whose SemiFL cells end within noise of server-only (bench/README.md).
The last lines count the test images on which the two final models disagree, and check that the accuracy the
benchmark recorded for the final round is (c) of that round.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import run as quality  # noqa: E402

from silo_core.algorithms import semifl  # noqa: E402
from silo_core.sbn import compute_static_bn  # noqa: E402
from silo_core.training import clean_batches, cosine_lr, evaluate, predict_logits  # noqa: E402


def flat(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().flatten().cpu() for p in model.parameters()])


class Recorder:
    """Wraps SemiFLHub._server_update (which ServerOnlyHub inherits): call 0 is init_state's warm-up, call k
    the fine-tune that ends round k. The wrapped fine-tune is the real one; the extra work (copies, a second
    fine-tune on a copy, evaluations) draws from no random generator the run uses, so the run is the one the
    benchmark runs (the same final accuracy with and without the wrapper)."""

    def __init__(self, test, counterfactual: bool) -> None:
        self.test = test
        self.counterfactual = counterfactual  # also run the fine-tune without the silos' step (SemiFL)
        self.rounds: list[dict[str, Any]] = []
        self.sent: nn.Module | None = None

    def accuracy(self, hub, model: nn.Module) -> float:
        spec = hub.model_spec
        scores = evaluate(model, self.test.images, self.test.labels, spec.mean, spec.std, hub.device)
        return 100 * scores["accuracy"]

    def wrap(self, fine_tune):
        def measured(hub, model: nn.Module, round_number: int, epochs: int) -> float:
            o, spec = hub.options, hub.model_spec
            row: dict[str, Any] = {"lr": cosine_lr(o.lr, min(round_number, hub.total_rounds), hub.total_rounds,
                                                 o.lr_schedule)}
            if self.rounds and self.counterfactual:
                aggregate = copy.deepcopy(model)
                labeled = clean_batches(hub.data.labeled_images, spec.mean, spec.std, hub.device)
                compute_static_bn(aggregate, labeled)
                alone = copy.deepcopy(self.sent)
                fine_tune(hub, alone, round_number, epochs)  # the same batches as the real one
                row.update(aggregate=self.accuracy(hub, aggregate), alone=self.accuracy(hub, alone),
                           sent=self.accuracy(hub, self.sent),
                           silo_step=float((flat(aggregate) - flat(self.sent)).norm()),
                           alone_weights=flat(alone), aggregate_weights=flat(aggregate))
            loss = fine_tune(hub, model, round_number, epochs)
            row.update(after=self.accuracy(hub, model), weights=flat(model),
                       predictions=predict_logits(model, self.test.images, spec.mean, spec.std,
                                                  hub.device).argmax(1))
            self.rounds.append(row)
            self.sent = copy.deepcopy(model)
            return loss

        return measured


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--profile", choices=sorted(quality.PROFILES), default="full")
    p.add_argument("--rounds", type=int,
                   help="default: the profile's (the cosine schedule spans these rounds)")
    p.add_argument("--partition", choices=list(quality.PARTITIONS), default="iid")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--data-root", type=Path,
                   default=Path(os.environ.get("SILOKIT_DATA", ROOT.parent / "shared" / "data")))
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--unlabeled-limit", type=int, help="the silos' images in all (default: the profile's)")
    p.add_argument("--option", action="append", default=[], metavar="KEY=VALUE",
                   help="an option for both methods, over the profile's (local_epochs=2; values are JSON)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    profile = copy.deepcopy(quality.PROFILES[args.profile])
    profile.rounds = args.rounds or profile.rounds
    if args.unlabeled_limit:
        profile.unlabeled_limit = args.unlabeled_limit
    for item in args.option:
        key, _, text = item.partition("=")
        try:
            value = json.loads(text)
        except json.JSONDecodeError:
            value = text
        profile.options[key] = value
        for chosen in profile.method_options.values():  # over a method's own setting too (SemiFL's tuned tau)
            if key in chosen:
                chosen[key] = value
    train, test = quality.load_data(args.data_root, profile)
    device = quality.resolve_device("auto")
    fine_tune = semifl.SemiFLHub._server_update
    recorders: dict[str, Recorder] = {}
    cells: dict[str, dict[str, Any]] = {}
    try:
        for method in ("server-only", "semifl"):
            recorder = recorders[method] = Recorder(test, counterfactual=method == "semifl")
            semifl.SemiFLHub._server_update = recorder.wrap(fine_tune)
            cells[method] = quality.run_cell(method, args.partition, args.seed, profile, train, test,
                                             device)
    finally:
        semifl.SemiFLHub._server_update = fine_tune
    floor, fed = recorders["server-only"].rounds, recorders["semifl"].rounds
    print(f"\nprofile {args.profile}, {profile.rounds} rounds, {args.partition}, seed {args.seed}; test "
          f"accuracy (%) on {len(test.labels)} images; distances: L2 over every weight "
          f"(|w| = {float(fed[-1]['weights'].norm()):.1f})")
    print("round  fine-tune lr |  sent  silos' aggregate  after fine-tune  fine-tune alone  server-only | "
          "|silos' step|  |fine-tune step|  |after - alone|  |after - server-only|")
    for r, (a, f) in enumerate(zip(floor, fed, strict=True)):
        to_floor = float((f["weights"] - a["weights"]).norm())
        if "aggregate" not in f:  # the warm-up before round 1
            print(f"{r:5d}  {f['lr']:12.5f} | {'':6s}  {'':16s}  {f['after']:15.2f}  {'':15s}  "
                  f"{a['after']:11.2f} | {'':13s}  {'':16s}  {'':15s}  {to_floor:20.4f}")
            continue
        ft_step = float((f["weights"] - f["aggregate_weights"]).norm())
        survives = float((f["weights"] - f["alone_weights"]).norm())
        print(f"{r:5d}  {f['lr']:12.5f} | {f['sent']:6.2f}  {f['aggregate']:16.2f}  {f['after']:15.2f}  "
              f"{f['alone']:15.2f}  {a['after']:11.2f} | {f['silo_step']:13.4f}  {ft_step:16.4f}  "
              f"{survives:15.4f}  {to_floor:20.4f}")
    differ = int((fed[-1]["predictions"] != floor[-1]["predictions"]).sum())
    print(f"The two final models predict differently on {differ} of {len(test.labels)} test images.")
    for method, cell in cells.items():
        recorded, last = 100 * cell["final_accuracy"], recorders[method].rounds[-1]["after"]
        same = "the same model" if abs(recorded - last) < 1e-6 else "NOT the same model"
        print(f"{method}: the benchmark recorded {recorded:.2f}% for round {profile.rounds}; the model that "
              f"round ended with scores {last:.2f}% ({same})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
