"""A silo host: several simulated silos in one process, each with its own certificate, data, state and gRPC channel.

Silos in one host take turns: each waits for its tasks on its own thread and mutual-TLS connection, and all of
them load, train and upload on one shared thread, one job at a time (see SiloClient: one OpenMP thread team per
process), so a small pool of hosts can host a hundred silos on a two-core machine.

`host_silos` is the host; two engines run it: this module's entry point as a worker process (silo-sim's default)
and silo_sim/ray_engine.py's Ray actor (`silo-sim --engine ray`).

With `metrics_port` in the spec the host serves ONE /metrics endpoint for all its silos, one series per silo
(label `silo`), and writes the port it got to `metrics_port_file`.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import logging
import signal
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any


def host_silos(spec: dict[str, Any], stop: threading.Event) -> dict[str, int]:
    """Run every silo of `spec` until the hub says the run is done (or `stop` is set); returns each silo's exit
    code by name (0: done). Installs no signal handler, so that it also runs off the main thread (a Ray actor)."""
    import torch

    threads = int(spec.get("threads", 1))
    torch.set_num_threads(threads)
    from silo_client.client import SiloClient, SiloSettings
    from silo_client.errors import SiloLeft
    from silo_client.metrics import SiloMetricFamilies, SiloMetrics
    from silo_client.policy import load_policy

    families = SiloMetricFamilies()
    server = None
    if spec.get("metrics_port") is not None:
        server = families.serve(spec.get("metrics_host", "127.0.0.1"), int(spec["metrics_port"]))
        Path(spec["metrics_port_file"]).write_text(str(server.port))
    # The work thread gets the same thread count whichever thread called us (a process's main thread or an actor's).
    work_thread = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="silo-work",
                                                        initializer=torch.set_num_threads, initargs=(threads,))

    def run_work(work, *args):
        return work_thread.submit(work, *args).result()

    results: dict[str, int] = {}
    hub_listening = threading.Event()
    ends: dict[str, dict[str, Any]] = {}  # silo -> its exit code and why (spec's ended_file, which silo-sim reads)
    ends_lock = threading.Lock()

    def ended(name: str, code: int, why: str) -> None:
        results[name] = code
        if spec.get("ended_file"):
            from silo_core.files import write_json_atomic

            with ends_lock:
                ends[name] = {"code": code, "why": why}
                write_json_atomic(Path(spec["ended_file"]), ends)
    threading.Thread(target=wait_for_listener, args=(spec["hub"], hub_listening, stop,
                                                     float(spec.get("connect_timeout_s", 120))),
                     name="hub-probe", daemon=True).start()

    def host(entry: dict) -> None:
        name = entry["name"]
        client = None
        try:
            client = SiloClient(SiloSettings(
                hub=spec["hub"], certs=Path(entry["certs"]), data=Path(entry["data"]) if entry.get("data") else None,
                labeled=Path(entry["labeled"]) if entry.get("labeled") else None, device=spec.get("device", "cpu"),
                state_dir=Path(entry["state_dir"]), connect_timeout_s=float(spec.get("connect_timeout_s", 120)),
                sim_labels=Path(entry["labels"]) if entry.get("labels") else None, name=name,
                wrap_algorithm=attack_wrapper(name, entry.get("attack")),
                load_when_sampled=bool(spec.get("load_when_sampled", False)),
                policy=load_policy(Path(entry["policy"])) if entry.get("policy") else None,
            ), run_work=run_work, stop_event=stop,
                metrics=SiloMetrics(families, name, certs=Path(entry["certs"])))
            hub_listening.wait()  # set up while the hub starts; dial it once it listens
            code = client.run_forever()
            ended(name, code, f"exited with code {code}")
        except SiloLeft as left:  # its policy refused the run or left it: said to the hub, recorded, not a crash
            logging.getLogger("silo_sim.worker").warning("silo %s left the run by its policy (%s): %s", name,
                                                         left.refusal.clause, left)
            ended(name, 3, f"left by its policy ({left.refusal.clause}): {left}")
        except Exception as err:  # one silo's failure must not take the others down
            logging.getLogger("silo_sim.worker").error("silo %s stopped: %s", name, err)
            ended(name, 1, f"stopped: {err}")
        finally:
            if client is not None:
                client.close()

    threads_per_silo = [threading.Thread(target=host, args=(e,), name=e["name"], daemon=True) for e in spec["silos"]]
    for t in threads_per_silo:
        t.start()
    for t in threads_per_silo:
        while t.is_alive():
            t.join(timeout=0.5)
    work_thread.shutdown(wait=False, cancel_futures=True)
    if server is not None:
        # Let Prometheus see the end. When the sim registered us with a Prometheus, wait even if no scrape came yet
        # (a short run can end before discovery) and for a few scrapes, so that rates over the end have samples.
        watched = bool(spec.get("watched"))
        for _ in range(3 if watched else 1):
            if stop.is_set() or not server.wait_for_scrape(float(spec.get("metrics_final_scrape_s", 30)),
                                                           watched=watched):
                break
        server.close()
    return results


def attack_wrapper(name: str, attack: str | None):
    """silo-sim's attacking silos (--attackers, --attack): their algorithm, wrapped from outside the silo."""
    if attack is None:
        return None
    from silo_sim.attacks import PoisonedSilo

    def wrap(algorithm):
        logging.getLogger("silo_sim.worker").warning("SIMULATED ATTACK: silo %s poisons its results (%s)", name,
                                                     attack)
        return PoisonedSilo(algorithm, attack)

    return wrap


def wait_for_listener(address: str, listening: threading.Event, stop: threading.Event, timeout: float) -> None:
    """Set `listening` once something accepts TCP connections at `address` (HOST:PORT), or when `timeout` seconds
    or `stop` end the wait: the host starts beside the hub, and silos that dialled a hub still loading would back
    off for seconds (1, 2, 4, ... as a real branch does) after it came up. Past the timeout the silos dial anyway
    and report what they find."""
    from security.tls import split_target

    host, port = split_target(address)
    end = time.monotonic() + timeout
    try:
        while not stop.is_set() and time.monotonic() < end:
            try:
                with socket.create_connection((host, port), timeout=1.0):
                    return
            except OSError:
                stop.wait(0.1)
    finally:
        listening.set()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="silo_sim.worker")
    p.add_argument("--spec", required=True, type=Path)
    p.add_argument("--wait-for-spec", type=float, nargs="?", const=3600.0, default=0.0, metavar="SECONDS",
                   help="started while silo-sim still stages the silos: import what the silos need, then wait up to "
                        "SECONDS (default 3600) for the spec file to appear")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    if args.wait_for_spec:
        import silo_client.client  # noqa: F401  (torch, gRPC, the algorithms: seconds of imports, done meanwhile)

        end = time.monotonic() + args.wait_for_spec
        while not args.spec.exists():
            if stop.wait(0.05) or time.monotonic() > end:
                print(f"no spec file {args.spec} within {args.wait_for_spec:g}s; stopping", file=sys.stderr)
                return 1
    spec = json.loads(args.spec.read_text())
    results = host_silos(spec, stop)
    return 1 if any(rc not in (0, 3) for rc in results.values()) else 0  # 3: left by its policy, said why


if __name__ == "__main__":
    sys.exit(main())
