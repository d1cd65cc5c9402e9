"""Systems benchmark: what the wire costs.

    python bench/systems/run.py                 # all four measurements, a few minutes on 2 CPU cores
    python bench/systems/run.py --only codec    # codec | bytes | overhead | memory

1. codec: tensor codec throughput (encode + chunk + sha256 + reassemble + decode) for a 1.5M-parameter model
   (WRN-28-2) and a 25M-parameter model.
2. bytes: bytes on the wire per silo and round versus the raw model size, model sent as fp32 and as fp16.
3. overhead: the same SemiFL rounds in-process versus through silo-sim over gRPC + mutual TLS (target: < 5%).
4. memory: hub peak memory versus the number of reporting silos with a 1.5M-parameter model (target: flat), and
   with small_cnn's 133 KB uploads as a control.

Writes results/results.json and results/report.md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bench.processor import cpus, machine  # noqa: E402
from silo_core.models import ModelSpec, count_parameters  # noqa: E402
from silo_core.rounds import RoundRecord, records_from_json  # noqa: E402
from silo_core.tensors import assemble, decode, encode, iter_chunks, sha256_hex  # noqa: E402


def bench_codec(repeats: int = 3) -> list[dict[str, Any]]:
    wrn = {k: v for k, v in ModelSpec(name="wrn28_2", in_channels=3, image_size=32).build().state_dict().items()}
    big = {f"layer{i}.weight": torch.randn(1000, 1000) for i in range(25)}  # 25M parameters
    rows = []
    for name, tensors in (("WRN-28-2", wrn), ("25M synthetic", big)):
        params = sum(t.numel() for t in tensors.values() if t.is_floating_point())
        for half in (False, True):
            best = float("inf")
            for _ in range(repeats):
                start = time.perf_counter()
                payload = encode(tensors, half=half)
                digest = sha256_hex(payload)
                back = decode(assemble(iter_chunks(payload), len(payload), digest, len(payload)))
                best = min(best, time.perf_counter() - start)
            assert set(back) == set(tensors)
            rows.append({"model": name, "parameters": params, "dtype": "fp16" if half else "fp32",
                         "payload_bytes": len(payload), "seconds": best,
                         "throughput_MBps": len(payload) / best / 1e6,
                         "raw_fp32_MBps": 4 * params / best / 1e6})
    return rows


def run_sim(workdir: Path, *extra: str) -> list[RoundRecord]:
    """The rounds of one silo-sim run (hub and silo processes over gRPC + mutual TLS)."""
    from silo_sim.inprocess import run_silo_sim

    return records_from_json(run_silo_sim(workdir / "work", workdir / "out", list(extra))["rounds"])


def bench_bytes() -> list[dict[str, Any]]:
    spec = ModelSpec()
    model = spec.build()
    raw = 4 * count_parameters(model)
    rows = []
    for half in (False, True):
        with tempfile.TemporaryDirectory() as tmp:
            tmp = Path(tmp)
            extra = ["--silos", "2", "--rounds", "1", "--unlabeled", "200", "--option", "tau=0.0",
                     "--option", "local_epochs=1"]
            if half:
                extra += ["--half-precision"]
            r = run_sim(tmp, *extra)[0]
        silos = r.silos_sampled
        rows.append({"model": "small_cnn", "parameters": count_parameters(model), "raw_fp32_bytes": raw,
                     "model_sent_as": "fp16" if half else "fp32",
                     "down_bytes_per_silo": r.bytes_down / silos, "up_bytes_per_silo": r.bytes_up / silos,
                     "down_vs_raw": r.bytes_down / silos / raw, "up_vs_raw": r.bytes_up / silos / raw})
    return rows


def bench_overhead(rounds: int = 4, silos: int = 4, repeats: int = 3) -> list[dict[str, Any]]:
    """The same comparison with small and with larger silos: the wire's cost per round is roughly fixed (polls,
    transfers, checks), so its share shrinks as local training grows. Each way runs `repeats` times, alternating,
    and the medians are compared: one run of a few seconds swings by 10% on a shared 2-core machine."""
    return [overhead_once(rounds, silos, unlabeled, repeats) for unlabeled in (2000, 5750)]


def overhead_once(rounds: int, silos: int, unlabeled: int, repeats: int) -> dict[str, Any]:
    """Same data, options, seeds: one worker (silos train one after another, as in-process) vs in-process."""
    wire_runs, local_runs, wire_acc, local_acc = [], [], None, None
    with tempfile.TemporaryDirectory() as keep:
        staged = Path(keep) / "first"
        for i in range(repeats):
            # A fresh work folder per wire run: the hub would otherwise resume from the last run's checkpoint.
            workdir = staged if i == 0 else Path(keep) / f"run-{i}"
            wire_rounds = run_sim(workdir, "--silos", str(silos), "--rounds", str(rounds), "--workers", "1",
                                  "--unlabeled", str(unlabeled))
            wire_runs.append(wire_rounds)
            wire_acc = wire_rounds[-1].scores.test_accuracy
            history = inprocess_rounds(staged / "work", rounds)
            local_runs.append(history)
            local_acc = history[-1].scores.test_accuracy
    wire, local = [time_split(run) for run in wire_runs], [time_split(run) for run in local_runs]
    w, lo = median_part(wire, "total"), median_part(local, "total")
    return {"rounds": rounds, "silos": silos, "unlabeled": unlabeled, "repeats": repeats,
            "wire_round_seconds": [[r.round_seconds for r in run] for run in wire_runs],
            "inprocess_round_seconds": [[r.round_seconds for r in run] for run in local_runs],
            "wire_time_split": wire, "inprocess_time_split": local,
            "wire_total_s": w, "inprocess_total_s": lo, "overhead_fraction": (w - lo) / lo,
            # What the wire adds beyond the computation both ways share, against the in-process run's time:
            # immune to the machine running the same computation faster or slower from one run to the next.
            "wire_own_fraction": (median_part(wire, "other") - median_part(local, "other")) / lo,
            "wire_final_accuracy": wire_acc, "inprocess_final_accuracy": local_acc}


def time_split(rounds: list[RoundRecord]) -> dict[str, float]:
    """Where a run's round time went: the silos' local training, the hub's aggregation (its fine-tune included)
    and scoring, and everything else (over the wire: hand-out, transfers, checks, waiting)."""
    total = sum(r.round_seconds for r in rounds)
    silos = sum((r.silo_train_seconds or 0.0) * (r.silos_reported or 0) for r in rounds)
    hub = sum((r.aggregation_seconds or 0.0) + (r.evaluation_seconds or 0.0) for r in rounds)
    after_first = sum(r.round_seconds for r in rounds[1:])
    return {"total": total, "silo_training": silos, "hub_work": hub, "other": total - silos - hub,
            "after_round_1": after_first}


def median_part(runs: list[dict[str, float]], part: str) -> float:
    """Median over runs of one part of their time split."""
    return statistics.median(run[part] for run in runs)


def inprocess_rounds(work: Path, rounds: int) -> list[RoundRecord]:
    """The rounds silo-sim ran from `work`, in one process: the same staged data, options and seed."""
    from silo_sim.cli import DEMO_OPTIONS
    from silo_sim.inprocess import replay_staged

    return replay_staged(work, "semifl", DEMO_OPTIONS["semifl"], rounds)


def bench_memory(runs=(("wrn28_2", 10), ("wrn28_2", 50), ("wrn28_2", 100), ("small_cnn", 10), ("small_cnn", 100))
                 ) -> list[dict[str, Any]]:
    """WRN-28-2 uploads (5.9 MB each) for the target; small_cnn uploads (133 KB) as the control that tells the
    cost of a connection from the cost of an upload."""
    rows = []
    for model, n in runs:
        with tempfile.TemporaryDirectory() as tmp:
            r = run_sim(Path(tmp), "--silos", str(n), "--rounds", "1", "--unlabeled", str(20 * n),
                        "--model", model, "--option", "tau=0.0", "--option", "local_epochs=1",
                        "--option", "hub_epochs=1", "--option", "silo_batch_size=20")[0]
        rows.append({"model": model, "silos_reporting": r.silos_reported,
                     "hub_peak_rss_MB": r.hub_peak_rss_bytes / 1e6, "bytes_up_MB": r.bytes_up / 1e6,
                     "collecting_growth_MB": r.collecting_rss_growth_bytes / 1e6})
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", choices=["codec", "bytes", "overhead", "memory"], action="append")
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "systems" / "results")
    p.add_argument("--repeats", type=int, default=3,
                   help="overhead: runs each way, alternating (medians are compared; default 3)")
    args = p.parse_args(argv)
    chosen = args.only or ["codec", "bytes", "overhead", "memory"]
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "results.json"
    results: dict[str, Any] = json.loads(path.read_text()) if path.exists() else {}
    results["machine"] = machine()
    for name in chosen:
        print(f"running {name} ...", flush=True)
        measure = {"codec": bench_codec, "bytes": bench_bytes, "memory": bench_memory,
                   "overhead": lambda: bench_overhead(repeats=args.repeats)}[name]
        results[name] = measure()
        print(json.dumps(results[name], indent=1), flush=True)
    path.write_text(json.dumps(results, indent=1))
    (args.out / "report.md").write_text(report(results))
    print(report(results))
    return 0


def overhead_cells(o: dict[str, Any]) -> str:
    """The report's cells for one overhead comparison (medians over runs)."""
    wire, local = o["wire_time_split"], o["inprocess_time_split"]

    def both(part: str) -> str:
        return f"{median_part(local, part):.2f} / {median_part(wire, part):.2f} s"

    after = (median_part(wire, "after_round_1") - median_part(local, "after_round_1")) / median_part(
        local, "after_round_1")
    compute = [median_part(runs, "silo_training") + median_part(runs, "hub_work") for runs in (local, wire)]
    return (f"{o['inprocess_total_s']:.1f} s | {o['wire_total_s']:.1f} s | {100 * o['overhead_fraction']:+.1f}% | "
            f"{100 * after:+.1f}% | {compute[0]:.2f} / {compute[1]:.2f} s | {both('other')} | "
            f"**{100 * o['wire_own_fraction']:+.1f}%**")


