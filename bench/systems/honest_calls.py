"""What an honest silo asks of the hub: calls per silo and round, by method, in a plain round and in a securely
aggregated one, counted by the hub's servicer (silokit_hub_calls_total). The per-silo call rates
(silo_server/wire/servicer.py CALL_RATES) are set well above these.

    python bench/systems/honest_calls.py            # about a minute on 2 cores

A hub (in this process, serving gRPC on 127.0.0.1) and 4 silo-client objects in threads, SemiFL on small images,
3 rounds each way. Writes bench/systems/results/honest_calls.{json,md}.
"""

from __future__ import annotations

import datetime as dt
import json
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
from PIL import Image

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
RESULTS = ROOT / "bench" / "systems" / "results"
SILOS, ROUNDS = 4, 3
METHODS = ("Join", "NextTask", "Download", "Upload", "Leave")


def run(folder: Path, privacy: dict) -> dict[str, float]:
    from silo_client.client import SiloClient, SiloSettings
    from silo_server.app import HubApp
    from silo_server.config import parse_config

    names = [f"silo-{i}" for i in range(1, SILOS + 1)]
    config = parse_config({
        "run": {"state_dir": "state", "device": "cpu", "threads": 1},
        "server": {"port": 0, "certs": "hub", "long_poll_s": 5.0, "linger_s": 1.0, "min_linger_s": 0.0},
        "data": {"labeled": {"kind": "demo", "labels_per_class": 2}},
        "algorithm": {"name": "semifl", "options": {"hub_epochs": 1, "local_epochs": 1, "tau": 0.0}},
        "rounds": {"total": ROUNDS, "min_silos": SILOS, "quorum": 1.0, "deadline_s": 120},
        "metrics": {"enabled": False}, "security": {"allowed_silos": names}, "privacy": privacy,
    }, base=folder)
    app = HubApp(config, insecure_dev_only=True)
    port = app.start_server()
    rng = np.random.default_rng(0)
    clients = []
    for name in names:
        images = folder / name
        images.mkdir()
        for i in range(20):
            Image.fromarray(rng.integers(0, 255, (28, 28), dtype=np.uint8)).save(images / f"{i}.png")
        clients.append(SiloClient(SiloSettings(hub=f"127.0.0.1:{port}", certs=None, data=images, device="cpu",
                                               state_dir=folder / f"{name}-state", insecure_dev_silo_id=name)))
    threads = [threading.Thread(target=c.run_forever, daemon=True) for c in clients]
    for t in threads:
        t.start()
    app.run()
    for t in threads:
        t.join(30)
    for c in clients:
        c.close()
    counters = dict(app.hub.registry.counters)
    return {m: counters.get(f"calls:{m}", 0) / SILOS / ROUNDS for m in METHODS}


def main() -> int:
    started = time.time()
    out = {"command": "python bench/systems/honest_calls.py", "date": dt.datetime.now(dt.UTC).isoformat(),
           "silos": SILOS, "rounds": ROUNDS, "calls_per_silo_per_round": {}}
    for label, privacy in (("plain", {}),
                           ("secure aggregation", {"secure_aggregation": {"enabled": True, "dropouts": 0}})):
        with tempfile.TemporaryDirectory() as folder:
            out["calls_per_silo_per_round"][label] = run(Path(folder), privacy)
    out["seconds"] = time.time() - started
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "honest_calls.json").write_text(json.dumps(out, indent=2))
    lines = [f"Command: `{out['command']}` ({out['date'][:19]}; {SILOS} silos, {ROUNDS} rounds, every silo in every "
             "round, the joins and the final polls included).", "",
             "| round | " + " | ".join(METHODS) + " |", "|---|" + "---|" * len(METHODS)]
    for label, calls in out["calls_per_silo_per_round"].items():
        lines.append(f"| {label} | " + " | ".join(f"{calls[m]:.2f}" for m in METHODS) + " |")
    (RESULTS / "honest_calls.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
