"""silokit's silo-sim against Flower's simulation engine on the same workload: start-up, round time, overhead, memory.

Both engines run N silos (Flower: clients on N virtual SuperNodes), sample the same number each round for R rounds,
train silokit's small_cnn (`ModelSpec().build()`) with exactly K local SGD steps of plain supervised cross-entropy
(batches of 32, SGD lr 0.03, Nesterov momentum 0.9, weight decay 5e-4, clip 1.0: the same `train_supervised` and
optimiser settings on both sides) on an IID shard of the real Fashion-MNIST training split, average the results
(FedAvg, weighted by image count) and score the new model on the same number of test images. What differs is the
framework around that work:

- silokit: `silo-sim --algorithm supervised` with the hub's own training turned off (no hub epochs, the hub not a
  participant): a hub process and worker-process silo hosts over real gRPC and mutual TLS, images staged as files,
  every silo with its own certificate; the hub still computes its static batch-norm statistics on its
  `--labels-per-class` images each round (part of silokit's aggregation).
- Flower 1.42: `flwr.simulation.run_simulation` with the Ray backend, one CPU per client (as many clients training
  at once as silokit has silo hosts on a machine of that many cores), the ServerApp/ClientApp API with
  `flwr.server.strategy.FedAvg` and its central `evaluate_fn`; every client's process holds the training split
  once and takes its shard by index.

Measured per engine and N: launch to round-1 start (silokit: from starting silo-sim, staging included, to the hub's
"round 1 attempt 1: sampled" log line; Flower: from starting its interpreter to `configure_fit` of round 1); the
round time as each framework's round spans it (sampling to the scored model: silokit's `round_seconds`, Flower
from `configure_fit` to the end of the central `evaluate`); the cycle (one round start to the next, so silokit's
checkpoint write and both engines' gaps count); the sampled clients' training times (silokit: the client's
`local_update`, `silo_train_seconds` is their mean; Flower: the whole `fit` call, timed inside the client); and
the peak summed PSS of every process of the run (bench/systems/engines.py's /proc sampling, once a second).

Framework overhead per round = round time - (sum of the sampled clients' training seconds) / (clients training at
once). Each engine trains that many clients side by side (silokit: one silo at a time per silo host; Flower: one
client per Ray CPU), so the second term is the training's share of the round's wall time and the rest is the
framework's: sampling, sending and receiving the model, serialising, aggregating, scoring. The mean variant
(round time - mean training seconds) is in the JSON too.

Flower does not go into silokit's venv (it pins protobuf and grpcio and brings its own Ray). Make a separate one
that sees silokit's packages (torch, silo_core) through a .pth file; flwr's own dependencies land in it and come
first on its sys.path:

    python3 -m venv /tmp/flwr-venv
    echo /work/main/.venv/lib/python3.11/site-packages > /tmp/flwr-venv/lib/python3.11/site-packages/silokit.pth
    /tmp/flwr-venv/bin/pip install "flwr[simulation]==1.42.0"

Then, from the repository root with silokit's venv:

    .venv/bin/python bench/systems/flower_side_by_side.py --silos 10 --rounds 2 --max-load 0   # a quick check
    .venv/bin/python bench/systems/flower_side_by_side.py --silos 10 100 1000                   # the comparison

`--flower-python` names the Flower venv's interpreter (default /tmp/flwr-venv/bin/python); this file runs the Flower
half in it as a subprocess (`--flower-half`, internal). The machine is shared, so before each N the script waits up
to `--wait` seconds for the 1-minute load average to drop below `--max-load` (0: do not wait) and records the load
before and after every run; an N that never got a quiet machine is recorded as skipped. Writes
results/flower.json and flower.md (`--out` to write elsewhere).
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
import threading
import time
from datetime import datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bench.processor import cpus, machine  # noqa: E402

RESULTS = ROOT / "bench" / "systems" / "results"
DEFAULT_FLOWER_PYTHON = "/tmp/flwr-venv/bin/python"
BATCH_SIZE, LR = 32, 0.03
# silokit's hub logs this line (with its asctime) when it opens round 1 to the sampled silos.
ROUND_OPEN = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) INFO \S+: round (\d+) attempt 1: sampled")


# ------------------------------------------------------------------ what both halves report, and the summary
def round_opened_times(hub_log: str) -> dict[int, float]:
    """Epoch seconds at which silokit's hub opened each round's first attempt, from its log (local-time asctime)."""
    opened = {}
    for line in hub_log.splitlines():
        if match := ROUND_OPEN.match(line):
            stamp = datetime.strptime(match.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
            opened.setdefault(int(match.group(2)), stamp)
    return opened


def per_round(round_seconds: list[float], train_seconds: list[list[float]], starts: list[float],
              slots: int) -> list[dict[str, float]]:
    """Each round's wall time, its clients' training, the framework's overhead (see the module doc) and the cycle
    to the next round's start (none for the last round)."""
    rows = []
    for i, (seconds, trained) in enumerate(zip(round_seconds, train_seconds, strict=True)):
        row = {"round_seconds": seconds, "clients": len(trained), "train_sum_seconds": sum(trained),
               "train_mean_seconds": sum(trained) / len(trained) if trained else 0.0,
               "overhead_seconds": seconds - sum(trained) / slots}
        row["overhead_vs_mean_seconds"] = seconds - row["train_mean_seconds"]
        if i + 1 < len(starts):
            row["cycle_seconds"] = starts[i + 1] - starts[i]
        rows.append(row)
    return rows


