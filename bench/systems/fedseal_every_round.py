"""What FedSEAL's `ensemble_every_round` costs: the same federation with the option off and on, over the real wire.

By default 10 silos, 30% sampled per round, 3 rounds, small_cnn, 1,000 unlabeled images, seed 0, two silo hosts;
the runs alternate off, on, off, on (--repeats pairs) so that a machine shared with other work slows both alike.
Per run: the hub's round records (bytes down and up, silos that received the model without being sampled, round
time), the final test accuracy, the wall time of the whole silo-sim command, and from the silos' own logs how long
a silo took to fold a received model into its ensemble against a sampled silo's training.

    python bench/systems/fedseal_every_round.py       # writes results/fedseal_every_round.json and .md
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bench.processor import cpus, machine  # noqa: E402

RESULTS = ROOT / "bench" / "systems" / "results"
RECEIVED = re.compile(r"not sampled; received the model and used it in ([0-9.]+)s")
TRAINED = re.compile(r"(?:update sent|skipped \(nothing passed the threshold\)) in ([0-9.]+)s")


def silo_seconds(logs: Path, pattern: re.Pattern[str]) -> list[float]:
    """Every time a silo's log reports for `pattern` (one per silo and round)."""
    found = []
    for log in sorted(logs.glob("*.log")):
        found += [float(m.group(1)) for m in pattern.finditer(log.read_text(errors="replace"))]
    return found


def one_run(every_round: bool, args: argparse.Namespace, scratch: Path, index: int) -> dict[str, Any]:
    work, out = scratch / f"run-{index}" / "work", scratch / f"run-{index}" / "out"
    command = [sys.executable, "-m", "silo_sim.cli", "--algorithm", "fedseal", "--silos", str(args.silos),
               "--silos-per-round", str(args.silos_per_round), "--rounds", str(args.rounds),
               "--unlabeled", str(args.unlabeled), "--test-per-class", "50", "--workers", str(args.workers),
               "--seed", "0", "--no-baseline", "--option", f"ensemble_every_round={str(every_round).lower()}",
               "--workdir", str(work), "--out", str(out)]
    load_before = os.getloadavg()[0]
    started = time.time()
    proc = subprocess.run(command, capture_output=True, text=True, cwd=ROOT)
    wall = time.time() - started
    if proc.returncode != 0:
        raise SystemExit(f"silo-sim failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    summary = json.loads((out / "summary.json").read_text())
    rounds = summary["rounds"]
    received, trained = silo_seconds(work / "logs", RECEIVED), silo_seconds(work / "logs", TRAINED)
    return {
        "ensemble_every_round": every_round, "wall_seconds": wall, "federated_seconds": summary["federated_seconds"],
        "load_average_at_start": load_before, "final_test_accuracy": summary["final"].get("test_accuracy"),
        "rounds": [{k: r.get(k) for k in ("round", "silos_sampled", "silos_reported", "silos_received", "bytes_down",
                                          "bytes_down_received", "bytes_up", "round_seconds", "aggregation_seconds",
                                          "test_accuracy")} for r in rounds],
        "silo_receive_seconds_mean": statistics.mean(received) if received else None,
        "silo_receives": len(received),
        "silo_train_seconds_mean": statistics.mean(trained) if trained else None,
        "command": " ".join(command[1:]),
    }


def markdown(runs: list[dict[str, Any]], machine: str) -> str:
    lines = ["# FedSEAL's ensemble_every_round: what the paper's behaviour costs", "",
             f"Machine: {machine}. Command: `python bench/systems/fedseal_every_round.py`; each run is "
             f"`{runs[0]['command'].split(' --option')[0]} --option ensemble_every_round=false|true`.", "",
             "| ensemble_every_round | bytes down per round | of which to unsampled silos | silos receiving, unsampled "
             "| bytes up per round | round time (s) | federated run | wall | test accuracy | a silo: receive / train (s) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for run in runs:
        rs = run["rounds"]
        down = ", ".join(f"{r['bytes_down']:,}" for r in rs)
        received = ", ".join(f"{r['bytes_down_received']:,}" if r["bytes_down_received"] is not None else "-"
                             for r in rs)
        silos = ", ".join(str(r["silos_received"]) if r["silos_received"] is not None else "-" for r in rs)
        up = ", ".join(f"{r['bytes_up']:,}" for r in rs)
        seconds = ", ".join(f"{r['round_seconds']:.1f}" for r in rs)
        receive = (f"{run['silo_receive_seconds_mean']:.2f}" if run["silo_receive_seconds_mean"] is not None
                   else "-")
        lines.append(f"| {str(run['ensemble_every_round']).lower()} | {down} | {received} | {silos} | {up} | "
                     f"{seconds} | {run['federated_seconds']:.0f} s | {run['wall_seconds']:.0f} s | "
                     f"{run['final_test_accuracy']:.4f} | {receive} / {run['silo_train_seconds_mean']:.2f} |")
    lines += ["", "Bytes are counted by the hub (the round record's bytes_down, bytes_down_received and bytes_up). "
              "A silo's receive time is receive_model after the download (inference over its images into the "
              "self-ensemble), its train time a sampled silo's whole local update; both from the silos' logs.", ""]
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--silos", type=int, default=10)
    p.add_argument("--silos-per-round", type=float, default=0.3)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--unlabeled", type=int, default=1000)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--repeats", type=int, default=2, help="off/on pairs, alternating (default 2)")
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args()
    info = machine()
    with tempfile.TemporaryDirectory(prefix="fedseal-every-round-") as scratch:
        runs = []
        for _ in range(args.repeats):
            for every_round in (False, True):
                runs.append(one_run(every_round, args, Path(scratch), len(runs)))
                print(f"ensemble_every_round={every_round}: {runs[-1]['wall_seconds']:.0f} s", file=sys.stderr)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "fedseal_every_round.json").write_text(json.dumps({"machine": info, "runs": runs}, indent=2))
    report = markdown(runs, f"{cpus(info)}, {info['platform']}")
    (args.out / "fedseal_every_round.md").write_text(report)
    print(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
