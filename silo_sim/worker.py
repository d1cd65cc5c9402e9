"""A worker process hosting several simulated silos, each with its own certificate, data, state and gRPC channel.

Silos in one worker take turns: each waits for its tasks on its own thread and mutual-TLS connection, and all of
them load, train and upload on one shared thread, one job at a time (see SiloClient: one OpenMP thread team per
process), so a small pool of workers can host a hundred silos on a two-core machine.

With `metrics_port` in the spec the worker serves ONE /metrics endpoint for all its silos, one series per silo
(label `silo`), and writes the port it got to `metrics_port_file`.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import logging
import signal
import sys
import threading
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="silo_sim.worker")
    p.add_argument("--spec", required=True, type=Path)
    args = p.parse_args(argv)
    spec = json.loads(args.spec.read_text())
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    import torch

    torch.set_num_threads(int(spec.get("threads", 1)))
    from silo_client.client import SiloClient, SiloSettings
    from silo_client.metrics import SiloMetricFamilies, SiloMetrics

    families = SiloMetricFamilies()
    server = None
    if spec.get("metrics_port") is not None:
        server = families.serve(spec.get("metrics_host", "127.0.0.1"), int(spec["metrics_port"]))
        Path(spec["metrics_port_file"]).write_text(str(server.port))
    stop = threading.Event()
    work_thread = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="silo-work")

    def run_work(work, *args):
        return work_thread.submit(work, *args).result()

    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    results: dict[str, int] = {}

    def host(entry: dict) -> None:
        name = entry["name"]
        client = None
        try:
            client = SiloClient(SiloSettings(
                hub=spec["hub"], certs=Path(entry["certs"]), data=Path(entry["data"]) if entry.get("data") else None,
                labeled=Path(entry["labeled"]) if entry.get("labeled") else None, device=spec.get("device", "cpu"),
                state_dir=Path(entry["state_dir"]), connect_timeout_s=float(spec.get("connect_timeout_s", 120)),
                sim_labels=Path(entry["labels"]) if entry.get("labels") else None, name=name,
            ), run_work=run_work, stop_event=stop,
                metrics=SiloMetrics(families, name, certs=Path(entry["certs"])))
            results[name] = client.run_forever()
        except Exception as err:  # one silo's failure must not take the others down
            logging.getLogger("silo_sim.worker").error("silo %s stopped: %s", name, err)
            results[name] = 1
        finally:
            if client is not None:
                client.close()

    threads = [threading.Thread(target=host, args=(e,), name=e["name"], daemon=True) for e in spec["silos"]]
    for t in threads:
        t.start()
    for t in threads:
        while t.is_alive():
            t.join(timeout=0.5)
    work_thread.shutdown(wait=False, cancel_futures=True)
    if server is not None:
        # Let Prometheus see the end. When the sim registered us with a Prometheus, wait even if no scrape came yet
        # (a short run can end before discovery) and for a few scrapes, so that rates over the end have samples.
        watched = bool(spec.get("watched"))
        for _ in range(3 if watched else 1):
            if not server.wait_for_scrape(float(spec.get("metrics_final_scrape_s", 30)), watched=watched):
                break
        server.close()
    failed = sorted(n for n, rc in results.items() if rc != 0)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
