"""silo-sim: a hub and N silos on this machine, over the real wire stack (gRPC, mutual TLS, real image files).

With no arguments it runs the demo: the bundled Fashion-MNIST subset, SemiFL, a few rounds tuned to finish in a few
minutes on two CPU cores, then a summary table beside the server-only baseline trained on the same labels.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from silo_core.rounds import RoundRecord, Scores, nan_if_none, records_from_json
from silo_core.selection import BestRound
from silo_sim.stage import DATA_HELP, load_source

console = Console(stderr=False)
if not console.is_terminal:  # logs and pipes: wide enough that the summary table is never truncated
    console = Console(stderr=False, width=120)

# Demo defaults: tuned so the whole demo takes a few minutes on 2 CPU cores and shows what silos add. They differ
# from the paper's (which needs hundreds of rounds): tau 0.8 instead of 0.95 lets pseudo-labels cover more classes
# early, a constant LR keeps the hub's fine-tune effective to the last round, and fewer, larger local batches keep
# a round short on a CPU. hub.yaml defaults stay the paper's. Every algorithm gets the same budget: 5 hub epochs
# on the labels before round 1 and per round, 2 local epochs, lr 0.03, so the sim compares like with like.
_SEMIFL_DEMO: dict[str, Any] = {
    "tau": 0.8,
    "hub_epochs": 5,
    "local_epochs": 2,
    "silo_batch_size": 32,
    "hub_batch_size": 16,
    "lr": 0.03,
    "lr_schedule": "constant",
}
_FEDAVG_DEMO: dict[str, Any] = {"init_epochs": 5, "hub_epochs": 5, "local_epochs": 2, "silo_batch_size": 32,
                                "hub_batch_size": 16, "lr": 0.03, "lr_schedule": "constant"}
DEMO_OPTIONS: dict[str, dict[str, Any]] = {
    "semifl": _SEMIFL_DEMO,
    "server-only": _SEMIFL_DEMO,
    "fedseal": {**_FEDAVG_DEMO, "nesterov": True},
    "fedavg-fixmatch": {**_FEDAVG_DEMO, "tau": 0.8},
    "supervised": _FEDAVG_DEMO,
    "hassle": {"hub_warmup_epochs": 5, "hub_epochs": 5, "hub_batch_size": 16, "local_epochs": 2, "batch_size": 32,
               "lr": 0.03, "lr_schedule": "constant"},
}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="silo-sim", description=__doc__.splitlines()[0])
    p.add_argument("--silos", type=int, default=4, help="number of simulated silos (default 4; up to 100+)")
    p.add_argument("--rounds", type=int, default=20, help="communication rounds (default 20)")
    p.add_argument("--algorithm", default="semifl",
                   help="semifl, fedseal, hassle, server-only, fedavg-fixmatch or supervised (the simulation-only "
                        "ceiling: silos train on their true labels)")
    p.add_argument("--labels-per-class", type=int, default=25, help="labeled images per class at the hub (default 25)")
    p.add_argument("--unlabeled", type=int, default=None,
                   help="unlabeled images spread over the silos (default: all 6000 bundled minus the hub's labels)")
    p.add_argument("--test-per-class", type=int, default=None, metavar="N",
                   help="evaluate on N test images per class (default: all 2000 bundled test images)")
    p.add_argument("--partition", choices=["iid", "classes", "dirichlet"], default="iid")
    p.add_argument("--alpha", type=float, default=0.3, help="Dirichlet alpha (with --partition dirichlet)")
    p.add_argument("--classes-per-silo", type=int, default=2, help="with --partition classes")
    per_round = p.add_mutually_exclusive_group()
    per_round.add_argument("--silos-per-round", type=float, metavar="FRACTION",
                           help="fraction of the silos sampled each round, in (0, 1] (default 1.0: all)")
    per_round.add_argument("--silos-per-round-count", type=int, metavar="N",
                           help="number of silos sampled each round (instead of a fraction)")
    p.add_argument("--labeled-silos", type=int, default=0, metavar="K",
                   help="the first K silos are partly labeled (HASSLE trains on their labels; default 0)")
    p.add_argument("--silo-labels-per-class", type=int, default=5, metavar="N",
                   help="labeled images per class kept by each partly labeled silo (default 5)")
    p.add_argument("--attackers", type=int, default=0, metavar="K",
                   help="simulation only: the first K silos poison their updates after honest training, to measure "
                        "hub.yaml aggregation.rule (default 0; see --attack)")
    p.add_argument("--attack", default="sign_flip", metavar="KIND",
                   help="with --attackers: sign_flip sends -10 x the honest model change, noise a Gaussian model "
                        "change of deviation 1 per weight, weight a weight of -30 x its own (refused in the clear; "
                        "under secure aggregation the hub finds and quarantines it) (silo_sim/attacks.py; default "
                        "sign_flip)")
    p.add_argument("--silo-policy", action="append", default=[], metavar="[N=]FILE",
                   help="a branch privacy policy (branch-policy.yaml, as silo-client --policy) for every silo, or "
                        "with N= for silo N only (1-based; repeatable, the specific one wins): the silo refuses a run "
                        "whose terms fall short of it before reading any image")
    p.add_argument("--validation-per-class", type=int, default=None, metavar="N",
                   help="held-out labeled validation images per class at the hub: the hub scores every round on "
                        "them and keeps the best round's model (best_model.safetensors); staged with 20 per class "
                        "for algorithms that need one (FedSEAL's thresholds) even when not given")
    p.add_argument("--workers", type=int,
                   help="silo hosts: worker processes, or Ray actors with --engine ray (default: one per CPU core, "
                        "with --engine ray as many as the cluster holds at --silo-cpus/--silo-gpus; at most --silos)")
    p.add_argument("--load-at-join", action="store_true",
                   help="each silo decodes its images before it joins, as silo-client does (default: a silo joins on "
                        "its file count and decodes them when first sampled, so silos a run never samples cost no "
                        "decoding and round 1 starts sooner)")
    p.add_argument("--engine", choices=["workers", "ray"], default="workers",
                   help="what hosts the silos: worker processes on this machine (default) or Ray actors (the ray "
                        'extra: pip install -e ".[ray]"); the hub is a local process either way')
    p.add_argument("--ray-address", metavar="ADDRESS",
                   help="with --engine ray: join this Ray cluster (e.g. 127.0.0.1:6379) instead of starting and "
                        "stopping a local Ray")
    p.add_argument("--silo-cpus", type=float, metavar="N",
                   help="with --engine ray: CPUs each silo host actor requests, the share of one silo at work "
                        "(fractions allowed; default 1)")
    p.add_argument("--silo-gpus", type=float, metavar="N",
                   help="with --engine ray: GPUs each silo host actor requests (fractions allowed; default 0)")
    p.add_argument("--ship-silo-files", action="store_true",
                   help="with --engine ray: send each actor its silos' certificates and images (one archive per "
                        "actor, unpacked in a temporary folder on its node and removed after), for a cluster whose "
                        "nodes do not share this machine's file system")
    p.add_argument("--hub-host", default="127.0.0.1", metavar="HOST",
                   help="the address the hub listens on and the silos dial (default 127.0.0.1: this machine only); "
                        "for Ray actors on other machines, an address of this machine they can reach. The hub's "
                        "certificate names it")
    p.add_argument("--option", action="append", default=[], metavar="KEY=VALUE",
                   help="algorithm option (repeatable), e.g. --option tau=0.9 --option local_epochs=2")
    p.add_argument("--hub-set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="set any hub.yaml key (YAML value), e.g. privacy.secure_aggregation.enabled=true; repeatable")
    p.add_argument("--model", choices=["small_cnn", "wrn28_2"], default="small_cnn",
                   help="network (both take any image size, grayscale or colour)")
    p.add_argument("--data", default="demo", metavar="SOURCE", help=f"the images: {DATA_HELP}")
    p.add_argument("--image-size", type=int, metavar="PIXELS",
                   help="the side the model takes (default: the data's, e.g. 28 for Fashion-MNIST, 32 for CIFAR-10, "
                        "a folder's first image)")
    p.add_argument("--half-precision", action="store_true", help="send the model to silos as float16")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="auto")
    p.add_argument("--out", type=Path, help="write summary.json (every round's metrics, baseline, settings) here")
    p.add_argument("--workdir", type=Path, help="stage everything here and keep it (default: a temp dir, removed)")
    p.add_argument("--export-demo", type=Path, metavar="DIR",
                   help="only stage the demo federation (images, certificates, hub.yaml) in DIR and print how to run it")
    p.add_argument("--no-baseline", action="store_true", help="skip the server-only baseline")
    p.add_argument("--prometheus-targets", type=Path, metavar="DIR",
                   help="write Prometheus file_sd target files (hub.yml, silos.yml) for the hub's and the workers' "
                        "/metrics endpoints here, e.g. ops/prometheus/targets (see docs/operations.md)")
    p.add_argument("--verbose", "-v", action="store_true")
    return p


def parse_options(pairs: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for pair in pairs:
        if "=" not in pair:
            raise ValueError(f"--option {pair!r} must look like KEY=VALUE")
        key, raw = pair.split("=", 1)
        try:
            out[key] = json.loads(raw)
        except json.JSONDecodeError:
            out[key] = raw
    return out


def option_overrides(algorithm: str, given: dict[str, Any]) -> list[str]:
    """One line per --option that replaces a value the demo sets for this algorithm (DEMO_OPTIONS), so that a
    user comparing runs knows which of their values took the place of the demo's tuning."""
    demo = DEMO_OPTIONS.get(algorithm, {})
    return [f"--option {key}={json.dumps(value)} overrides the demo's {key}={json.dumps(demo[key])} for {algorithm}"
            for key, value in given.items() if key in demo and demo[key] != value]