def concurrency(intervals: list[tuple[float, float]]) -> float:
    """How many clients trained at once on average: their summed training time over the time in which at least
    one of them trained (1.0 when they ran one after the other)."""
    busy, end = 0.0, float("-inf")
    for start, stop in sorted(intervals):
        busy += max(0.0, stop - max(start, end))
        end = max(end, stop)
    return sum(stop - start for start, stop in intervals) / busy if busy else 0.0


def summarise(rows: list[dict[str, float]]) -> dict[str, float]:
    """Means over the rounds after the first (round 1 pays one-off costs: first model load, warm-up of every host),
    or over round 1 alone when it is the only one."""
    steady = rows[1:] or rows
    mean = {key: sum(r[key] for r in steady) / len(steady)
            for key in ("round_seconds", "train_sum_seconds", "overhead_seconds", "overhead_vs_mean_seconds")}
    cycles = [r["cycle_seconds"] for r in steady if "cycle_seconds" in r]
    if cycles:
        mean["cycle_seconds"] = sum(cycles) / len(cycles)
    return mean


# ------------------------------------------------------------------ memory of a process tree, sampled while it runs
# What each process of a run is, from its command line: the per-process figure in the table, so that a growth in one
# engine's memory shows where it is. First match wins.
ROLES = (
    ("[silokit-hub]", "hub"), ("[silokit-host", "silo host"), ("[silokit-staging]", "silo-sim staging"),
    # before the module names: the fork server's command line lists the modules it preloads
    ("multiprocessing.forkserver", "fork server (silo-sim's launcher, or a data loader's)"),
    ("silo_server.cli", "hub"), ("silo_sim.worker", "silo host"), ("silo_sim.prepare", "silo-sim staging"),
    ("silo_sim.cli", "silo-sim"), ("--flower-half", "Flower driver (ServerApp, strategy)"),
    ("ray::", "Ray worker (ClientApp)"), ("raylet", "Ray services"), ("gcs_server", "Ray services"),
    ("dashboard", "Ray services"), ("log_monitor", "Ray services"), ("runtime_env", "Ray services"),
    ("monitor.py", "Ray services"), ("ray/", "Ray services"),
)


def role_of(command_line: str) -> str:
    return next((role for marker, role in ROLES if marker in command_line), "other")


def by_role(pids: set[int], table: dict[int, tuple[int, str]], memory: dict[int, tuple[int, int]]
            ) -> dict[str, dict[str, float]]:
    """PSS (MB) per role: summed, the largest single process, and how many processes."""
    roles: dict[str, dict[str, float]] = {}
    for pid in pids:
        pss = memory[pid][1] / 1024
        role = roles.setdefault(role_of(table.get(pid, (0, ""))[1]), {"pss_MB": 0.0, "largest_MB": 0.0, "processes": 0})
        role["pss_MB"] += pss
        role["largest_MB"] = max(role["largest_MB"], pss)
        role["processes"] += 1
    return dict(sorted(roles.items(), key=lambda kv: -kv[1]["pss_MB"]))


