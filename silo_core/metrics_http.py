"""Serve a prometheus-client registry at http://host:port/metrics (shared by the hub, silo-client and silo-sim).

A registry per process part (never the global default one) keeps tests and the simulation's many silos apart.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, disable_created_metrics, start_http_server
from prometheus_client.registry import Collector

# The `_created` series prometheus-client adds to every counter and histogram double the series count and mean
# nothing to our dashboards: leave them out of every endpoint this kit serves.
disable_created_metrics()


class ScrapeClock(Collector):
    """Adds no series; remembers when the registry was last collected, i.e. when Prometheus last scraped it."""

    def __init__(self) -> None:
        self.last = 0.0
        self.changed = threading.Condition()

    def collect(self):
        with self.changed:
            self.last = time.time()
            self.changed.notify_all()
        return iter(())


@dataclass
class MetricsServer:
    host: str
    port: int
    _server: object
    _thread: threading.Thread
    clock: ScrapeClock = field(default_factory=ScrapeClock)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}/metrics"

    def wait_for_scrape(self, timeout: float, watched: bool = False) -> bool:
        """Before a process exits: give Prometheus up to `timeout` seconds to collect the final values.

        Returns at once when nothing has ever scraped this endpoint (no Prometheus is watching), unless the caller
        knows one is (`watched`: a short run can end before Prometheus has even discovered the target). True when
        a scrape after this call's start was seen.
        """
        since = time.time()
        end = since + timeout
        with self.clock.changed:
            if self.clock.last == 0.0 and not watched:
                return False
            while self.clock.last < since:
                remaining = end - time.time()
                if remaining <= 0:
                    return False
                self.clock.changed.wait(remaining)
        return True

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)


def serve_metrics(registry: CollectorRegistry, host: str, port: int, hint: str) -> MetricsServer:
    """Serve `registry` on host:port (port 0 picks a free one). `hint` tells the operator how to fix a busy port."""
    clock = ScrapeClock()
    try:
        server, thread = start_http_server(port, addr=host, registry=registry)
    except OSError as err:
        raise OSError(f"cannot serve metrics on {host}:{port}: {err.strerror or err}; {hint}") from None
    registry.register(clock)
    return MetricsServer(host, server.server_port, server, thread, clock)
