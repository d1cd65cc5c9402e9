"""One hostile silo against the hub, before and after the per-silo call rates and the close after quorum (issue 35).

    git worktree add /tmp/silokit-before 473512e      # the code before the limits, once
    python bench/systems/flood.py --before /tmp/silokit-before

Two measurements, each run on the code in `--before` and on this tree, with real processes over mutual TLS on
127.0.0.1 (a `silo-server`, `silo-client`s; every process started from the tree measured):

1. A flood: one enrolled silo (a valid certificate) makes NextTask calls under a wrong run id back to back on 4
   threads for 10 s. Reported: the calls it made per second, the hub's CPU seconds over those 10 s (from /proc), and
   how many lines and bytes the hub's log grew by.
2. A silent silo: 3 honest silo-client processes and one hand-written silo that joins, is sampled in round 1 and
   says nothing more. Reported: round 1's time (the hub's history.json), against rounds.deadline_s of 60 s.

Writes bench/systems/results/flood.{json,md}.
"""

from __future__ import annotations

import argparse
import datetime as dt
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

from bench.processor import cpus, machine  # noqa: E402

RESULTS = ROOT / "bench" / "systems" / "results"
FLOOD_S, THREADS, DEADLINE_S = 10.0, 4, 60.0
TINY = {"hub_epochs": 1, "local_epochs": 1, "silo_batch_size": 8, "hub_batch_size": 8, "tau": 0.0}


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def start(tree: Path, log: Path, *args: str) -> subprocess.Popen:
    """A process of the tree measured: `python -m` from that folder imports its code first."""
    return subprocess.Popen([sys.executable, "-m", *args], cwd=tree, stdout=open(log, "a"), stderr=subprocess.STDOUT,
                            env={**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(tree)})


def wait_for(predicate, timeout: float, what: str):
    end = time.time() + timeout
    while time.time() < end:
        value = predicate()
        if value:
            return value
        time.sleep(0.2)
    raise RuntimeError(f"timed out waiting for {what}")


def stage(folder: Path, port: int, silos: int, total: int, min_silos: int):
    from silo_sim.stage import stage_federation

    return stage_federation(folder, num_silos=silos, labels_per_class=2, unlabeled_limit=20 * silos,
                            test_per_class=5, seed=1, hub_config={
                                "run": {"threads": 1},
                                "server": {"port": port, "long_poll_s": 2.0, "linger_s": 2.0},
                                "metrics": {"enabled": False},
                                "algorithm": {"name": "semifl", "options": TINY},
                                "rounds": {"total": total, "min_silos": min_silos, "quorum": 0.5,
                                           "deadline_s": DEADLINE_S}})


def free_port() -> int:
    """Picked as silo-sim picks the hub's port: below the ephemeral range, so nothing takes it before the hub binds."""
    from silo_sim.federation import free_port_outside_ephemeral_range

    return free_port_outside_ephemeral_range("127.0.0.1")


def flood(tree: Path, folder: Path) -> dict:
    import grpc

    from security import tls
    from silo.v1 import silo_pb2, silo_pb2_grpc

    port = free_port()
    staged = stage(folder, port, silos=1, total=1, min_silos=2)  # the hub waits: nobody else joins
    log = folder / "hub.log"
    hub = start(tree, log, "silo_server.cli", "--config", str(staged.hub_config))
    try:
        wait_for(lambda: "hub listening on" in log.read_text(), 120, "the hub to listen")
        time.sleep(2.0)
        channel = tls.secure_channel(f"127.0.0.1:{port}", staged.silos[0].certs)
        stub = silo_pb2_grpc.FederationStub(channel)
        calls, stop = [0] * THREADS, threading.Event()

        def worker(i: int) -> None:
            while not stop.is_set():
                try:
                    stub.NextTask(silo_pb2.NextTaskRequest(run_id="not-this-run"), timeout=10)
                except grpc.RpcError:
                    pass
                calls[i] += 1

        size, lines, cpu = log.stat().st_size, log.read_text().count("\n"), cpu_seconds(hub.pid)
        threads = [threading.Thread(target=worker, args=(i,)) for i in range(THREADS)]
        started = time.time()
        for t in threads:
            t.start()
        time.sleep(FLOOD_S)
        stop.set()
        for t in threads:
            t.join(30)
        elapsed = time.time() - started
        hub_cpu = cpu_seconds(hub.pid) - cpu
        channel.close()
        time.sleep(0.5)
        return {"calls": sum(calls), "calls_per_s": sum(calls) / elapsed, "hub_cpu_s": hub_cpu,
                "hub_cores_busy": hub_cpu / elapsed, "log_lines": log.read_text().count("\n") - lines,
                "log_bytes": log.stat().st_size - size, "seconds": elapsed}
    finally:
        hub.terminate()
        hub.wait(30)


