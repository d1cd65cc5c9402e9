"""`silo-sim --engine ray`: the silo hosts as Ray actors instead of worker processes.

Each actor runs silo_sim.worker.host_silos on a share of the silos, exactly as a worker process does: every silo
keeps its own identity, certificate, data shard, state folder and mutual-TLS connection to the hub, so the wire is
exercised as with the worker pool. What Ray adds is placement and supervision:

- an actor requests the resources of ONE silo at work (--silo-cpus, --silo-gpus; fractions allowed), because its
  silos take turns on one work thread; the number of actors is what the cluster's CPUs (and GPUs, when asked for)
  allow at that request, capped at --silos, unless --workers says how many;
- an actor that dies (its process killed, its node lost) is reported with the silos it hosted, and while the hub
  has rounds left a new actor takes over those silos: they join again with their certificates and state folders,
  like a branch that restarted;
- with --ship-silo-files the actors need no shared file system: each gets its silos' certificates, images,
  labels and branch policies as one tar archive (Ray's object store carries it to the actor's node), unpacks it
  into a temporary folder there and removes it at the end; its silos start with empty state folders, and a
  replacement gets the archive again. Each actor reports the address of its /metrics endpoint, for --prometheus-targets.

Ray is imported here only, and only when this engine is chosen, so silo-sim without the `ray` extra never loads it.
Only plain JSON-like specs and exit codes pass between the driver and the actors (Ray pickles them between our own
processes; nothing from the hub or a silo's data travels that way).
"""

from __future__ import annotations

import io
import json
import logging
import os
import shutil
import tarfile
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

log = logging.getLogger("silo_sim.ray")

INSTALL_HINT = 'the Ray engine needs Ray: pip install -e ".[ray]"'
ACTOR_EXIT_WAIT_S = 10.0  # how long closing waits for the local Ray's actor processes to exit
ACTORS_FILE = "ray-actors.json"  # under the sim's logs/: each actor's pid and silos, for operators (and tests)
# A silo's paths in a host spec that --ship-silo-files carries: its branch policy too, or a silo given one with
# --silo-policy would fail on a node without the sim's folder (or, worse, find another file at that path).
SILO_FILES = ("certs", "data", "labeled", "labels", "policy")


