"""What idle silos cost the hub: N silos joined over mutual TLS, no round open, each asking for work as silo-client
does (NextTask; on WAIT, ask again after the hub's retry_after_s). Measured over a window: NextTask calls the hub
answered per second, and the hub process's CPU time per second of wall time.

    python bench/systems/idle.py --silos 1000 --seconds 60 --long-poll 5 300

Each --long-poll value is one run with that server.long_poll_s: 5 s is what silo-sim used to set, 300 s the
default now that a waiting silo holds no thread. The hub runs in a process of its own (this script with --serve);
the silos are one client process with a channel and a certificate each. Writes results/idle.json and prints a table.
"""

from __future__ import annotations

import argparse
import heapq
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import grpc  # noqa: E402
import torch  # noqa: E402

from bench.processor import machine  # noqa: E402
from security import pki, tls  # noqa: E402
from security.crl import RevocationList  # noqa: E402
from security.gate import PeerGate  # noqa: E402
from silo.v1 import silo_pb2, silo_pb2_grpc  # noqa: E402
from silo_core.algorithms.base import HubAlgorithm, HubState, RoundPlan  # noqa: E402
from silo_core.models import ModelSpec  # noqa: E402
from silo_server.hub import Hub, HubSettings, RoundSettings  # noqa: E402
from silo_server.wire.servicer import FederationServer, FederationServicer  # noqa: E402

RUN = {"algorithm": "idle", "model": "small_cnn", "num_classes": 10, "in_channels": 1, "image_size": 28,
       "algorithm_options": {}, "mean": [0.5], "std": [0.5], "max_upload_bytes": 1 << 20, "chunk_bytes": 1 << 16}


class NoRounds(HubAlgorithm):
    """The hub's round loop never starts in this benchmark: silos only wait."""

    name = "idle"

    def __init__(self):
        super().__init__(None, ModelSpec(), None, torch.device("cpu"), 0, 1)

    def init_state(self):
        return HubState(0, {})

    def begin_round(self, state):
        return RoundPlan(state.round + 1, {}, {}, {})

    def finish_round(self, state, summed, metrics):
        return state, {}

    def served_model(self, state):
        return torch.nn.Identity()


def serve(pki_dir: Path, long_poll_s: float, port_file: Path) -> None:
    """The hub: the real servicer and gate over mutual TLS; no round is ever opened."""
    bundle = pki_dir / "hub"
    hub = Hub(NoRounds(), HubSettings(RoundSettings(total_rounds=1), liveness_s=600), state_dir=pki_dir / "state",
              run_description=RUN)
    gate = PeerGate(revocations=RevocationList(bundle / "crl.pem", bundle / "ca.pem"))
    server = FederationServer(FederationServicer(hub, long_poll_s, 1 << 16, gate), options=[
        ("grpc.http2.min_ping_interval_without_data_ms", 10_000), ("grpc.keepalive_permit_without_calls", 1)])
    port = server.add_port("127.0.0.1:0", tls.ReloadingServerCredentials(bundle).credentials)
    server.start()
    port_file.write_text(str(port))
    threading.Event().wait()


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