def silo_policies(values: list[str], silos: int) -> dict[str, str]:
    """--silo-policy [N=]FILE values as silo name -> policy file; each file is loaded once here, so a bad one fails
    before anything starts, naming the file and the key."""
    from silo_client.policy import load_policy
    from silo_sim.stage import silo_name

    every, one = None, {}
    for value in values:
        index, sep, path = value.partition("=")
        if not sep:
            index, path = "", value
        elif not index.isdigit() or not 1 <= int(index) <= silos:
            raise ValueError(f"--silo-policy {value!r}: N must be a silo number from 1 to --silos ({silos})")
        load_policy(Path(path))
        if index:
            one[silo_name(int(index))] = str(Path(path).resolve())
        else:
            every = str(Path(path).resolve())
    return {silo_name(i): one.get(silo_name(i), every) for i in range(1, silos + 1)
            if one.get(silo_name(i), every) is not None}


def rounds_sampling(args: argparse.Namespace) -> dict[str, Any]:
    """The hub.yaml key for --silos-per-round or --silos-per-round-count (none: the hub's default, every silo).
    Only the given one is set, so --hub-set can still choose the other."""
    if args.silos_per_round is not None:
        if not 0 < args.silos_per_round <= 1:
            raise ValueError(f"--silos-per-round is a fraction in (0, 1], got {args.silos_per_round:g}; for a "
                             f"number of silos use --silos-per-round-count")
        return {"silos_per_round": args.silos_per_round}
    if args.silos_per_round_count is not None:
        if args.silos_per_round_count < 1:
            raise ValueError("--silos-per-round-count must be at least 1")
        return {"silos_per_round_count": args.silos_per_round_count}
    return {}