def silent(tree: Path, folder: Path) -> dict:
    import grpc

    from security import tls
    from security.terms import SIGNED_SECAGG, TYPED_TERMS
    from silo.v1 import silo_pb2, silo_pb2_grpc

    port = free_port()
    staged = stage(folder, port, silos=4, total=1, min_silos=4)
    log = folder / "hub.log"
    procs = [start(tree, log, "silo_server.cli", "--config", str(staged.hub_config))]
    try:
        wait_for(lambda: "hub listening on" in log.read_text(), 120, "the hub to listen")
        quiet = staged.silos[3]
        channel = tls.secure_channel(f"127.0.0.1:{port}", quiet.certs)
        stub = silo_pb2_grpc.FederationStub(channel)
        run_id = stub.Join(silo_pb2.JoinRequest(num_unlabeled=20, device="cpu", protocol_version=2,
                                                features=[TYPED_TERMS, SIGNED_SECAGG]), timeout=30).run.run_id
        for s in staged.silos[:3]:
            procs.append(start(tree, folder / f"{s.name}.log", "silo_client.cli", "--data", str(s.data), "--certs",
                               str(s.certs), "--hub", f"127.0.0.1:{port}", "--state-dir", str(s.state_dir),
                               "--threads", "1", "--connect-timeout", "120"))

        def sampled() -> bool:
            try:
                task = stub.NextTask(silo_pb2.NextTaskRequest(run_id=run_id), timeout=10)
            except grpc.RpcError:
                return False
            return task.kind == silo_pb2.Task.TRAIN  # sampled: from now on it says nothing

        wait_for(sampled, 120, "the silent silo to be sampled")
        channel.close()
        procs[0].wait(DEADLINE_S * 3)
        rounds = json.loads((staged.hub_state_dir / "history.json").read_text())["rounds"]
        return {"round_seconds": rounds[0]["round_seconds"], "silos_reported": rounds[0]["silos_reported"],
                "deadline_s": DEADLINE_S}
    finally:
        for p in procs:
            if p.poll() is None:
                p.terminate()
                p.wait(30)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--before", type=Path, required=True, help="a worktree of the code before the limits")
    args = p.parse_args()
    out = {"command": f"python bench/systems/flood.py --before {args.before}",
           "date": dt.datetime.now(dt.UTC).isoformat(), "machine": machine(),
           "before_commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=args.before,
                                           capture_output=True, text=True).stdout.strip(),
           "after_commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                                          text=True).stdout.strip(), "runs": {}}
    for label, tree in (("before", args.before.resolve()), ("after", ROOT)):
        with tempfile.TemporaryDirectory() as folder:
            out["runs"][label] = {"flood": flood(tree, Path(folder) / "flood"),
                                  "silent": silent(tree, Path(folder) / "silent")}
        print(label, json.dumps(out["runs"][label]), flush=True)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "flood.json").write_text(json.dumps(out, indent=2))
    b, a = out["runs"]["before"], out["runs"]["after"]
    on = f"{out['machine']['platform']}, {cpus(out['machine'])}"
    lines = [f"Command: `{out['command']}` ({out['date'][:19]}, {on}; before = "
             f"{out['before_commit']}, after = {out['after_commit']}).", "",
             "| | before | after |", "|---|---|---|",
             f"| flood: NextTask calls a second (wrong run id, {THREADS} threads, {FLOOD_S:.0f} s) | "
             f"{b['flood']['calls_per_s']:,.0f} | {a['flood']['calls_per_s']:,.0f} |",
             f"| flood: hub CPU (cores busy) | {b['flood']['hub_cores_busy']:.2f} | {a['flood']['hub_cores_busy']:.2f} |",
             f"| flood: hub log growth, lines / bytes | {b['flood']['log_lines']:,} / {b['flood']['log_bytes']:,} | "
             f"{a['flood']['log_lines']:,} / {a['flood']['log_bytes']:,} |",
             f"| a silent sampled silo: round 1 time (deadline {DEADLINE_S:.0f} s) | "
             f"{b['silent']['round_seconds']:.1f} s | {a['silent']['round_seconds']:.1f} s |"]
    (RESULTS / "flood.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