def watch(proc: subprocess.Popen) -> tuple[dict[str, Any], list[str]]:
    """Wait for proc, sampling the PSS (and RSS) of it and all its descendants every second; returns the peak of
    their sum, with what each kind of process held at that moment (`roles`), and its output lines."""
    from bench.systems.engines import descendants, memory_kb, processes

    output: list[str] = []
    reader = threading.Thread(target=lambda: output.extend(proc.stdout), daemon=True)
    reader.start()
    peak: dict[str, Any] = {"pss_MB": 0.0, "rss_MB": 0.0, "processes": 0, "roles": {}}
    while proc.poll() is None:
        table = processes()
        pids = descendants({proc.pid}, table)
        memory = {p: memory_kb(p) for p in pids}
        rss, pss = (sum(v) for v in zip(*memory.values(), strict=True)) if pids else (0, 0)
        if pss / 1024 > peak["pss_MB"]:
            peak = {"pss_MB": pss / 1024, "rss_MB": rss / 1024, "processes": len(pids),
                    "roles": by_role(pids, table, memory)}
        time.sleep(1.0)
    reader.join(timeout=5)
    return peak, output


def load_average() -> float:
    return os.getloadavg()[0]


def cores_busy(over_s: float = 1.0) -> float | None:
    """CPU cores in use over the next `over_s` seconds, from /proc/stat (None where there is none)."""
    def ticks() -> tuple[int, int]:
        fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
        return sum(fields) - fields[3] - fields[4], sum(fields)  # busy (all but idle and iowait), all

    try:
        busy0, all0 = ticks()
        time.sleep(over_s)
        busy1, all1 = ticks()
    except OSError:
        return None
    return (busy1 - busy0) / max(1, all1 - all0) * (os.cpu_count() or 1)


def settle(max_busy: float = 0.25, wait_s: float = 60.0) -> float | None:
    """Wait (up to wait_s) until the machine is idle: the processes of the run before (Ray's among them) can go on
    working for seconds after it ends, and the load average lags a minute behind. Returns the cores last seen busy."""
    deadline = time.time() + wait_s
    busy = cores_busy()
    while busy is not None and busy > max_busy and time.time() < deadline:
        busy = cores_busy()
    return busy


# ------------------------------------------------------------------ silokit half
def run_silokit(args: argparse.Namespace, silos: int, workdir: Path) -> dict[str, Any]:
    work, out = workdir / f"silokit-{silos}" / "work", workdir / f"silokit-{silos}" / "out"
    command = [sys.executable, "-m", "silo_sim.cli", "--algorithm", "supervised", "--silos", str(silos),
               "--silos-per-round-count", str(args.per_round), "--rounds", str(args.rounds), "--model", "small_cnn",
               "--data", f"fashion-mnist:{args.data_root}", "--labels-per-class", str(args.labels_per_class),
               "--test-per-class", str(args.test_per_class), "--workers", str(args.slots),
               "--option", f"local_steps={args.local_steps}", "--option", f"silo_batch_size={BATCH_SIZE}",
               "--option", f"lr={LR}", "--option", "lr_schedule=constant", "--option", "init_epochs=0",
               "--option", "hub_epochs=0", "--option", "hub_participates=false",
               "--no-baseline", "--seed", "0", "--workdir", str(work), "--out", str(out)]
    load_before = load_average()
    launched = time.time()
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT)
    peak, output = watch(proc)
    wall = time.time() - launched
    if proc.returncode != 0:
        raise SystemExit(f"silo-sim at {silos} silos failed (exit {proc.returncode}):\n{''.join(output)[-3000:]}")
    rounds = json.loads((out / "summary.json").read_text())["rounds"]
    opened = round_opened_times((work / "logs" / "hub.log").read_text())
    starts = [opened[r["round"]] for r in rounds]
    # The hub reports the reporting silos' mean training time; every sampled silo reported (checked below).
    trained = [[r["silo_train_seconds"]] * r["silos_reported"] for r in rounds]
    rows = per_round([r["round_seconds"] for r in rounds], trained, starts, args.slots)
    for row, r in zip(rows, rounds, strict=True):
        row.update(evaluation_seconds=r.get("evaluation_seconds") or 0.0,
                   aggregation_seconds=r.get("aggregation_seconds") or 0.0,
                   checkpoint_seconds=r.get("checkpoint_seconds") or 0.0, test_accuracy=r.get("test_accuracy"))
    short = [r["round"] for r in rounds if r["silos_reported"] != args.per_round]
    staged = re.search(r"staged in ([\d.]+)s", "".join(output))
    return {"engine": "silokit", "silos": silos, "launch_to_round1_seconds": starts[0] - launched,
            "launch_to_round1_end_seconds": starts[0] + rows[0]["round_seconds"] - launched,
            "staging_seconds": float(staged.group(1)) if staged else None,
            "wall_seconds": wall, "rounds": rows, "steady": summarise(rows), "peak_memory": peak,
            "rounds_short_of_clients": short, "load_before": load_before, "load_after": load_average(),
            "command": " ".join(["python"] + command[1:]).replace(str(workdir), "$WORK")}