def validation_per_class(args: argparse.Namespace, needed: bool) -> int | None:
    """Images per class of the hub's validation split: as given, else 20 where the algorithm needs one."""
    if args.validation_per_class is not None:
        if args.validation_per_class < 0:
            raise SystemExit("--validation-per-class must be 0 or more")
        return args.validation_per_class or None
    return 20 if needed else None


def apply_hub_settings(config: dict[str, Any], pairs: list[str]) -> dict[str, Any]:
    """--hub-set privacy.dp.enabled=true: set one hub.yaml key (a dotted path) to a YAML value, in place.
    The result is checked like a hub.yaml, so a typo fails here with the key named."""
    from silo_server.config import parse_config

    for pair in pairs:
        path, sep, raw = pair.partition("=")
        keys = path.split(".")
        if not sep or len(keys) < 2 or not all(keys):
            raise ValueError(f"--hub-set {pair!r} must look like SECTION.KEY=VALUE, e.g. "
                             "privacy.secure_aggregation.enabled=true")
        node = config
        for key in keys[:-1]:
            node = node.setdefault(key, {})
            if not isinstance(node, dict):
                raise ValueError(f"--hub-set {path}: {key} is a value, not a section")
        node[keys[-1]] = yaml.safe_load(raw)
    parse_config({**config, "data": {"labeled": {"kind": "demo"}}}, source="--hub-set")
    return config


def check_secure_aggregation_fits(config: dict[str, Any], silos: int) -> None:
    """A federation too small for secure aggregation's dropout tolerance would wait for silos that never come."""
    from security.secagg import SecAggParams

    section = config.get("privacy", {}).get("secure_aggregation", {})
    if not section.get("enabled"):
        return
    fewest = SecAggParams.model_validate(section).fewest_silos()
    if silos < fewest:
        dropouts = section.get("dropouts", 1)
        raise ValueError(f"secure aggregation needs at least {fewest} silos in a round to survive {dropouts} "
                         f"dropout(s); run --silos {fewest} or more, or accept no dropout tolerance with "
                         "--hub-set privacy.secure_aggregation.dropouts=0")


