"""Privacy benchmark: what secure aggregation costs, and what DP costs in accuracy.

    python bench/privacy/run.py secagg                  # 10, 50, 100 silos x WRN-28-2's 1.47M parameters
    python bench/privacy/run.py dp                      # SemiFL on the bundled data at a few epsilons
    python bench/privacy/run.py secagg --silos-list 10 --dropout 0.1
    python bench/privacy/run.py sample-dp               # SemiFL with DP-SGD at every silo, a few noise levels

secagg: the deployment's SecAgg+ objects driven in one process (security/secagg/inprocess.py): every byte that
would cross the wire is produced and consumed, only transport is skipped. Per-silo time is the sum of that
silo's four stages; hub time is every receive/close/finish call. Silos run one after another, so the numbers are
per-party CPU costs, not a wall-clock round time.

dp: SemiFL's hub and silo halves in-process with the deployment's privacy pipeline (silo: clip, its share of the
Gaussian noise, fixed-point, masks; hub: unmask, accountant), the noise multiplier chosen so that the planned rounds
spend exactly the target epsilon (RDP, delta 1e-5), compared with no DP and with the hub's labels alone.

sample-dp: sample-level DP (privacy.sample_dp): the silos train with DP-SGD through Opacus on a group-norm model;
for each noise multiplier the table gives the largest epsilon any silo spent and the accuracy, next to the same
group-norm model without DP and the hub's labels alone. Settings are the silo-sim demo's (4 silos holding the
bundled training images, every silo in every round).

Writes bench/privacy/results/{secagg,dp,sample_dp}.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bench.processor import cpus, machine  # noqa: E402
from security.dp import DPConfig, PrivacyAccountant  # noqa: E402
from security.secagg import QuantizationRule, SecAggParams  # noqa: E402
from security.secagg.inprocess import Costs, aggregate  # noqa: E402
from silo_core.models import ModelSpec  # noqa: E402
from silo_core.rounds import RoundRecord  # noqa: E402
from silo_server.config import RoundsSection  # noqa: E402

OUT = ROOT / "bench" / "privacy" / "results"


# ------------------------------------------------------------------------------------------------ secure aggregation
def wrn_update(seed: int = 0) -> dict[str, torch.Tensor]:
    """A silo result shaped like SemiFL's for WRN-28-2: delta/<param> for every parameter, and weight."""
    model = ModelSpec(name="wrn28_2", num_classes=10, in_channels=3, image_size=32).build()
    g = torch.Generator().manual_seed(seed)
    out = {f"delta/{n}": torch.randn(p.shape, generator=g) * 1e-3 for n, p in model.named_parameters()}
    out["weight"] = torch.ones(1)
    return out