class Silos:
    """N silos asking for work the way silo-client does, driven by futures and one timer thread."""

    def __init__(self, port: int, bundles: list[Path]):
        options = [("grpc.keepalive_time_ms", 30_000), ("grpc.keepalive_permit_without_calls", 0)]
        self.channels = [tls.secure_channel(f"127.0.0.1:{port}", b, options=options) for b in bundles]
        self.stubs = [silo_pb2_grpc.FederationStub(c) for c in self.channels]
        self.run_id = ""
        self.answered = 0
        self.errors = 0
        self.lock = threading.Lock()
        self.timers: list[tuple[float, int]] = []
        self.wake = threading.Condition(self.lock)
        self.stopped = False

    def join_all(self) -> None:
        for stub in self.stubs:
            self.run_id = stub.Join(silo_pb2.JoinRequest(num_unlabeled=100, device="cpu"), timeout=60).run.run_id

    def start(self) -> None:
        threading.Thread(target=self._timer_loop, daemon=True).start()
        for i in range(len(self.stubs)):
            self._poll(i)

    def _poll(self, i: int) -> None:
        call = self.stubs[i].NextTask.future(silo_pb2.NextTaskRequest(run_id=self.run_id), timeout=330)
        call.add_done_callback(lambda f, i=i: self._done(i, f))

    def _done(self, i: int, call) -> None:
        with self.lock:
            try:
                delay = min(call.result().retry_after_s, 5.0)
                self.answered += 1
            except grpc.RpcError:
                delay = 1.0
                self.errors += 1
            if not self.stopped:
                heapq.heappush(self.timers, (time.monotonic() + delay, i))
                self.wake.notify()

    def _timer_loop(self) -> None:
        with self.lock:
            while not self.stopped:
                now = time.monotonic()
                due = []
                while self.timers and self.timers[0][0] <= now:
                    due.append(heapq.heappop(self.timers)[1])
                if due:
                    self.lock.release()
                    try:
                        for i in due:
                            self._poll(i)
                    finally:
                        self.lock.acquire()
                    continue
                self.wake.wait(timeout=(self.timers[0][0] - now) if self.timers else 1.0)

    def close(self) -> None:
        with self.lock:
            self.stopped = True
            self.wake.notify()
        for c in self.channels:
            c.close()


def measure(silos: int, seconds: float, long_poll_s: float, warmup: float = 10.0) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        ca = pki.init_ca(root / "ca")
        pki.issue_hub(ca, root / "hub", dns=["localhost"], ips=["127.0.0.1"])
        bundles = [pki.issue_silo(ca, f"silo-{i:04d}", root / "silos" / f"{i}") for i in range(silos)]
        port_file = root / "port"
        hub = subprocess.Popen([sys.executable, __file__, "--serve", str(root), "--long-poll", str(long_poll_s),
                                "--port-file", str(port_file)])
        try:
            while not port_file.exists():
                time.sleep(0.1)
            swarm = Silos(int(port_file.read_text()), bundles)
            swarm.join_all()
            swarm.start()
            time.sleep(warmup)
            cpu0, calls0, t0 = cpu_seconds(hub.pid), swarm.answered, time.monotonic()
            time.sleep(seconds)
            cpu1, calls1, t1 = cpu_seconds(hub.pid), swarm.answered, time.monotonic()
            errors = swarm.errors
            swarm.close()
        finally:
            hub.kill()
            hub.wait()
    wall = t1 - t0
    return {"silos": silos, "long_poll_s": long_poll_s, "window_s": round(wall, 1),
            "calls_per_s": (calls1 - calls0) / wall, "calls_per_silo_per_s": (calls1 - calls0) / wall / silos,
            "hub_cpu_per_s": (cpu1 - cpu0) / wall, "errors": errors}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--silos", type=int, default=1000)
    p.add_argument("--seconds", type=float, default=60.0)
    p.add_argument("--long-poll", type=float, nargs="+", default=[5.0, 300.0])
    p.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "idle.json")
    p.add_argument("--serve", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--port-file", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.serve:
        serve(args.serve, args.long_poll[0], args.port_file)
        return 0
    rows = [measure(args.silos, args.seconds, lp) for lp in args.long_poll]
    print("| silos | server.long_poll_s | NextTask calls/s at the hub | per silo | hub CPU s per s | errors |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['silos']} | {r['long_poll_s']:g} | {r['calls_per_s']:.1f} | {r['calls_per_silo_per_s']:.4f} | "
              f"{r['hub_cpu_per_s']:.3f} | {r['errors']} |")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"machine": machine(),
                                    "command": "python bench/systems/idle.py " + " ".join(argv or sys.argv[1:]),
                                    "rows": rows}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