def pack_share(spec: dict[str, Any]) -> bytes:
    """The certificates, images and labels of a host spec's silos as one uncompressed tar archive (PNGs and JPEGs
    are compressed already), each silo's files under its name."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as archive:
        for silo in spec["silos"]:
            for key in SILO_FILES:
                if silo.get(key):
                    archive.add(silo[key], arcname=f"{silo['name']}/{key}")
    return buffer.getvalue()


def unpack_share(spec: dict[str, Any], archive: bytes, into: Path) -> dict[str, Any]:
    """`archive` (pack_share) unpacked under `into`; returns the spec with its silos' paths pointing there, each
    with a new state folder, and the /metrics port file there too."""
    with tarfile.open(fileobj=io.BytesIO(archive)) as files:
        files.extractall(into, filter="data")  # nothing outside `into`, no device files, no absolute links
    silos = []
    for silo in spec["silos"]:
        base = into / silo["name"]
        silos.append({**silo, **{key: str(base / key) for key in SILO_FILES if silo.get(key)},
                      "state_dir": str(base / "state")})
    # The silos' ends go beside them: the sim machine's folder may not exist on this node (silo-sim learns of
    # them from the actor's results instead).
    return {**spec, "silos": silos, "metrics_port_file": str(into / "metrics_port"),
            "ended_file": str(into / "ended.json")}


SHARE_PREFIX = "silo-sim-share-"  # + <run token>-<actor pid>-<random>: an actor's unpacked silo files


def share_folder(run_token: str) -> Path:
    """A new folder in this node's temp folder for this actor's unpacked silo files, named by the run and the pid
    of the actor that owns it (sweep_dead_shares reads both)."""
    return Path(tempfile.mkdtemp(prefix=f"{SHARE_PREFIX}{run_token}-{os.getpid()}-"))


def sweep_dead_shares(run_token: str, temp_dir: Path | None = None) -> list[Path]:
    """Remove the unpacked copies that actors of this run left on this node when they were killed (the owner's
    process is gone): they hold their silos' private keys, which must not outlive the run. A replacement actor
    sweeps when it starts and every actor when it ends; a node where no actor of the run is left keeps them.
    Returns the folders removed."""
    removed = []
    for folder in sorted(Path(temp_dir or tempfile.gettempdir()).glob(f"{SHARE_PREFIX}{run_token}-*")):
        owner = folder.name[len(SHARE_PREFIX) + len(run_token) + 1:].split("-", 1)[0]
        if owner.isdigit() and not _process_alive(int(owner)):
            shutil.rmtree(folder, ignore_errors=True)
            removed.append(folder)
    return removed


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: alive
        return True
    return True


class RayMissing(RuntimeError):
    """--engine ray where Ray is not installed."""


def import_ray():
    """Ray, or RayMissing saying how to install it."""
    try:
        import ray
    except ImportError:
        raise RayMissing(INSTALL_HINT) from None
    return ray


def node_address() -> str:
    """The address this actor's node has in its Ray cluster (the one its `ray start` registered), so that a
    Prometheus on the sim's machine can reach the actor's /metrics on a node elsewhere."""
    import ray

    node_id = ray.get_runtime_context().get_node_id()
    for node in ray.nodes():
        if node.get("NodeID") == node_id and node.get("NodeManagerAddress"):
            return node["NodeManagerAddress"]
    return ray.util.get_node_ip_address()


class SiloHost:
    """The body of a silo host actor: host_silos on a spec, stoppable from another call, and asked for its /metrics
    address by a third (hence three concurrent calls per actor: run, stop, metrics_address)."""

    def __init__(self, log_path: str):
        self.stop_event = threading.Event()
        self.metrics_port_file: Path | None = None
        self.metrics_host = "127.0.0.1"
        # The actor's log goes to the sim's logs/ folder, beside the hub's, not into Ray's session folder; on a
        # node without that folder (no shared file system), to the folder its silos' files are unpacked in.
        self.log_path = Path(log_path)
        if not self.log_path.parent.is_dir():
            self.log_path = Path(tempfile.mkdtemp(prefix="silo-sim-actor-log-")) / self.log_path.name
        handler = logging.FileHandler(self.log_path)
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        root = logging.getLogger()
        root.addHandler(handler)
        root.setLevel(logging.INFO)

    def pid(self) -> int:
        return os.getpid()

    def run(self, spec: dict[str, Any], archive: bytes | None = None) -> dict[str, int]:
        from silo_sim.worker import host_silos

        # /metrics where the sim's Prometheus reaches it: loopback on the sim's own local Ray, else this node's
        # address in the cluster.
        self.metrics_host = spec["metrics_host"] = spec.get("metrics_host") or node_address()
        if archive is None:
            self.metrics_port_file = Path(spec["metrics_port_file"])
            return host_silos(spec, self.stop_event)
        token = spec["share_token"]
        self._sweep(token)  # a replacement may land where the actor it replaces was killed
        share = share_folder(token)
        try:
            spec = unpack_share(spec, archive, share)
            self.metrics_port_file = Path(spec["metrics_port_file"])
            logging.getLogger("silo_sim.ray").info("silo files unpacked in %s", share)
            return host_silos(spec, self.stop_event)
        finally:
            shutil.rmtree(share, ignore_errors=True)
            self._sweep(token)

    @staticmethod
    def _sweep(token: str) -> None:
        for folder in sweep_dead_shares(token):
            logging.getLogger("silo_sim.ray").info("removed %s, the silo files of a killed actor of this run", folder)

    def metrics_address(self, timeout_s: float = 120.0) -> str | None:
        """HOST:PORT of this actor's /metrics endpoint once host_silos serves it (None if it never does)."""
        end = time.monotonic() + timeout_s
        while time.monotonic() < end and not self.stop_event.is_set():
            if self.metrics_port_file is not None and self.metrics_port_file.is_file():
                port = self.metrics_port_file.read_text().strip()
                if port:
                    return f"{self.metrics_host}:{port}"
            time.sleep(0.1)
        return None

    def stop(self) -> None:
        self.stop_event.set()