def _terminate(procs: list[subprocess.Popen], grace: float = 10.0) -> None:
    for p in procs:
        if p.poll() is None:
            p.terminate()
    end = time.time() + grace
    for p in procs:
        try:
            p.wait(timeout=max(0.1, end - time.time()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def _read_history(path: Path) -> tuple[list[RoundRecord], Scores]:
    """The hub's history.json: its rounds and the initial model's scores (none while the hub has not written it)."""
    try:
        saved = json.loads(path.read_text())
    except (OSError, ValueError):
        return [], Scores()
    return records_from_json(saved.get("rounds", [])), Scores.from_json(saved.get("initial", {}))


def hub_port(staged) -> int:
    """The port the hub will listen on, known before it starts so that the silo hosts start beside it: the staged
    hub.yaml's server.port, or (0, the sim's default) a free one picked here and handed to silo-server --port."""
    server = yaml.safe_load(staged.hub_config.read_text()).get("server") or {}
    if int(server.get("port", 0)):
        return int(server["port"])
    import socket

    with socket.create_server((server.get("host", "127.0.0.1"), 0)) as probe:
        return probe.getsockname()[1]


@dataclass
class Launched:
    """The hub and the worker processes, started as soon as the hub's part of the staging is written (launch):
    their imports and the hub's loading run while the silos' files are still being linked, and each worker waits
    for its spec file before it sets its silos up."""

    hub: subprocess.Popen
    port: int
    workers: list[subprocess.Popen]
    started: float

    @property
    def procs(self) -> list[subprocess.Popen]:
        return [self.hub, *self.workers]


def host_count(args: argparse.Namespace, silos: int) -> int:
    """Silo hosts: --workers, else one per core; never more than silos; none for a hub-only algorithm."""
    if not getattr(args, "needs_silos", True):
        return 0
    return max(1, min(args.workers or os.cpu_count() or 2, silos))


def launch(staged, args) -> Launched:
    """Start the hub, and with the default engine the worker processes (each waits for its worker-N.json)."""
    logs = staged.root / "logs"
    logs.mkdir(exist_ok=True)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    started = time.time()
    port = hub_port(staged)
    hub = subprocess.Popen([sys.executable, "-m", "silo_server.cli", "--config", str(staged.hub_config),
                            "--port", str(port)],
                           stdout=open(logs / "hub.log", "w"), stderr=subprocess.STDOUT, env=env)
    workers = []
    if getattr(args, "engine", "workers") != "ray":
        for w in range(host_count(args, args.silos)):
            spec_path = staged.root / f"worker-{w}.json"
            spec_path.unlink(missing_ok=True)
            workers.append(subprocess.Popen([sys.executable, "-m", "silo_sim.worker", "--spec", str(spec_path),
                                             "--wait-for-spec"],
                                            stdout=open(logs / f"worker-{w}.log", "w"), stderr=subprocess.STDOUT,
                                            env=env))
    return Launched(hub, port, workers, started)


def run_federation(staged, args, rounds: int, launched: Launched | None = None) -> tuple[int, list[RoundRecord], float]:
    """Start the hub and the silo hosts (worker processes, or Ray actors with --engine ray) as real processes, or
    adopt those `launch` started while staging; follow progress; return (rc, history, seconds).

    The hosts start at once, not when the hub listens: their imports and their silos' set-up run while the hub
    loads, and each host waits for the hub's port before its silos dial it (silo_sim/worker.py)."""
    cores = os.cpu_count() or 2
    launched = launched or launch(staged, args)
    workers = len(launched.workers) or host_count(args, len(staged.silos))
    logs = staged.root / "logs"
    attacks = {s.name: args.attack for s in staged.silos[:getattr(args, "attackers", 0)]}  # simulation only
    policies = silo_policies(getattr(args, "silo_policy", []), len(staged.silos))
    started, hub, port = launched.started, launched.hub, launched.port
    procs = launched.procs
    ray_hosts = None
    try:
        if getattr(args, "engine", "workers") == "ray" and workers:
            from silo_sim.ray_engine import RaySiloHosts, actor_count

            # Ray starts while the hub trains on its labels; the cluster's size decides how many hosts.
            ray_hosts = RaySiloHosts(logs, 1.0 if args.silo_cpus is None else args.silo_cpus, args.silo_gpus or 0.0,
                                     args.ray_address)
            workers = actor_count(ray_hosts.connect(), len(staged.silos), ray_hosts.silo_cpus, ray_hosts.silo_gpus,
                                  args.workers)
        hub_address = f"{getattr(args, 'hub_host', '127.0.0.1')}:{port}"
        metrics_files, ray_specs = [], []
        for w in range(workers):
            metrics_files.append(staged.root / f"worker-{w}.metrics_port")
            metrics_files[-1].unlink(missing_ok=True)
            spec = {
                "hub": hub_address, "device": args.device, "threads": max(1, cores // workers),
                "metrics_port": 0, "metrics_port_file": str(metrics_files[-1]),
                "watched": bool(getattr(args, "prometheus_targets", None)),
                "ship_files": bool(getattr(args, "ship_silo_files", False)),
                "load_when_sampled": not getattr(args, "load_at_join", False),
                "silos": [{"name": s.name, "certs": str(s.certs), "data": str(s.data) if s.data else None,
                           "labeled": str(s.labeled) if s.labeled else None, "state_dir": str(s.state_dir),
                           "labels": str(s.labels), "attack": attacks.get(s.name), "policy": policies.get(s.name)}
                          for s in staged.silos[w::workers]],
            }
            spec_path = staged.root / f"worker-{w}.json"
            aside = spec_path.with_name(f".{spec_path.name}.tmp")  # whole or absent: its worker is waiting for it
            aside.write_text(json.dumps(spec))
            aside.replace(spec_path)
            if ray_hosts is not None:
                ray_specs.append(spec)
        if ray_hosts is not None:
            ray_hosts.start(ray_specs)
        port_file = staged.hub_state_dir / "port"  # written once the hub listens (its /metrics port before it)
        while not port_file.exists():
            if hub.poll() is not None:
                raise RuntimeError(f"the hub exited before listening; see {logs / 'hub.log'}:\n"
                                   + (logs / "hub.log").read_text()[-2000:])
            time.sleep(0.2)
        metrics_ports = _wait_for_metrics_ports(staged, metrics_files, procs, logs,
                                                check=ray_hosts.check_started if ray_hosts else None)
        if getattr(args, "prometheus_targets", None):
            write_prometheus_targets(args.prometheus_targets, metrics_ports)
        history_path = staged.hub_state_dir / "history.json"
        targets_stale = False
        with Progress(TextColumn("[bold]{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                      TimeElapsedColumn(), console=console, transient=False) as progress:
            bar = progress.add_task("initial hub training", total=rounds)
            while hub.poll() is None:
                history, _ = _read_history(history_path)
                if history:
                    last = history[-1]
                    progress.update(bar, completed=last.round, description=(
                        f"round {last.round}: test acc {nan_if_none(last.scores.test_accuracy):.3f}, "
                        f"pseudo-labels {last.pseudo_label_ratio or 0:.0%}"))
                if ray_hosts is not None:  # a dead actor is reported and, while rounds are left, replaced
                    replaced = ray_hosts.check(rounds_left=len(history) < rounds)
                    for line in replaced:
                        progress.console.print(f"[yellow]{line}")
                    if getattr(args, "prometheus_targets", None) and (replaced or targets_stale):
                        # the replacement serves /metrics on a new port: Prometheus follows once it is known
                        targets_stale = ray_hosts.metrics_pending()
                        if not targets_stale:
                            write_prometheus_targets(args.prometheus_targets, _wait_for_metrics_ports(
                                staged, metrics_files, procs, logs))
                time.sleep(0.5)
            progress.update(bar, completed=len(_read_history(history_path)[0]))
        rc = hub.wait()
        for p in procs[1:]:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pass
        if ray_hosts is not None:
            ray_hosts.wait(30)
        if rc != 0:
            tail = (logs / "hub.log").read_text()[-3000:]
            raise RuntimeError(f"the hub failed (exit {rc}); last lines of {logs / 'hub.log'}:\n{tail}")
        return rc, _read_history(history_path)[0], time.time() - started
    finally:
        _terminate(procs)
        if ray_hosts is not None:
            ray_hosts.close()


def _wait_for_metrics_ports(staged, worker_files: list[Path], procs: list[subprocess.Popen], logs: Path,
                            timeout: float = 120.0, check=None) -> dict[str, Any]:
    """The /metrics port of the hub and the HOST:PORT of every silo host's, once each has written it. `check`
    raises when a silo host that is not one of `procs` (a Ray actor) failed."""
    hub_file = staged.hub_state_dir / "metrics_port"
    end = time.time() + timeout
    while not all(f.exists() and f.read_text().strip() for f in worker_files):
        if check is not None:
            check()
        for i, p in enumerate(procs[1:]):
            if p.poll() is not None:
                raise RuntimeError(f"silo worker {i} exited before serving metrics; see {logs / f'worker-{i}.log'}")
        if time.time() > end:
            raise RuntimeError(f"silo workers did not serve metrics within {timeout:.0f}s; see {logs}")
        time.sleep(0.2)
    return {"hub": int(hub_file.read_text()) if hub_file.exists() else None,
            "workers": [metrics_address(f.read_text()) for f in worker_files]}


def metrics_address(written: str) -> str:
    """A silo host's /metrics as HOST:PORT, from what it wrote: a port (on this machine) or a Ray actor's
    HOST:PORT on its node."""
    written = written.strip()
    return written if ":" in written else f"127.0.0.1:{int(written)}"


def write_prometheus_targets(directory: Path, ports: dict[str, Any]) -> None:
    """Prometheus file_sd files for the simulation: hub.yml (the hub) and silos.yml (one target per worker).

    Written atomically (Prometheus re-reads them on change), in the layout ops/prometheus/prometheus.yml expects.
    """
    import yaml

    directory.mkdir(parents=True, exist_ok=True)
    groups = {
        "hub.yml": [{"targets": [f"127.0.0.1:{ports['hub']}"], "labels": {"federation": "silo-sim"}}]
        if ports["hub"] else [],
        "silos.yml": [{"targets": [address], "labels": {"federation": "silo-sim", "worker": str(w)}}
                      for w, address in enumerate(ports["workers"])],
    }
    for name, content in groups.items():
        tmp = directory / f".{name}.tmp"
        tmp.write_text(yaml.safe_dump(content, sort_keys=False))
        tmp.replace(directory / name)


def server_only_baseline(staged, options: dict[str, Any], rounds: int, seed: int, device: str) -> dict[str, Any]:
    """The hub alone on the same labels, same model, same hub-side schedule: what the silos must beat."""
    import torch

    from silo_core.algorithms.base import HubData
    from silo_core.algorithms.server_only import ServerOnlyHub, ServerOnlyOptions
    from silo_core.data import load_labeled_folder
    from silo_core.models import ModelSpec
    from silo_core.training import evaluate, resolve_device
    from silo_server.config import load_config

    torch.set_num_threads(os.cpu_count() or 2)
    # The staged hub.yaml's model, built as the hub builds it (the staged data's size, channels, normalisation).
    config = load_config(staged.hub_config)
    size, channels = config.model.image_size, config.model.in_channels
    labeled = load_labeled_folder(staged.root / "hub" / "labeled", size, channels)
    test = load_labeled_folder(staged.root / "hub" / "test", size, channels)
    spec = ModelSpec.from_config(config.model, len(labeled.classes))
    # The hub-side knobs the run's algorithm shares with server-only (epochs, lr, ...); the rest do not apply.
    opts = ServerOnlyOptions.model_validate({k: v for k, v in options.items() if k in ServerOnlyOptions.model_fields})
    dev = resolve_device(device)
    algo = ServerOnlyHub(opts, spec, HubData(labeled.images, labeled.labels), dev, seed, rounds)
    state = algo.init_state()
    started = time.time()
    for _ in range(rounds):
        state, _ = algo.finish_round(state, {}, {})
    result = evaluate(algo.served_model(state), test.images, test.labels, spec.mean, spec.std, dev)
    return {"algorithm": "server-only", "test_accuracy": result["accuracy"], "test_loss": result["loss"],
            "seconds": time.time() - started}


def summary_table(history: list[RoundRecord], baseline: dict[str, Any] | None, algorithm: str,
                  initial: Scores | None = None) -> Table:
    table = Table(title=f"silo-sim: {algorithm}")
    table.add_column("round", justify="right", no_wrap=True, min_width=11)
    best = BestRound.from_history(history)
    if best.round:  # the hub kept this round as best_model.safetensors
        table.caption = f"* best round on the hub's validation split: {best.round} (kept as best_model.safetensors)"
    private = any(h.dp is not None for h in history)  # the privacy spent, beside what it cost in accuracy
    # Silos left out of the sample that were handed the round's model (FedSEAL's ensemble_every_round)
    broadcast = any(h.silos_received for h in history)
    for col in ("test acc", *(("val acc",) if best.round else ()), "PL ratio", "PL acc", "silos",
                *(("received",) if broadcast else ()), "round time", "bytes up", "bytes down",
                *(("epsilon",) if private else ())):
        table.add_column(col, justify="right", no_wrap=True)
    if initial is not None and initial != Scores():  # the hub's model before any silo took part
        table.add_row("0 (initial)", f"{nan_if_none(initial.test_accuracy):.4f}",
                      *((f"{nan_if_none(initial.validation_accuracy):.4f} ",) if best.round else ()),
                      "-", "-", "-", *(("-",) if broadcast else ()), "-", "-", "-",
                      *(("-",) if private else ()), style="dim")
    for h in history:
        validation = ((f"{nan_if_none(h.scores.validation_accuracy):.4f}{'*' if h.round == best.round else ' '}",)
                      if best.round else ())
        table.add_row(
            str(h.round), f"{nan_if_none(h.scores.test_accuracy):.4f}", *validation,
            f"{h.pseudo_label_ratio:.3f}" if h.pseudo_label_ratio is not None else "-",
            f"{h.pseudo_label_accuracy:.3f}" if h.pseudo_label_accuracy is not None else "-",
            f"{h.silos_reported or 0}/{h.silos_sampled or 0}",
            *((f"{h.silos_received or 0} ({_human(h.bytes_down_received or 0)})",) if broadcast else ()),
            f"{h.round_seconds or 0:.1f}s",
            _human(h.bytes_up or 0), _human(h.bytes_down or 0), *((_epsilon(h),) if private else ()),
        )
    if baseline:
        table.add_row("server-only", f"{baseline['test_accuracy']:.4f}", *(("-",) if best.round else ()), "-", "-",
                      "-", *(("-",) if broadcast else ()), f"{baseline['seconds']:.1f}s", "-", "-",
                      *(("-",) if private else ()), style="dim")
    return table


def _epsilon(record: RoundRecord) -> str:
    """Epsilon spent after the round, and the budget when there is one."""
    dp = record.dp
    if dp is None:
        return "-"
    return f"{dp.epsilon:.2f}" + (f" / {dp.epsilon_budget:g}" if dp.epsilon_budget is not None else "")


def _human(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000:
            return f"{n:.0f}{unit}" if unit == "B" else f"{n:.1f}{unit}"
        n /= 1000
    return f"{n:.1f}TB"


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.WARNING)
    # SIGTERM unwinds like Ctrl-C would, so the hub and the workers this process started are stopped too.
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    workdir = None
    launched: list[Launched] = []
    try:
        from silo_core.algorithms import get_algorithm
        from silo_sim.attacks import check_attack
        from silo_sim.stage import stage_federation

        entry = get_algorithm(args.algorithm)
        args.needs_silos = entry.hub.needs_silos
        if args.silos < 1:
            raise ValueError("--silos must be at least 1")
        if args.attackers < 0 or args.attackers > args.silos:
            raise ValueError(f"--attackers must be between 0 and --silos ({args.silos}), got {args.attackers}")
        if args.attackers and not entry.hub.needs_silos:
            raise ValueError(f"--attackers needs silos, and {args.algorithm} runs at the hub alone")
        check_attack(args.attack, "--attack")
        silo_policies(args.silo_policy, args.silos)  # a bad policy file fails here, before anything starts
        if args.labeled_silos < 0 or args.labeled_silos > args.silos:
            raise ValueError("--labeled-silos must be between 0 and --silos")
        from silo_sim.ray_engine import check_engine_args  # imports Ray only for --engine ray

        check_engine_args(args)
        given = parse_options(args.option)
        options = {**DEMO_OPTIONS.get(args.algorithm, {}), **given}
        for line in option_overrides(args.algorithm, given):
            console.print(line, highlight=False)
        entry.options.model_validate(options)  # a bad --option fails here, with its name
        cores = os.cpu_count() or 2
        source = load_source(args.data, args.image_size)
        hub_config = {
            "run": {"seed": args.seed, "device": args.device, "threads": cores},
            "algorithm": {"name": args.algorithm, "options": options},
            "model": {"name": args.model, "image_size": source.image_size, "in_channels": source.channels},
            "wire": {"half_precision": args.half_precision},
            # With a Prometheus watching, stay up long enough for it to discover and scrape a short run.
            **({"server": {"linger_s": 30.0, "min_linger_s": 30.0}} if getattr(args, "prometheus_targets", None)
               else {}),
            "rounds": {"total": args.rounds, "min_silos": args.silos, "deadline_s": 900, **rounds_sampling(args)},
        }
        apply_hub_settings(hub_config, args.hub_set)
        check_secure_aggregation_fits(hub_config, args.silos)
        extra = {"test_per_class": args.test_per_class, "validation_per_class": validation_per_class(args, entry.hub.needs_validation),
                 "labeled_silos": args.labeled_silos, "silo_labels_per_class": args.silo_labels_per_class,
                 "source": source, "hub_host": args.hub_host}
        if args.export_demo:
            staged = stage_federation(args.export_demo, num_silos=args.silos, labels_per_class=args.labels_per_class,
                                      partition=args.partition, alpha=args.alpha,
                                      classes_per_silo=args.classes_per_silo, unlabeled_limit=args.unlabeled,
                                      seed=args.seed, hub_config=hub_config, **extra)
            print(f"staged a demo federation in {staged.root}:")
            print(f"  hub:   silo-server --config {staged.hub_config}   (port 0 = a free port, written to "
                  f"{staged.hub_state_dir}/port and bound again on a restart; set server.port to fix it)")
            for s in staged.silos[:3]:
                data = (f"--data {s.data} " if s.data else "") + (f"--labeled {s.labeled} " if s.labeled else "")
                print(f"  silo:  silo-client {data}--certs {s.certs} --hub {args.hub_host}:PORT")
            if len(staged.silos) > 3:
                print(f"  ... and {len(staged.silos) - 3} more silos under {staged.root / 'silos'}")
            return 0
        workdir = args.workdir or Path(tempfile.mkdtemp(prefix="silo-sim-"))
        console.print(f"staging {args.silos} silos, {args.labels_per_class} hub labels per class and certificates "
                      f"in {workdir} from {source.description} ...")
        t0 = time.time()
        # The hub (and the worker processes) start once the hub's part is staged, while the silos' files are linked.
        staged = stage_federation(workdir, num_silos=args.silos, labels_per_class=args.labels_per_class,
                                  partition=args.partition, alpha=args.alpha, classes_per_silo=args.classes_per_silo,
                                  unlabeled_limit=args.unlabeled, seed=args.seed, hub_config=hub_config,
                                  hub_staged=lambda hub_part: launched.append(launch(hub_part, args)), **extra)
        console.print(f"staged in {time.time() - t0:.1f}s; the hub started meanwhile; {args.silos} silos join over "
                      f"mutual TLS")
        _, history, seconds = run_federation(staged, args, args.rounds, launched[0])
        baseline = None
        if not args.no_baseline and args.algorithm != "server-only":  # server-only IS the baseline
            console.print("training the server-only baseline on the same labels ...")
            baseline = server_only_baseline(staged, options, args.rounds, args.seed, args.device)
        _, initial = _read_history(staged.hub_state_dir / "history.json")
        console.print(summary_table(history, baseline, args.algorithm, initial))
        final = history[-1] if history else None
        if baseline and final:
            accuracy = final.scores.test_accuracy or 0.0
            gain = 100 * (accuracy - baseline["test_accuracy"])
            verdict = "above" if gain > 0 else "NOT above"
            console.print(f"{args.algorithm} final test accuracy {accuracy:.4f} is "
                          f"{verdict} server-only {baseline['test_accuracy']:.4f} ({gain:+.1f} points); "
                          f"federated run took {seconds:.0f}s")
        if args.out:
            args.out.mkdir(parents=True, exist_ok=True)
            summary = {
                "settings": {**{k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
                             "algorithm_options": options, "cores": cores},
                "initial": initial.to_json(),
                "rounds": [r.to_json() for r in history],
                "baseline": baseline,
                "final": final.to_json() if final else {},
                "federated_seconds": seconds,
            }
            (args.out / "summary.json").write_text(json.dumps(summary, indent=2))
            console.print(f"summary written to {args.out / 'summary.json'}")
        return 0
    except KeyboardInterrupt:
        return 130
    except Exception as err:
        if args.verbose:
            raise
        print(f"error: {err}", file=sys.stderr)
        return 2
    finally:
        for early in launched:  # stopped already unless staging failed after they started
            _terminate(early.procs)
        if workdir is not None and args.workdir is None:
            shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