# ------------------------------------------------------------------ Flower half
def run_flower(args: argparse.Namespace, silos: int, workdir: Path) -> dict[str, Any]:
    report = workdir / f"flower-{silos}.json"
    settings = {"silos": silos, "per_round": args.per_round, "rounds": args.rounds, "local_steps": args.local_steps,
                "test_per_class": args.test_per_class, "data_root": str(args.data_root), "slots": args.slots,
                "report": str(report)}
    command = [args.flower_python, str(Path(__file__).resolve()), "--flower-half", json.dumps(settings)]
    load_before = load_average()
    launched = time.time()
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT)
    peak, output = watch(proc)
    wall = time.time() - launched
    if proc.returncode != 0 or not report.exists():
        raise SystemExit(f"the Flower half at {silos} clients failed (exit {proc.returncode}):\n"
                         f"{''.join(output)[-3000:]}")
    got = json.loads(report.read_text())
    rounds = got["rounds"]
    starts = [r["started"] for r in rounds]
    rows = per_round([r["ended"] - r["started"] for r in rounds], [r["fit_seconds"] for r in rounds], starts,
                     args.slots)
    for row, r in zip(rows, rounds, strict=True):
        row.update(evaluation_seconds=r["evaluation_seconds"], aggregation_seconds=r["aggregation_seconds"],
                   failures=r["failures"], test_accuracy=r["test_accuracy"], client_processes=r["client_processes"],
                   training_at_once=concurrency(r["fit_intervals"]))
    short = [i + 1 for i, r in enumerate(rounds) if len(r["fit_seconds"]) != args.per_round]
    return {"engine": "flower", "silos": silos, "launch_to_round1_seconds": starts[0] - launched,
            "launch_to_round1_end_seconds": rounds[0]["ended"] - launched,
            "wall_seconds": wall, "rounds": rows, "steady": summarise(rows), "peak_memory": peak,
            "rounds_short_of_clients": short, "load_before": load_before, "load_after": load_average(),
            "versions": got["versions"],
            "command": f"{args.flower_python} bench/systems/flower_side_by_side.py --flower-half "
                       f"'{json.dumps({**settings, 'report': '$WORK/flower.json'})}'"}