def actor_count(resources: dict[str, float], silos: int, silo_cpus: float, silo_gpus: float,
                workers: int | None) -> int:
    """How many silo host actors: --workers when given, else as many as the cluster's CPUs (and GPUs, when each
    silo asks for some) hold at one silo's request each; never more than the silos, never fewer than one."""
    if workers:
        return max(1, min(workers, silos))
    fits = [resources.get("CPU", 0.0) / silo_cpus] if silo_cpus > 0 else []
    if silo_gpus > 0:
        fits.append(resources.get("GPU", 0.0) / silo_gpus)
    count = int(min(fits) + 1e-9) if fits else silos
    return max(1, min(count, silos))


def check_engine_args(args) -> None:
    """The Ray engine's flags, checked before anything is staged: each bad one named with what to do."""
    if args.engine != "ray":
        given = [flag for flag, value in (("--ray-address", args.ray_address), ("--silo-cpus", args.silo_cpus),
                                          ("--silo-gpus", args.silo_gpus),
                                          ("--ship-silo-files", getattr(args, "ship_silo_files", None) or None))
                 if value is not None]
        if given:
            raise ValueError(f"{', '.join(given)} only apply to Ray actors: add --engine ray")
        return
    import_ray()
    cpus, gpus = args.silo_cpus, args.silo_gpus
    if args.device.startswith("cuda") and not gpus:
        raise ValueError(f"--device {args.device} with --engine ray: give each silo host a GPU share, e.g. "
                         "--silo-gpus 0.25 (Ray places actors by what they request)")
    if (cpus is not None and cpus < 0) or (gpus is not None and gpus < 0):
        raise ValueError("--silo-cpus and --silo-gpus must be 0 or more")
    if cpus == 0 and not gpus:
        raise ValueError("--silo-cpus 0 with no --silo-gpus would request nothing: give each silo host a CPU or "
                         "GPU share")


@dataclass
class HostedShare:
    """One actor's share of the silos and what became of it."""
    index: int
    spec: dict[str, Any]
    actor: Any = None
    run_ref: Any = None
    metrics_ref: Any = None  # the actor's metrics_address() call, until it answered
    metrics_address: str | None = None  # HOST:PORT of its /metrics, once it answered
    pid: int | None = None
    restarts: int = 0
    results: dict[str, int] | None = None  # once its run() returned
    dead: bool = False  # died with no replacement

    @property
    def silo_names(self) -> list[str]:
        return [s["name"] for s in self.spec["silos"]]

    def poll(self) -> int | None:
        """As a worker process's poll() (silo_sim/federation.py silos_stopped): None while it hosts its silos,
        0 once its run returned (`results` then holds each silo's code), 1 once it died with no replacement."""
        if self.dead:
            return 1
        return None if self.results is None else 0


