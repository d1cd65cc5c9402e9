"""Serve a prometheus-client registry at http://host:port/metrics (shared by the hub, silo-client and silo-sim).

A registry per process part (never the global default one) keeps tests and the simulation's many silos apart.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, disable_created_metrics, start_http_server

# The `_created` series prometheus-client adds to every counter and histogram double the series count and mean
# nothing to our dashboards: leave them out of every endpoint this kit serves.
disable_created_metrics()


@dataclass
class MetricsServer:
    host: str
    port: int
    _server: object
    _thread: threading.Thread

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}/metrics"

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)


def serve_metrics(registry: CollectorRegistry, host: str, port: int, hint: str) -> MetricsServer:
    """Serve `registry` on host:port (port 0 picks a free one). `hint` tells the operator how to fix a busy port."""
    try:
        server, thread = start_http_server(port, addr=host, registry=registry)
    except OSError as err:
        raise OSError(f"cannot serve metrics on {host}:{port}: {err.strerror or err}; {hint}") from None
    return MetricsServer(host, server.server_port, server, thread)