def flower_half(settings: dict[str, Any]) -> int:
    """Runs in the Flower venv: one Flower simulation of the workload; writes its timings to settings['report']."""
    import flwr
    import numpy as np
    import ray
    import torch
    from flwr.client import ClientApp, NumPyClient
    from flwr.common import Context, ndarrays_to_parameters
    from flwr.server import ServerApp, ServerAppComponents, ServerConfig
    from flwr.server.strategy import FedAvg

    from silo_core.algorithms.supervised import SupervisedOptions
    from silo_core.augment import to_float
    from silo_core.data import load_torchvision
    from silo_core.models import ModelSpec
    from silo_core.training import seeded_generator, train_supervised

    spec, cpu = ModelSpec(), torch.device("cpu")
    # silokit's supervised silo optimiser settings with this run's learning rate, constant over the rounds.
    options = SupervisedOptions(lr=LR, lr_schedule="constant", silo_batch_size=BATCH_SIZE,
                                local_steps=settings["local_steps"])
    silos, per_round, report = settings["silos"], settings["per_round"], Path(settings["report"])

    def shards(count: int) -> list[np.ndarray]:
        order = np.random.default_rng(0).permutation(60_000)  # Fashion-MNIST's training split, IID
        return np.array_split(order, count)

    cached: dict[str, Any] = {}

    def training_split():  # once per process: Ray reuses its client processes
        if "train" not in cached:
            torch.set_num_threads(1)  # one CPU per client, as silo-sim gives each silo host cores / hosts
            cached["train"] = load_torchvision("FashionMNIST", settings["data_root"], True, 28, 1)
            cached["shards"] = shards(silos)
        return cached["train"], cached["shards"]

    def weights(model: torch.nn.Module) -> list[np.ndarray]:
        return [t.detach().cpu().numpy() for t in model.state_dict().values()]

    def load(model: torch.nn.Module, arrays: list[np.ndarray]) -> None:
        model.load_state_dict({k: torch.from_numpy(np.array(a)) for k, a in zip(model.state_dict(), arrays,
                                                                                 strict=True)})

    class ShardClient(NumPyClient):
        def __init__(self, partition: int):
            self.partition = partition

        def fit(self, parameters, config):
            started = time.perf_counter()
            data, parts = training_split()
            index = torch.from_numpy(parts[self.partition])
            model = spec.build()
            load(model, parameters)
            train_supervised(model, data.images[index], data.labels[index], epochs=1, steps=options.local_steps,
                             batch_size=options.silo_batch_size, lr=options.lr, opt=options.optimizer(),
                             mean=spec.mean, std=spec.std, device=cpu,
                             generator=seeded_generator(0, int(config["round"]), self.partition), flip=options.flip)
            result = weights(model)
            return result, len(index), {"fit_seconds": time.perf_counter() - started, "fit_ended": time.time(),
                                        "pid": os.getpid()}

    def client_fn(context: Context):
        training_split()  # outside fit's timing: loading the data is the client's start-up, not its round
        return ShardClient(int(context.node_config["partition-id"])).to_client()

    test = load_torchvision("FashionMNIST", settings["data_root"], False, 28, 1)
    keep = torch.cat([torch.nonzero(test.labels == c).flatten()[:settings["test_per_class"]] for c in range(10)])
    test_x, test_y = test.images[keep], test.labels[keep]
    rounds: list[dict[str, Any]] = []

    def evaluate_fn(server_round: int, arrays: list[np.ndarray], config):
        model = spec.build()
        load(model, arrays)
        model.eval()
        with torch.no_grad():
            correct = sum(int((model(to_float(test_x[i:i + 500], spec.mean, spec.std)).argmax(1)
                               == test_y[i:i + 500]).sum()) for i in range(0, len(test_y), 500))
        return 0.0, {"accuracy": correct / len(test_y)}

    class TimedFedAvg(FedAvg):
        """FedAvg that records when each round starts and ends and what its clients reported."""

        def configure_fit(self, server_round, parameters, client_manager):
            rounds.append({"started": time.time()})
            return super().configure_fit(server_round, parameters, client_manager)

        def aggregate_fit(self, server_round, results, failures):
            fits = [fit.metrics for _, fit in results]
            rounds[-1].update(fit_seconds=[f["fit_seconds"] for f in fits], failures=len(failures),
                              fit_intervals=[(f["fit_ended"] - f["fit_seconds"], f["fit_ended"]) for f in fits],
                              client_processes=len({f["pid"] for f in fits}))
            started = time.time()
            aggregated = super().aggregate_fit(server_round, results, failures)
            rounds[-1]["aggregation_seconds"] = time.time() - started
            return aggregated

        def evaluate(self, server_round, parameters):
            started = time.time()
            scored = super().evaluate(server_round, parameters)
            if server_round > 0:  # round 0 scores the initial model before round 1 opens
                rounds[-1].update(ended=time.time(), evaluation_seconds=time.time() - started,
                                  test_accuracy=scored[1]["accuracy"] if scored else None)
                report.write_text(json.dumps({"rounds": rounds, "versions": versions}))
            return scored

    torch.manual_seed(0)
    strategy = TimedFedAvg(fraction_fit=per_round / silos, min_fit_clients=per_round, min_available_clients=silos,
                           fraction_evaluate=0.0, min_evaluate_clients=0, evaluate_fn=evaluate_fn,
                           on_fit_config_fn=lambda r: {"round": r},
                           initial_parameters=ndarrays_to_parameters(weights(spec.build())))
    versions = {"flwr": flwr.__version__, "ray": ray.__version__, "torch": torch.__version__}
    server = ServerApp(server_fn=lambda context: ServerAppComponents(
        strategy=strategy, config=ServerConfig(num_rounds=settings["rounds"])))
    from flwr.simulation import run_simulation

    run_simulation(server_app=server, client_app=ClientApp(client_fn=client_fn), num_supernodes=silos,
                   backend_config={"client_resources": {"num_cpus": 1, "num_gpus": 0.0},
                                   "init_args": {"num_cpus": settings["slots"]}})
    # The strategy writes the report after each scored round (it may run in another thread or process).
    done = json.loads(report.read_text())["rounds"] if report.exists() else []
    if len(done) != settings["rounds"]:
        print(f"error: Flower finished {len(done)} of {settings['rounds']} rounds", file=sys.stderr)
        return 1
    return 0