@dataclass
class RaySiloHosts:
    """The silo host actors of one simulation run: start them, watch them, replace the dead, stop them."""
    logs: Path
    silo_cpus: float = 1.0
    silo_gpus: float = 0.0
    address: str | None = None  # None: start a local Ray and stop it at the end
    max_restarts: int = 3  # per share: an actor that keeps dying is a bug to read in its log, not to retry forever
    shares: list[HostedShare] = field(default_factory=list)
    events: list[str] = field(default_factory=list)  # deaths and replacements, as reported
    _ray: Any = None
    _temp_dir: str | None = None
    _archives: dict[int, Any] = field(default_factory=dict)  # object refs of the shipped silo files, by share

    def connect(self) -> dict[str, float]:
        """Join the cluster at `address`, or start a local one sized to this machine; returns its resources."""
        os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")  # no usage report: the sim makes no outside call
        ray = self._ray = import_ray()
        # A local Ray turns its token authentication on by default and says so at every start: keep it on, quietly.
        logging.getLogger("ray._private.authentication.authentication_token_setup").setLevel(logging.ERROR)
        quiet = {"log_to_driver": False, "logging_level": logging.WARNING}  # the actors log to logs/actor-N.log
        if self.address:
            ray.init(address=self.address, **quiet)
        else:
            # A short temp dir of our own (Ray's sockets live there and their paths have a length limit), removed
            # at the end. Ray cannot be held to loopback: it registers the node under this machine's network
            # address even when told 127.0.0.1, and its servers listen on every interface, guarded by the token
            # authentication a local Ray turns on (README, "Silos on Ray actors").
            self._temp_dir = tempfile.mkdtemp(prefix="silo-ray-")
            ray.init(num_cpus=os.cpu_count() or 1, include_dashboard=False, _temp_dir=self._temp_dir,
                     **quiet)  # GPUs: Ray counts this machine's own
        return dict(ray.cluster_resources())

    def start(self, specs: list[dict[str, Any]]) -> None:
        if not self.silo_gpus:
            # Ray leaves the GPUs visible to an actor that asked for none: keep its silos off them (the cluster's
            # GPU accounting would not see them).
            specs = [{**spec, "device": "cpu"} if spec.get("device", "auto") == "auto" else spec for spec in specs]
        # The actors of the local Ray this sim started run on this machine: their /metrics stay on loopback.
        specs = [{**spec, "metrics_host": None if self.address else "127.0.0.1"} for spec in specs]
        token = uuid.uuid4().hex[:12]  # names this run's unpacked copies on every node (sweep_dead_shares)
        specs = [{**spec, "share_token": token} for spec in specs]
        self.shares = [HostedShare(i, spec) for i, spec in enumerate(specs)]
        self._archives = {}
        for share in self.shares:
            if share.spec.get("ship_files"):  # put in the object store once, shipped again to a replacement
                self._archives[share.index] = self._ray.put(pack_share(share.spec))
            self._launch(share)
        pids = self._ray.get([s.actor.pid.remote() for s in self.shares])
        for share, pid in zip(self.shares, pids, strict=True):
            share.pid = pid
        self._write_actors_file()

    def _launch(self, share: HostedShare) -> None:
        ray = self._ray
        actor_class = ray.remote(SiloHost)
        share.actor = actor_class.options(num_cpus=self.silo_cpus, num_gpus=self.silo_gpus, max_concurrency=3
                                          ).remote(str(self.logs / f"actor-{share.index}.log"))
        share.run_ref = share.actor.run.remote(share.spec, self._archives.get(share.index))
        share.metrics_ref = share.actor.metrics_address.remote()

    def _write_actors_file(self) -> None:
        actors = [{"actor": s.index, "pid": s.pid, "restarts": s.restarts, "silos": s.silo_names,
                   "metrics_port_file": s.spec.get("metrics_port_file"), "metrics_address": s.metrics_address}
                  for s in self.shares]
        tmp = self.logs / f".{ACTORS_FILE}.tmp"
        tmp.write_text(json.dumps({"ray_temp_dir": self._temp_dir, "actors": actors, "events": self.events},
                                  indent=1))
        tmp.replace(self.logs / ACTORS_FILE)

    def check(self, rounds_left: bool) -> list[str]:
        """Collect finished actors; report a dead one and, while the run has rounds left, replace it. Returns the
        lines reported this time (also kept in `events` and logged)."""
        ray = self._ray
        reported = []
        running = [s for s in self.shares if s.results is None and not s.dead]
        if not running:
            return reported
        self._collect_metrics_addresses(running)
        ready, _ = ray.wait([s.run_ref for s in running], num_returns=len(running), timeout=0)
        for share in running:
            if share.run_ref not in ready:
                continue
            try:
                share.results = ray.get(share.run_ref)
            except ray.exceptions.RayActorError as err:  # the process is gone: a host to replace
                reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
                line = (f"silo host actor {share.index} (pid {share.pid}) died, hosting "
                        f"{', '.join(share.silo_names)}: {reason}")
                if rounds_left and share.restarts < self.max_restarts:
                    share.restarts += 1
                    share.metrics_address = None
                    if share.spec.get("metrics_port_file"):
                        Path(share.spec["metrics_port_file"]).unlink(missing_ok=True)
                    self._launch(share)
                    share.pid = ray.get(share.actor.pid.remote())
                    line += f"; started a new actor (pid {share.pid}) for them, restart {share.restarts}"
                else:
                    share.dead = True
                    line += ("; not replaced: " + ("the run has no rounds left" if not rounds_left
                                                   else f"it died {share.restarts + 1} times"))
                log.warning("%s", line)
                self.events.append(line)
                self._write_actors_file()
                reported.append(line)
            except ray.exceptions.RayError as err:  # host_silos itself raised: a bug, not a lost host
                share.dead = True
                line = (f"silo host actor {share.index} failed, hosting {', '.join(share.silo_names)}: "
                        f"{str(err).strip().splitlines()[-1]}; see {self.logs / f'actor-{share.index}.log'}")
                log.error("%s", line)
                self.events.append(line)
                self._write_actors_file()
                reported.append(line)
        return reported

    def _collect_metrics_addresses(self, running: list[HostedShare]) -> None:
        """Each actor's /metrics address, once it answered, written where the sim reads the worker pool's ports
        (its spec's metrics_port_file on this machine), as HOST:PORT."""
        asked = [s for s in running if s.metrics_ref is not None]
        if not asked:
            return
        ready, _ = self._ray.wait([s.metrics_ref for s in asked], num_returns=len(asked), timeout=0)
        for share in asked:
            if share.metrics_ref in ready:
                try:
                    address = self._ray.get(share.metrics_ref)
                except self._ray.exceptions.RayError:  # the actor died: check() reports it
                    address = None
                share.metrics_ref, share.metrics_address = None, address
                self._write_actors_file()
                if address and share.spec.get("metrics_port_file"):
                    tmp = Path(share.spec["metrics_port_file"] + ".tmp")
                    tmp.write_text(address)
                    tmp.replace(share.spec["metrics_port_file"])

    def metrics_pending(self) -> bool:
        """Whether an actor (a replacement, say) has not told its /metrics address yet."""
        return any(s.metrics_ref is not None for s in self.shares if s.results is None and not s.dead)

    def check_started(self) -> None:
        """While waiting for the hosts to come up: raise if one failed (a dead one is replaced as in a run)."""
        self.check(rounds_left=True)
        failed = [s for s in self.shares if s.dead or s.results is not None]
        if failed:
            raise RuntimeError(f"silo host actor {failed[0].index} stopped before serving its silos; see "
                               f"{self.logs / f'actor-{failed[0].index}.log'}")

    def alive(self) -> bool:
        """Whether any actor is still hosting silos."""
        return any(s.results is None and not s.dead for s in self.shares)

    def wait(self, timeout: float) -> None:
        """Give the actors up to `timeout` seconds to finish on their own (their silos were told the run is done)."""
        end = time.time() + timeout
        while self.alive() and time.time() < end:
            self.check(rounds_left=False)
            time.sleep(0.2)

    def close(self) -> None:
        """Stop every actor (politely, then for good) and leave Ray: stop the local Ray we started, or only
        disconnect from a cluster we joined."""
        ray = self._ray
        if ray is None:
            return
        try:
            live = [s for s in self.shares if s.actor is not None]
            for share in live:
                try:
                    share.actor.stop.remote()
                except Exception:  # already dead
                    pass
            refs = [s.run_ref for s in live if s.results is None and not s.dead]
            if refs:
                ray.wait(refs, num_returns=len(refs), timeout=5.0)
            for share in live:
                try:
                    ray.kill(share.actor, no_restart=True)
                except Exception:
                    pass
        finally:
            ray.shutdown()
            if self._temp_dir:
                shutil.rmtree(self._temp_dir, ignore_errors=True)
                # A killed actor's process can take a moment to exit on a busy machine: the local Ray we started
                # leaves no process behind when the sim returns (a cluster's actors are the cluster's to reap).
                end = time.time() + ACTOR_EXIT_WAIT_S
                while any(s.pid and _process_alive(s.pid) for s in self.shares) and time.time() < end:
                    time.sleep(0.1)