def bench_secagg(silo_counts: list[int], dropout: float, seed: int = 0, complete: bool = False
                 ) -> list[dict[str, Any]]:
    update = wrn_update(seed)
    params_count = sum(t.numel() for n, t in update.items() if n.startswith("delta/"))
    plain_bytes = 4 * sum(t.numel() for t in update.values())
    rows = []
    cases = [(n, drop, None) for n in silo_counts for drop in ([0.0, dropout] if dropout > 0 else [0.0])]
    if complete:  # Bonawitz et al.'s complete graph, for comparison
        cases += [(n, drop, n - 1) for n in silo_counts for drop in ([0.0, dropout] if dropout > 0 else [0.0])]
    for n, drop, neighbours in cases:
        # defaults: k = 3 ceil(log2 n), t = 2/3 k, Z_2^32, 20-bit fixed point
        params = SecAggParams(enabled=True, neighbours=neighbours)
        ids = [f"silo-{i:03d}" for i in range(n)]
        inputs = {i: update for i in ids}  # one shared tensor set: memory stays flat at 100 silos
        dropped = max(1, round(drop * n)) if drop > 0 else 0
        rng = random.Random(seed)
        drop_map = {i: "masked_input" for i in rng.sample(ids, dropped)}
        costs = Costs()
        started = time.perf_counter()
        result = aggregate(inputs, params, drop=drop_map, costs=costs, seed=seed, keep_levels=False)
        wall = time.perf_counter() - started
        count = len(result.contributors)  # every silo sent the same update: the exact sum is count * update
        err = max(float((result.sums[n] - update[n].double() * count).abs().max()) for n in update)
        active = [i for i in ids if i not in drop_map]
        silo_s = [costs.silo_seconds[i] for i in active]
        up = [costs.silo_bytes_up[i] for i in active]
        down = [costs.silo_bytes_down[i] for i in active]
        row = {
            "silos": n, "dropped_after_sharing": dropped, "parameters": params_count,
            "neighbours_k": result.stats["degree"], "threshold_t": result.stats["threshold"],
            "silo_seconds_mean": statistics.mean(silo_s), "silo_seconds_max": max(silo_s),
            "silo_bytes_up_mean": statistics.mean(up), "silo_bytes_down_mean": statistics.mean(down),
            "plain_upload_bytes": plain_bytes,
            "hub_seconds": costs.hub_seconds, "hub_bytes_in": result.stats["bytes_in"],
            "hub_bytes_out": result.stats["bytes_out"], "wall_seconds": wall,
            "max_abs_error_checked": err, "contributors": len(result.contributors),
            "graph": "complete" if neighbours else "sparse",
        }
        rows.append(row)
        print(f"n={n:3d} dropped={dropped:2d} k={row['neighbours_k']:2d} t={row['threshold_t']:2d}  "
              f"silo {row['silo_seconds_mean']:.3f}s (max {row['silo_seconds_max']:.3f}s), "
              f"up {row['silo_bytes_up_mean'] / 1e6:.3f} MB, down {row['silo_bytes_down_mean'] / 1e3:.1f} kB | "
              f"hub {row['hub_seconds']:.2f}s, in {row['hub_bytes_in'] / 1e6:.1f} MB | err {err:.2e}", flush=True)
    return rows


def secagg_markdown(rows: list[dict[str, Any]], info: dict[str, Any]) -> str:
    lines = [
        f"SecAgg+ cost for a {rows[0]['parameters'] / 1e6:.2f}M-parameter model (WRN-28-2 deltas + weight), "
        f"defaults (k = 3 ceil(log2 n), t = 2/3 k, Z_2^32, 20-bit fixed point).",
        f"Machine: {info['platform']}, {cpus(info)} (shared); in-process, silos one after another.",
        f"Plain float32 upload for comparison: {rows[0]['plain_upload_bytes'] / 1e6:.2f} MB per silo.", "",
        "| graph | silos | dropped after sharing | k | t | per-silo CPU s (mean / max) | per-silo up MB "
        "| per-silo down kB | hub CPU s | hub in MB |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['graph']} | {r['silos']} | {r['dropped_after_sharing']} | {r['neighbours_k']} | {r['threshold_t']} | "
            f"{r['silo_seconds_mean']:.3f} / {r['silo_seconds_max']:.3f} | {r['silo_bytes_up_mean'] / 1e6:.3f} | "
            f"{r['silo_bytes_down_mean'] / 1e3:.1f} | {r['hub_seconds']:.2f} | {r['hub_bytes_in'] / 1e6:.1f} |")
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------------------------------------ DP accuracy
def noise_for_epsilon(target: float, rounds: int, sample_rate: float, delta: float = 1e-5) -> float:
    """The smallest noise multiplier whose `rounds` steps at `sample_rate` spend at most `target` (bisection)."""
    lo, hi = 0.3, 50.0

    def eps(z: float) -> float:
        acc = PrivacyAccountant("rdp", delta)
        acc.step(z, sample_rate, steps=rounds)
        return acc.epsilon()

    for _ in range(40):
        mid = math.sqrt(lo * hi)
        lo, hi = (mid, hi) if eps(mid) > target else (lo, mid)
    return hi