# ------------------------------------------------------------------ the comparison
def wait_for_quiet(max_load: float, wait_s: float) -> bool:
    if max_load <= 0:
        return True
    deadline = time.time() + wait_s
    while load_average() >= max_load:
        if time.time() > deadline:
            return False
        time.sleep(15)
    return True


def start_up_spread(runs: list[dict[str, Any]]) -> dict[tuple[int, str], dict[str, float]]:
    """Launch to round 1 by (silos, engine), for those measured more than once: median, low, high, runs."""
    times: dict[tuple[int, str], list[tuple[float, float]]] = {}
    for run in runs:
        if "launch_to_round1_seconds" in run:
            times.setdefault((run["silos"], run["engine"]), []).append(
                (run["launch_to_round1_seconds"], run["launch_to_round1_end_seconds"]))
    return {key: {"median": statistics.median(s for s, _ in pairs), "low": min(s for s, _ in pairs),
                  "high": max(s for s, _ in pairs), "median_end": statistics.median(e for _, e in pairs),
                  "runs": len(pairs)}
            for key, pairs in times.items() if len(pairs) > 1}


def markdown(result: dict[str, Any]) -> str:
    s, m = result["settings"], result["machine"]
    lines = [f"# silokit (silo-sim) against Flower {m.get('flwr', '?')} simulation: same workload", "",
             f"{s['per_round']} clients sampled per round, {s['rounds']} rounds, small_cnn, {s['local_steps']} local "
             f"SGD steps of {BATCH_SIZE} images, real Fashion-MNIST (IID shards of the 60,000 training images), "
             f"{10 * s['test_per_class']} test images scored each round; {s['slots']} clients train at once on each "
             f"engine. Machine: {cpus(m)}, {m['platform']}, Python {m['python']}, torch {m['torch']}, "
             f"Flower {m.get('flwr', '?')} with Ray {m.get('flower_ray', '?')}. Command: `{s['command']}`.", "",
             "Steady state: the mean over rounds 2..R (round 1 alone when R = 1). Overhead: round time minus the "
             "sampled clients' summed training time divided by the clients training at once. Launch to round 1: "
             "to its start (in brackets, to its scored model; silokit's staging of the images as files and of the "
             "certificates is part of it).", "",
             "| silos | engine | launch to round 1 start (end) | round time | cycle (start to start) | clients' training (sum) | "
             "overhead per round | peak PSS, all processes (RSS) | load average before / after |",
             "|---|---|---|---|---|---|---|---|---|"]
    for run in result["runs"]:
        if "skipped" in run:
            lines.append(f"| {run['silos']} | {run['engine']} | skipped: {run['skipped']} | | | | | | |")
            continue
        st, mem = run["steady"], run["peak_memory"]
        cycle = f"{st['cycle_seconds']:.2f} s" if "cycle_seconds" in st else "-"
        staging = f", staging {run['staging_seconds']:.0f} s" if run.get("staging_seconds") is not None else ""
        lines.append(
            f"| {run['silos']:,} | {run['engine']} | {run['launch_to_round1_seconds']:.1f} s "
            f"({run['launch_to_round1_end_seconds']:.1f} s{staging}) | "
            f"{st['round_seconds']:.2f} s | {cycle} | {st['train_sum_seconds']:.2f} s | "
            f"**{st['overhead_seconds']:.2f} s** | {mem['pss_MB']:,.0f} MB ({mem['rss_MB']:,.0f} MB, "
            f"{mem['processes']} processes) | {run['load_before']:.1f} / {run['load_after']:.1f} |")
    repeated = start_up_spread(result["runs"])
    if repeated:
        lines += ["", "Launch to round 1 over the repeated runs (`--repeat`; start-up moves by about half a second "
                  "from run to run on this machine): median and range of its start, and the median to its scored "
                  "model:",
                  ""]
        lines += [f"- {silos:,} silos, {engine}: **{s['median']:.1f} s** ({s['low']:.1f}-{s['high']:.1f} s over "
                  f"{s['runs']} runs), scored model {s['median_end']:.1f} s" for (silos, engine), s in repeated.items()]
    busy = [run["cores_busy_before"] for run in result["runs"] if run.get("cores_busy_before") is not None]
    if busy:
        lines += ["", f"Each run started once the machine was idle (at most 0.25 cores busy over a second, waited for "
                      f"up to a minute): {min(busy):.2f}-{max(busy):.2f} cores busy just before the runs."]
    lines += ["", "Peak PSS by process, at the moment the sum peaked (MB: summed over the processes of that kind, "
              "and the largest one):", ""]
    for run in result["runs"]:
        roles = run.get("peak_memory", {}).get("roles")
        if roles:
            lines.append(f"- {run['silos']:,} silos, {run['engine']}: " + "; ".join(
                f"{name} {r['pss_MB']:,.0f}" + (f" ({r['processes']} processes, largest {r['largest_MB']:,.0f})"
                                                if r["processes"] > 1 else "") for name, r in roles.items()))
    lines += ["", "Per round (round time / overhead, seconds):", ""]
    for run in result["runs"]:
        if "rounds" in run:
            measured = [r["training_at_once"] for r in run["rounds"] if "training_at_once" in r]
            lines.append(f"- {run['silos']:,} silos, {run['engine']}: " + ", ".join(
                f"{r['round_seconds']:.2f} / {r['overhead_seconds']:.2f}" for r in run["rounds"])
                + (f" (clients training at once, measured from the fit calls' times: "
                   f"{', '.join(f'{m:.2f}' for m in measured)})" if measured else ""))
    lines += ["", "Commands each engine ran:", ""]
    for run in result["runs"]:
        if "command" in run:
            lines.append(f"- {run['silos']:,} silos, {run['engine']}: `{run['command']}`")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--silos", type=int, nargs="+", default=[10, 100, 1000], help="silo counts to compare")
    p.add_argument("--per-round", type=int, default=10, help="silos sampled per round (default 10)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--local-steps", type=int, default=10, help="SGD steps per sampled silo per round")
    p.add_argument("--labels-per-class", type=int, default=10,
                   help="silokit's hub labels per class (its static batch-norm statistics; default 10)")
    p.add_argument("--test-per-class", type=int, default=100, help="test images per class scored each round")
    p.add_argument("--slots", type=int, default=os.cpu_count() or 2,
                   help="clients training at once: silo-sim's silo hosts and Flower's Ray CPUs (default: cores)")
    p.add_argument("--data-root", type=Path, default=Path(os.environ.get("SILOKIT_DATA", ROOT.parent / "shared" / "data")),
                   help="folder holding FashionMNIST/raw (default $SILOKIT_DATA or ../shared/data)")
    p.add_argument("--flower-python", default=DEFAULT_FLOWER_PYTHON,
                   help=f"the interpreter of a venv with flwr[simulation]==1.42.0 (default {DEFAULT_FLOWER_PYTHON})")
    p.add_argument("--engines", nargs="+", choices=("silokit", "flower"), default=["silokit", "flower"])
    p.add_argument("--max-load", type=float, default=3.0,
                   help="run an N only when the 1-minute load average is below this (0: do not wait)")
    p.add_argument("--wait", type=float, default=1800, help="seconds to wait for that per N before skipping it")
    p.add_argument("--repeat", type=int, default=1,
                   help="runs of each engine at each silo count, the engines alternating (default 1); the table lists "
                        "every run and, for start-up, which varies from run to run, the median and range")
    p.add_argument("--out", type=Path, default=RESULTS)
    p.add_argument("--flower-half", metavar="JSON", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.flower_half:
        return flower_half(json.loads(args.flower_half))
    if not (args.data_root / "FashionMNIST" / "raw").is_dir():
        p.error(f"--data-root {args.data_root} has no FashionMNIST/raw; point it at the folder holding "
                "torchvision's Fashion-MNIST files")
    if "flower" in args.engines and not Path(args.flower_python).exists():
        p.error(f"--flower-python {args.flower_python} does not exist; make the Flower venv as the module doc says "
                "or pass its interpreter")
    if min(args.silos) < args.per_round or args.per_round < 1 or args.rounds < 1 or args.local_steps < 1:
        p.error("--silos must each be at least --per-round, and --per-round, --rounds and --local-steps at least 1")
    if args.repeat < 1:
        p.error("--repeat must be at least 1")

    machine_info = machine()
    command = " ".join([".venv/bin/python bench/systems/flower_side_by_side.py"] + (argv if argv is not None
                                                                                      else sys.argv[1:]))
    runs: list[dict[str, Any]] = []
    result = {"settings": {"silos": args.silos, "per_round": args.per_round, "rounds": args.rounds,
                           "local_steps": args.local_steps, "labels_per_class": args.labels_per_class,
                           "test_per_class": args.test_per_class, "slots": args.slots, "repeat": args.repeat,
                           "command": command},
              "machine": machine_info, "runs": runs}

    def save() -> None:  # after every run, so a long comparison that fails later keeps what it measured
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "flower.json").write_text(json.dumps(result, indent=2))
        (args.out / "flower.md").write_text(markdown(result))

    with tempfile.TemporaryDirectory(prefix="flower-side-by-side-") as tmp:
        for silos in args.silos:
            if not wait_for_quiet(args.max_load, args.wait):
                why = f"load average stayed at or above {args.max_load} for {args.wait:.0f} s (now {load_average():.1f})"
                runs += [{"engine": e, "silos": silos, "skipped": why} for e in args.engines]
                save()
                continue
            for repeat, engine in [(i, e) for i in range(args.repeat) for e in args.engines]:
                workdir = Path(tmp) / f"repeat-{repeat}"  # a run of its own: a hub would resume another's state
                workdir.mkdir(exist_ok=True)
                busy = settle() if args.max_load > 0 else None
                run = (run_silokit if engine == "silokit" else run_flower)(args, silos, workdir)
                run["cores_busy_before"] = busy
                if engine == "flower":
                    machine_info.update(flwr=run["versions"]["flwr"], flower_ray=run["versions"]["ray"])
                runs.append(run)
                save()
                print(f"{silos} silos, {engine}: round 1 after {run['launch_to_round1_seconds']:.1f} s, overhead "
                      f"{run['steady']['overhead_seconds']:.2f} s/round, peak PSS "
                      f"{run['peak_memory']['pss_MB']:.0f} MB (load {run['load_before']:.1f})", flush=True)
    save()
    print(markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
