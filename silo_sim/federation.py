"""A staged federation run as real processes: the hub (silo-server) and the silo hosts (worker processes, or Ray
actors with --engine ray), started as soon as their part of the staging is written, followed round by round, and
stopped whatever happens; their /metrics addresses handed to Prometheus as file_sd targets."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from security.secagg.params import SecAggParams
from silo_core.rounds import RoundRecord, Scores, nan_if_none, records_from_json
from silo_server.rounds.breaker import QUARANTINE_FILE, read_quarantine
from silo_sim.launcher import Forked, Launcher
from silo_sim.report import console

if TYPE_CHECKING:
    from silo_sim.ray_engine import HostedShare


def terminate(procs: list[subprocess.Popen | Forked], grace: float = 10.0) -> None:
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


def read_history(path: Path) -> tuple[list[RoundRecord], Scores]:
    """The hub's history.json: its rounds and the initial model's scores (none while the hub has not written it)."""
    try:
        saved = json.loads(path.read_text())
    except (OSError, ValueError):
        return [], Scores()
    return records_from_json(saved.get("rounds", [])), Scores.from_json(saved.get("initial", {}))


def host_threads(cores: int, hosts: int, silo_cpus: float | None = None) -> int:
    """Torch threads for one silo host: on Ray, the CPUs its actor reserved (--silo-cpus: one silo at work, on
    whichever node Ray placed it); as local worker processes, this machine's cores shared out among them."""
    if silo_cpus is not None:
        return max(1, int(silo_cpus))
    return max(1, cores // max(1, hosts))


def hub_section(staged, name: str) -> dict[str, Any]:
    """One section of the staged hub.yaml as written (empty when absent: the hub's defaults apply)."""
    return yaml.safe_load(staged.hub_config.read_text()).get(name) or {}


def hub_final_scrape_s(staged) -> float:
    """How long the hub waits for a last scrape (its metrics.final_scrape_s): every silo host waits as long, so
    that one --hub-set moves both ends of the run's final metrics."""
    from silo_server.config import MetricsSection

    metrics = hub_section(staged, "metrics")
    return float(metrics.get("final_scrape_s", MetricsSection.model_fields["final_scrape_s"].default))


def hub_port(staged) -> int:
    """The port the hub will listen on, known before it starts so that the silo hosts start beside it: the staged
    hub.yaml's server.port, or (0, the sim's default) a free one picked here, below the ephemeral range, and handed
    to silo-server --port."""
    server = hub_section(staged, "server")
    if int(server.get("port", 0)):
        return int(server["port"])
    return free_port_outside_ephemeral_range(server.get("host", "127.0.0.1"))


EPHEMERAL_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
FIRST_PICKED_PORT = 10_000  # above the well-known and most registered service ports


def free_port_outside_ephemeral_range(host: str, attempts: int = 64) -> int:
    """A port free now and below the system's ephemeral range. The hub binds it seconds later, after its imports;
    a port the system handed out for port 0 could meanwhile go to any other process binding port 0 or dialling
    out, while one below the range is only taken by a process that names it. Falls back to the system's pick
    where the range is unknown or leaves no room below it."""
    import random
    import socket

    try:
        first_ephemeral = int(EPHEMERAL_RANGE_FILE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        first_ephemeral = FIRST_PICKED_PORT
    for port in random.sample(range(FIRST_PICKED_PORT, first_ephemeral),
                              min(attempts, max(0, first_ephemeral - FIRST_PICKED_PORT))):
        try:
            with socket.create_server((host, port)):
                return port
        except OSError:
            continue
    with socket.create_server((host, 0)) as probe:
        return probe.getsockname()[1]


@dataclass
class Launched:
    """The hub and the worker processes, started as soon as the hub's part of the staging is written (launch):
    their imports and the hub's loading run while the silos' files are still being linked, and each worker waits
    for its spec file before it sets its silos up."""

    hub: subprocess.Popen | Forked
    port: int
    workers: list[subprocess.Popen | Forked]
    started: float

    @property
    def procs(self) -> list[subprocess.Popen | Forked]:
        return [self.hub, *self.workers]


def host_count(args: argparse.Namespace, silos: int) -> int:
    """Silo hosts: --workers, else one per core; never more than silos; none for a hub-only algorithm."""
    if not getattr(args, "needs_silos", True):
        return 0
    return max(1, min(args.workers or os.cpu_count() or 2, silos))


def launch(staged, args, launcher: Launcher | None = None) -> Launched:
    """Start the hub, and with the default engine the worker processes (each waits for its worker-N.json): forked
    from `launcher` (imports done once), or without one as fresh interpreters (`python -m ...`)."""
    logs = staged.root / "logs"
    logs.mkdir(exist_ok=True)
    started = time.time()
    port = hub_port(staged)

    def start(module: str, argv: list[str], name: str, log: Path):
        if launcher is not None:
            return launcher.start(module, argv, name, log)
        return subprocess.Popen([sys.executable, "-m", module, *argv], stdout=open(log, "w"),
                                stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})

    hub = start("silo_server.cli", ["--config", str(staged.hub_config), "--port", str(port)], "silokit-hub",
                logs / "hub.log")
    workers = []
    if getattr(args, "engine", "workers") != "ray":
        for w in range(host_count(args, args.silos)):
            spec_path = staged.root / f"worker-{w}.json"
            spec_path.unlink(missing_ok=True)
            workers.append(start("silo_sim.worker", ["--spec", str(spec_path), "--wait-for-spec"],
                                 f"silokit-host{w}", logs / f"worker-{w}.log"))
    return Launched(hub, port, workers, started)


def run_federation(staged, args, rounds: int, launched: Launched | None = None,
                   policies: dict[str, str] | None = None) -> tuple[int, list[RoundRecord], float]:
    """Start the hub and the silo hosts (worker processes, or Ray actors with --engine ray) as real processes, or
    adopt those `launch` started while staging; follow progress; return (rc, history, seconds). `policies`: silo
    name -> its branch policy file (silo-sim --silo-policy).

    The hosts start at once, not when the hub listens: their imports and their silos' set-up run while the hub
    loads, and each host waits for the hub's port before its silos dial it (silo_sim/worker.py)."""
    cores = os.cpu_count() or 2
    launched = launched or launch(staged, args)
    workers = len(launched.workers) or host_count(args, len(staged.silos))
    logs = staged.root / "logs"
    attacks = {s.name: args.attack for s in staged.silos[:getattr(args, "attackers", 0)]}  # simulation only
    policies = policies or {}
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
        final_scrape_s = hub_final_scrape_s(staged)
        for w in range(workers):
            metrics_files.append(staged.root / f"worker-{w}.metrics_port")
            metrics_files[-1].unlink(missing_ok=True)
            (staged.root / f"worker-{w}.ended.json").unlink(missing_ok=True)
            spec = {
                "hub": hub_address, "device": args.device,
                "threads": host_threads(cores, workers, ray_hosts.silo_cpus if ray_hosts is not None else None),
                "metrics_port": 0, "metrics_port_file": str(metrics_files[-1]), "metrics_final_scrape_s": final_scrape_s,
                "ended_file": str(staged.root / f"worker-{w}.ended.json"),
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
                                                check=ray_hosts.check_started if ray_hosts else None,
                                                pending=ray_hosts.metrics_pending if ray_hosts else None)
        if getattr(args, "prometheus_targets", None):
            write_prometheus_targets(args.prometheus_targets, metrics_ports)
        history_path = staged.hub_state_dir / "history.json"
        targets_stale = False
        with Progress(TextColumn("[bold]{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                      TimeElapsedColumn(), console=console, transient=False) as progress:
            bar = progress.add_task("initial hub training", total=rounds)
            while hub.poll() is None:
                history, _ = read_history(history_path)
                if history:
                    last = history[-1]
                    progress.update(bar, completed=last.round, description=(
                        f"round {last.round}: test acc {nan_if_none(last.scores.test_accuracy):.3f}, "
                        f"pseudo-labels {last.pseudo_label_ratio or 0:.0%}"))
                hosts = ray_hosts.shares if ray_hosts is not None else launched.workers
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
                if hosts:
                    stalled = silos_stopped(staged, hosts, logs, lambda: hub_phase(metrics_ports["hub"]))
                    if stalled:
                        raise RuntimeError(stalled)
                time.sleep(0.5)
            progress.update(bar, completed=len(read_history(history_path)[0]))
        rc = hub.wait()
        if rc != 0:  # at once: the silos would redial the dead hub for minutes before their hosts exit
            tail = (logs / "hub.log").read_text()[-3000:]
            raise RuntimeError(f"the hub failed (exit {rc}); last lines of {logs / 'hub.log'}:\n{tail}")
        history = read_history(history_path)[0]
        if len(history) < rounds and not stopped_early(staged):
            raise RuntimeError(f"the hub stopped after {len(history)} of {rounds} rounds without finishing the run "
                               f"(it was stopped, e.g. SIGTERM); its checkpoint and logs are in {staged.root}")
        for p in procs[1:]:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pass
        if ray_hosts is not None:
            ray_hosts.wait(30)
        return rc, history, time.time() - started
    finally:
        terminate(procs)
        if ray_hosts is not None:
            ray_hosts.close()


def stopped_early(staged) -> str | None:
    """Why the hub ended its run before its last round (its model card's stopped_early: the privacy budget, say),
    or None: it finished, or was stopped and can resume."""
    card = staged.hub_state_dir / "model_card.json"
    try:
        return json.loads(card.read_text()).get("stopped_early") or None
    except (OSError, ValueError):
        return None


def hub_waits_for(staged) -> int:
    """The fewest ready silos the hub waits for before a round: rounds.min_silos, and under secure aggregation the
    fewest a round may sample (SecAggParams.fewest_sampled, as the hub's round loop asks)."""
    need = int(hub_section(staged, "rounds").get("min_silos", 1))
    section = hub_section(staged, "privacy").get("secure_aggregation") or {}
    if section.get("enabled"):
        need = max(need, SecAggParams.model_validate(section).fewest_sampled())
    return need


def silos_stopped(staged, workers: list[subprocess.Popen | Forked | HostedShare], logs: Path,
                  phase: Callable[[], str | None]) -> str | None:
    """Why the run cannot go on, or None: the silos that stopped before its end (a policy that refused the run, a
    crash, a worker process or Ray actor gone) leave fewer than the hub's rounds.min_silos, and the hub (`phase`:
    its current phase) waits for silos before its next round, which it would do forever. A round already under way
    goes on: it closes at its quorum."""
    hosts = len(workers)
    gone: dict[str, str] = {}
    for w, proc in enumerate(workers):
        path = staged.root / f"worker-{w}.ended.json"
        ends = json.loads(path.read_text()) if path.is_file() else {}
        for name, code in (getattr(proc, "results", None) or {}).items():  # a Ray actor's run returned
            ends.setdefault(name, {"code": code, "why": f"exited with code {code}"})
        gone.update({name: end["why"] for name, end in ends.items() if end["code"] != 0})
        if proc.poll() not in (None, 0):  # the whole host: each silo it hosted whose end it had not written
            for s in staged.silos[w::hosts]:
                if s.name not in ends:
                    gone[s.name] = f"its host worker-{w} exited with code {proc.poll()}"
    # A silo the hub quarantined (a secure-sum breaker) still polls, but the hub no longer counts it as ready.
    quarantine = staged.hub_state_dir / QUARANTINE_FILE
    try:
        quarantined = read_quarantine(quarantine) if quarantine.is_file() else {}
    except ValueError:
        quarantined = {}
    for name, q in quarantined.items():
        gone.setdefault(name, f"quarantined by the hub in round {q.round}")
    if not gone:
        return None
    need = hub_waits_for(staged)
    if len(staged.silos) - len(gone) >= need or phase() != "waiting_for_silos":
        return None
    shown = "; ".join(f"{name} {why}" for name, why in sorted(gone.items())[:5])
    left = len(staged.silos) - len(gone)
    if need > int(hub_section(staged, "rounds").get("min_silos", 1)):
        how = (f"the fewest a securely aggregated round samples: it cannot go on with {left} (lower "
               f"privacy.secure_aggregation.dropouts or min_cohort, or stage more silos)")
    else:
        how = f"rounds.min_silos: let the others go on with --hub-set rounds.min_silos={left}"
    return (f"{len(gone)} of {len(staged.silos)} silos stopped before the run's end ({shown}), leaving fewer than "
            f"the {need} the hub waits for ({how}); see {logs}/worker-*.log")


def hub_phase(port: int | None) -> str | None:
    """The hub's current phase, from its /metrics (silokit_hub_phase), or None when it cannot be read."""
    if port is None:
        return None
    from prometheus_client.parser import text_string_to_metric_families

    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as response:
            text = response.read().decode()
    except OSError:
        return None
    for family in text_string_to_metric_families(text):
        if family.name == "silokit_hub_phase":
            return next((s.labels["phase"] for s in family.samples if s.value == 1), None)
    return None


def _wait_for_metrics_ports(staged, worker_files: list[Path], procs: list[subprocess.Popen | Forked], logs: Path,
                            timeout: float = 120.0, check=None, pending=None) -> dict[str, Any]:
    """The /metrics port of the hub and the HOST:PORT of every silo host's, once each has written it. `check`
    raises when a silo host that is not one of `procs` (a Ray actor) failed; `pending` says whether an actor has
    yet to tell its node's address (its bare port, written first, would read as this machine's)."""
    hub_file = staged.hub_state_dir / "metrics_port"
    end = time.time() + timeout
    while not all(f.exists() and f.read_text().strip() for f in worker_files) or (pending is not None and pending()):
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