def run_semifl(epsilon: float | None, args, train, test, hub_idx, parts, device, algorithm: str = "semifl"
               ) -> dict[str, Any]:
    """One cell through the deployed hub's round loop with its privacy layer and each silo's
    (silo_sim/inprocess.py run_inprocess with HubPrivacy): secure aggregation always, distributed DP at the noise
    multiplier that spends `epsilon` in `args.rounds` rounds (None: no DP; inf: clipping with no noise to speak of)."""
    from silo_core.algorithms import get_algorithm
    from silo_core.algorithms.base import HubData, SiloData
    from silo_core.training import evaluate
    from silo_server.rounds.privacy import HubPrivacy, PrivacySection
    from silo_sim.inprocess import run_inprocess

    entry = get_algorithm(algorithm)
    options = entry.options.model_validate({k: v for k, v in args.options.items() if k in entry.options.model_fields})
    spec = ModelSpec(num_classes=len(train.classes))
    torch.manual_seed(args.seed)
    hub = entry.hub(options, spec, HubData(train.images[hub_idx], train.labels[hub_idx]), device, args.seed,
                    args.rounds)
    silo = entry.silo(options, spec, device) if entry.silo is not None else None
    silos = [SiloData(images=train.images[idx], true_labels=train.labels[idx], silo_id=f"silo-{i:03d}")
             for i, idx in enumerate(parts)]
    per_round = max(1, round(args.sample_rate * len(silos)))
    q = per_round / len(silos)
    secagg = SecAggParams(enabled=True, dropouts=0,
                          quantization=[QuantizationRule(pattern="weight", clip=64.0, bits=20),
                                        QuantizationRule(pattern="*", clip=1.0, bits=20)])
    dp = DPConfig()
    if epsilon is not None:
        z = noise_for_epsilon(epsilon, args.rounds, q) if math.isfinite(epsilon) else 1e-9
        dp = DPConfig(enabled=True, noise_multiplier=max(z, 1e-9), clip_norm=args.clip_norm, noise="distributed")
    privacy = HubPrivacy(PrivacySection(secure_aggregation=secagg, dp=dp), seed=args.seed) if silo else None
    started = time.time()

    def score(state) -> dict[str, float]:
        return evaluate(hub.served_model(state), test.images, test.labels, spec.mean, spec.std, device)

    def report(record: RoundRecord) -> None:
        print(f"  {algorithm} eps={epsilon} round {record.round}: accuracy {record.scores.test_accuracy:.4f}"
              + (f", epsilon {record.dp.epsilon:.3f}" if record.dp is not None else ""), flush=True)

    _, history = run_inprocess(hub, silo, silos, args.rounds, seed=args.seed, evaluate=score, on_round=report,
                               silos_per_round_count=per_round if silo is not None else None, privacy=privacy,
                               quorum=args.quorum)
    finite = epsilon is not None and math.isfinite(epsilon)
    if not finite:  # an infinite target runs the same pipeline without noise: no epsilon to speak of
        history = [replace(r, dp=None) for r in history]
    return {"algorithm": algorithm, "target_epsilon": epsilon, "noise_multiplier": dp.noise_multiplier
            if finite else None, "spent_epsilon": history[-1].dp.epsilon if finite else None, "sample_rate": q,
            "final_accuracy": history[-1].scores.test_accuracy, "history": [h.to_json() for h in history],
            "seconds": time.time() - started,
            "parameters": sum(p.numel() for p in spec.build().parameters()), "silos_per_round_count": per_round,
            "quorum": args.quorum}


