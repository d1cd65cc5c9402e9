"""The hub at the other end of the wire, as a silo sees it: the certificate it presented (HubSeen, shared by the
silos of one process for a minute), why a call failed in words an operator can act on, and the wait a rate refusal
asks for."""

from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass

import grpc

from security.tls import RETRY_AFTER_KEY


class HubCertificateUnchecked(Exception):
    """The hub's certificate could not be fetched to check it against the revocation list (the silo retries)."""


class HubTlsRefused(HubCertificateUnchecked):
    """A TLS verification failure that will not fix itself (another CA, a host the certificate does not name, an
    expired certificate on either side): the silo gives up after a short grace, saying the cause and the fix."""


@dataclass(frozen=True)
class HubSeen:
    """The certificate a hub presented in a verified handshake: its serial, and its sha256 fingerprint (for the
    audit: which hub received what)."""

    serial: int
    fingerprint: str


class HubSerialsSeen:
    """The serial of the certificate a hub presented in a verified handshake, by (hub address, trusted CA), shared
    by the silos of one process: a silo-sim host's hundreds of silos make one checking handshake a minute instead
    of one each (at 1,000 silos those handshakes were a tenth of the joins' CPU). Each silo still judges the serial
    against its own revocation list; one silo-client process has one silo, so nothing is shared there."""

    def __init__(self) -> None:
        self._seen: dict[tuple[str, bytes], tuple[float, HubSeen]] = {}
        self._lock = threading.Lock()

    def recent(self, hub: str, ca_pem: bytes, within_s: float) -> HubSeen | None:
        with self._lock:
            at, seen = self._seen.get((hub, ca_pem), (-math.inf, None))
        return seen if time.monotonic() - at < within_s else None

    def saw(self, hub: str, ca_pem: bytes, seen: HubSeen) -> None:
        with self._lock:
            self._seen[(hub, ca_pem)] = (time.monotonic(), seen)


HUB_SERIALS_SEEN = HubSerialsSeen()


def describe_rpc_error(err: grpc.RpcError, hub: str) -> str:
    details = (err.details() or "").replace("\n", " ")
    if err.code() == grpc.StatusCode.UNAVAILABLE:
        low = details.lower()
        if any(w in low for w in ("ssl", "certificate", "handshake", "tls")):
            return (f"TLS handshake with the hub at {hub} failed ({details[:160]}); check that --certs holds a "
                    f"bundle issued by the hub's CA and that --hub names the host on the hub certificate")
        return f"cannot reach the hub at {hub} ({details[:160]}); check --hub HOST:PORT and that silo-server runs"
    return f"{err.code().name}: {details}"


def retry_after_s(err: grpc.RpcError) -> float | None:
    """The wait a rate refusal asks for (trailing metadata retry-after-ms, silo_server/wire/servicer.py), or None."""
    try:
        metadata = err.trailing_metadata() or ()
    except Exception:  # an error raised before any response has no metadata
        return None
    for key, value in metadata:
        if key == RETRY_AFTER_KEY:
            try:
                return max(0.0, float(value) / 1000.0)
            except (TypeError, ValueError):
                return None
    return None