def report(r: dict[str, Any]) -> str:
    m = r.get("machine", {})
    lines = [f"Machine: {m.get('platform')}, {cpus(m)}, CUDA: {m.get('cuda')}.", ""]
    if "codec" in r:
        lines += ["## Codec throughput (encode + chunk + sha256 + reassemble + decode)", "",
                  "| model | parameters | wire dtype | payload | time | MB/s of payload |", "|---|---|---|---|---|---|"]
        lines += [f"| {x['model']} | {x['parameters'] / 1e6:.2f}M | {x['dtype']} | {x['payload_bytes'] / 1e6:.1f} MB | "
                  f"{x['seconds'] * 1000:.0f} ms | {x['throughput_MBps']:.0f} |" for x in r["codec"]]
    if "bytes" in r:
        lines += ["", "## Bytes on the wire per silo and round (SemiFL, small_cnn)", "",
                  "| model sent as | raw fp32 model | down per silo | up per silo | down / raw | up / raw |",
                  "|---|---|---|---|---|---|"]
        lines += [f"| {x['model_sent_as']} | {x['raw_fp32_bytes'] / 1e3:.1f} KB | {x['down_bytes_per_silo'] / 1e3:.1f} KB"
                  f" | {x['up_bytes_per_silo'] / 1e3:.1f} KB | {x['down_vs_raw']:.2f} | {x['up_vs_raw']:.2f} |"
                  for x in r["bytes"]]
    if "overhead" in r:
        lines += ["", "## Deployment overhead (same SemiFL rounds, same data and seeds)", "",
                  "In-process (silo_sim/inprocess.py) against silo-sim over gRPC + mutual TLS with one worker process "
                  "(silos train one after another in both); each way run several times, alternating, medians "
                  "compared. Target: overhead < 5% of round time.", "",
                  "Computation: the silos' local training plus the hub's aggregation (its fine-tune included) and "
                  "scoring, timed the same way in both. Other: the rest of the round's time (over the wire: hand-out, "
                  "transfers, checks, waiting). The wire's own cost: how much longer Other is over the wire, against "
                  "the in-process run's time; unlike the totals it does not move when the machine runs the same "
                  "computation faster or slower from one run to the next.", "",
                  "| silos | unlabeled images | rounds x runs | in-process | over the wire | overhead | overhead "
                  "after round 1 | computation, in-process / wire | other, in-process / wire | the wire's own cost | "
                  "final accuracy in-process / wire |", "|---|---|---|---|---|---|---|---|---|---|---|"]
        rows = r["overhead"] if isinstance(r["overhead"], list) else [r["overhead"]]
        lines += [f"| {o['silos']} | {o['unlabeled']} | {o['rounds']} x {o['repeats']} | {overhead_cells(o)} | "
                  f"{o['inprocess_final_accuracy']:.4f} / {o['wire_final_accuracy']:.4f} |" for o in rows]
    if "memory" in r:
        lines += ["", "## Hub peak memory vs reporting silos (one round; target: flat)", "",
                  "Growth while collecting: the hub's peak RSS while silos download and upload, minus its RSS when "
                  "the round opened (what the target is about). Process peak: the whole run, which also counts "
                  "start-up, evaluation and the hub's own training.", "",
                  "| model | silos reporting | uploads received | growth while collecting | hub process peak RSS |",
                  "|---|---|---|---|---|"]
        lines += [f"| {x.get('model', 'wrn28_2')} | {x['silos_reporting']} | {x['bytes_up_MB']:.1f} MB | "
                  f"{x['collecting_growth_MB']:.0f} MB | {x['hub_peak_rss_MB']:.0f} MB |" for x in r["memory"]]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