def bench_dp(args) -> list[dict[str, Any]]:
    from silo_core.data import load_demo
    from silo_core.partition import make_partition, split_labeled_per_class
    from silo_core.training import resolve_device

    device = resolve_device(args.device)
    train, test = load_demo("train"), load_demo("test")
    hub_idx, rest = split_labeled_per_class(train.labels.numpy(), args.labels_per_class, args.seed)
    parts = [rest[p] for p in make_partition(train.labels.numpy()[rest], args.silos, "iid", args.seed)]
    cells = [run_semifl(None, args, train, test, hub_idx, parts, device, algorithm="server-only")]
    for eps in args.epsilons:
        cells.append(run_semifl(None if eps == "none" else float(eps), args, train, test, hub_idx, parts, device))
    return cells


def dp_markdown(cells: list[dict[str, Any]], args, info: dict[str, Any]) -> str:
    lines = [
        f"DP accuracy cost: SemiFL on the bundled Fashion-MNIST subset ({args.labels_per_class} labels per class at "
        f"the hub, {args.silos} IID silos, {round(args.sample_rate * args.silos)} per round, {args.rounds} rounds, "
        f"secure aggregation on, distributed noise, clip C = {args.clip_norm}, delta 1e-5, RDP).",
        f"Options: {json.dumps(args.options)}. Machine: {info['platform']}, {info['cpu_count']} CPUs. One seed.", "",
        "The last column is the noise's L2 norm on the averaged update relative to the clip norm, "
        "z sqrt(d) sqrt(m / k) / m (d parameters, m silos per round, each adding the noise planned for the k a "
        "round's quorum needs; k = m before 2026-11-29): far above 1, the silos' contribution is drowned and only the "
        "hub's own fine-tuning moves the model.", "",
        "| setting | noise multiplier z | epsilon spent | test accuracy (%) | noise norm / C on the mean |",
        "|---|---|---|---|---|",
    ]
    for c in cells:
        if c["algorithm"] == "server-only":
            name = "hub labels only (server-only)"
        elif c["target_epsilon"] is None:
            name = "SemiFL + secure aggregation, no DP"
        elif math.isinf(c["target_epsilon"]):
            name = "SemiFL + clipping only (epsilon = inf)"
        else:
            name = f"SemiFL + DP, target epsilon {c['target_epsilon']:g}"
        z = "-" if c["noise_multiplier"] is None else f"{c['noise_multiplier']:.3f}"
        e = "-" if c["spent_epsilon"] is None else f"{c['spent_epsilon']:.3f}"
        if c["target_epsilon"] is not None and math.isinf(c["target_epsilon"]):
            z, e = "0 (clip only)", "inf"
        snr = "-"
        if c["noise_multiplier"] is not None and c.get("parameters"):
            m = c["silos_per_round_count"]
            k = max(2, math.ceil(round(c.get("quorum", 1.0) * m, 9)))  # the hub's quorum, at least the cohort of 2
            snr = f"{c['noise_multiplier'] * math.sqrt(c['parameters'] * m / k) / m:.1f}"
        lines.append(f"| {name} | {z} | {e} | {100 * c['final_accuracy']:.1f} | {snr} |")
    return "\n".join(lines) + "\n"


def remake_dp_markdown(path: Path) -> str:
    """Rebuild dp.md from dp.json (e.g. after a table format change)."""
    data = json.loads(path.read_text())
    args = argparse.Namespace(**data["settings"])
    for c in data["cells"]:
        c.setdefault("parameters", sum(p.numel() for p in ModelSpec(num_classes=10).build().parameters()))
        c.setdefault("silos_per_round_count", round(args.sample_rate * args.silos))
        if isinstance(c["target_epsilon"], str):
            c["target_epsilon"] = float(c["target_epsilon"])
    return dp_markdown(data["cells"], args, data["machine"])


# ------------------------------------------------------------------------------------------------ sample-level DP
def bench_sample_dp(args) -> list[dict[str, Any]]:
    from silo_core.algorithms import get_algorithm
    from silo_core.algorithms.base import HubData, SiloData
    from silo_core.data import load_demo
    from silo_core.partition import make_partition, split_labeled_per_class
    from silo_core.training import evaluate, resolve_device
    from silo_sim.cli import DEMO_OPTIONS
    from silo_sim.inprocess import run_inprocess

    device = resolve_device(args.device)
    train, test = load_demo("train"), load_demo("test")
    hub_idx, rest = split_labeled_per_class(train.labels.numpy(), args.labels_per_class, args.seed)
    rest = rest[: args.silo_images] if args.silo_images else rest
    parts = [rest[p] for p in make_partition(train.labels.numpy()[rest], args.silos, "iid", args.seed)]
    spec = ModelSpec(num_classes=len(train.classes), options={"norm": "group"})
    cells = []
    no_dp = ("server-only", "none", "none-fix-only")
    for sigma in [*no_dp, *args.noise_multipliers]:
        method = "server-only" if sigma == "server-only" else "semifl"
        entry = get_algorithm(method)
        chosen = {**DEMO_OPTIONS["semifl"], **({"tau": args.tau} if args.tau is not None else {})}
        if sigma == "none-fix-only":  # the loss DP-SGD trains on (no Mixup), without DP: separates the two costs
            chosen["mix_weight"] = 0.0
        options = entry.options.model_validate({k: v for k, v in chosen.items() if k in entry.options.model_fields})
        torch.manual_seed(args.seed)
        hub = entry.hub(options, spec, HubData(train.images[hub_idx], train.labels[hub_idx]), device, args.seed,
                        args.rounds)
        silo = entry.silo(options, spec, device) if entry.silo is not None else None
        sample_dp = None if sigma in no_dp else {"sample_dp": {
            "noise_multiplier": float(sigma), "clip_norm": args.clip_norm, "delta": 1e-5, "epsilon_budget": None}}
        silos = [SiloData(images=train.images[idx], true_labels=train.labels[idx], silo_id=f"silo-{i:03d}")
                 for i, idx in enumerate(parts)]
        started = time.time()
        _, history = run_inprocess(hub, silo, silos, args.rounds, 1.0, args.seed,
                                   lambda st, h=hub: evaluate(h.served_model(st), test.images, test.labels,
                                                              spec.mean, spec.std, device),
                                   round_hyperparameters=sample_dp)
        ledgers = list(silo.sample_dp_ledgers.values()) if silo is not None else []
        epsilon = max((ledger.epsilon() for ledger in ledgers), default=None)
        cells.append({"setting": sigma, "noise_multiplier": None if sigma in no_dp else float(sigma),
                      "max_silo_epsilon": epsilon, "final_accuracy": history[-1].scores.test_accuracy,
                      "accuracy_per_round": [h.scores.test_accuracy for h in history], "seconds": time.time() - started})
        print(f"  sample-dp {sigma}: accuracy {history[-1].scores.test_accuracy:.4f}"
              + (f", largest silo epsilon {epsilon:.2f}" if epsilon else ""), flush=True)
    return cells


def sample_dp_markdown(cells: list[dict[str, Any]], args, info: dict[str, Any]) -> str:
    lines = [
        f"Sample-level DP cost: SemiFL on the bundled Fashion-MNIST subset ({args.labels_per_class} labels per class "
        f"at the hub, {args.silos} IID silos, all in every round, {args.rounds} rounds, the silo-sim demo's options), "
        f"small_cnn with group norm, DP-SGD at every silo with per-image clip C = {args.clip_norm}, delta 1e-5 (RDP, "
        f"each silo's own ledger). Machine: {info['platform']}, {info['cpu_count']} CPUs. One seed.", "",
        "| setting | noise multiplier sigma | largest epsilon of a silo | test accuracy (%) |", "|---|---|---|---|"]
    for c in cells:
        name = {"server-only": "hub labels only (server-only)", "none": "SemiFL, group norm, no DP",
                "none-fix-only": "SemiFL without Mixup (the DP-SGD loss), no DP"}.get(
            c["setting"], "SemiFL + DP-SGD at the silos")
        sigma = "-" if c["noise_multiplier"] is None else f"{c['noise_multiplier']:g}"
        eps = "-" if c["max_silo_epsilon"] is None else f"{c['max_silo_epsilon']:.2f}"
        lines.append(f"| {name} | {sigma} | {eps} | {100 * c['final_accuracy']:.1f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("what", choices=["secagg", "dp", "all", "dp-table", "sample-dp"])
    p.add_argument("--silos-list", "--silos-counts", dest="silo_counts", type=int, nargs="*", default=[10, 50, 100])
    p.add_argument("--dropout", type=float, default=0.05, help="secagg: also run with this fraction dropped")
    p.add_argument("--complete-graph", action="store_true", help="secagg: also run Bonawitz's complete graph")
    p.add_argument("--epsilons", nargs="*", default=["none", "inf", "8", "2"])
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--silos", type=int, default=20, help="dp: silos enrolled")
    p.add_argument("--sample-rate", type=float, default=0.5)
    p.add_argument("--clip-norm", type=float, default=1.0)
    p.add_argument("--quorum", type=float, default=RoundsSection().quorum,
                   help="dp: the quorum each round plans its distributed noise for (default: the hub's, "
                        f"{RoundsSection().quorum}); the cells committed before 2026-11-29 ran at 1.0")
    p.add_argument("--silo-images", type=int, help="sample-dp: use only this many of the silos' images")
    p.add_argument("--tau", type=float, help="sample-dp: SemiFL's threshold (default: the demo's)")
    p.add_argument("--noise-multipliers", nargs="*", default=["0.6", "1.0", "2.0"], help="sample-dp: sigma values")
    p.add_argument("--labels-per-class", type=int, default=25)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="auto")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--out", type=Path, default=OUT)
    args = p.parse_args(argv)
    # dp's SemiFL options; sample-dp trains with the silo-sim demo's (bench_sample_dp), and records those instead.
    args.options = {"hub_epochs": 2, "local_epochs": 1, "silo_batch_size": 32, "hub_batch_size": 16, "tau": 0.5,
                    "lr_schedule": "constant"}
    torch.set_num_threads(args.threads)
    args.out.mkdir(parents=True, exist_ok=True)
    info = machine()
    if args.what == "dp-table":
        table = remake_dp_markdown(args.out / "dp.json")
        (args.out / "dp.md").write_text(table)
        print(table)
        return 0
    if args.what in ("secagg", "all"):
        rows = bench_secagg(args.silo_counts, args.dropout, args.seed, args.complete_graph)
        (args.out / "secagg.json").write_text(json.dumps({"machine": info, "rows": rows}, indent=1))
        (args.out / "secagg.md").write_text(secagg_markdown(rows, info))
        print(secagg_markdown(rows, info))
    if args.what == "sample-dp":
        from silo_sim.cli import DEMO_OPTIONS

        cells = bench_sample_dp(args)
        used = {**DEMO_OPTIONS["semifl"], **({"tau": args.tau} if args.tau is not None else {})}
        (args.out / "sample_dp.json").write_text(json.dumps({"machine": info, "settings": {
            **{k: v for k, v in vars(args).items() if k not in ("out",)}, "options": used}, "cells": cells},
            indent=1, default=str))
        (args.out / "sample_dp.md").write_text(sample_dp_markdown(cells, args, info))
        print(sample_dp_markdown(cells, args, info))
    if args.what in ("dp", "all"):
        cells = bench_dp(args)
        (args.out / "dp.json").write_text(json.dumps({"machine": info, "settings": {
            k: v for k, v in vars(args).items() if k not in ("out",)}, "cells": cells}, indent=1, default=str))
        (args.out / "dp.md").write_text(dp_markdown(cells, args, info))
        print(dp_markdown(cells, args, info))
    return 0


if __name__ == "__main__":
    sys.exit(main())
