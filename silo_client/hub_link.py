"""The hub at the other end of the wire, as a silo sees it: the certificate it presented, checked against the
federation CA's revocation list by a handshake of the silo's own (HubCertificateCheck; what it saw is shared by the
silos of one process for a minute), why a call failed in words an operator can act on, and the wait a rate refusal
asks for."""

from __future__ import annotations

import math
import ssl
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import grpc
from cryptography.hazmat.primitives import hashes

from security.crl import CrlError, RevocationList
from security.pki import BUNDLE_CA, BUNDLE_CRL
from security.tls import RETRY_AFTER_KEY, describe_tls_failure, hub_certificate, hub_tls_context
from silo_client.errors import SiloError

HUB_CHECK_EVERY_S = 60.0  # how often, at most, a silo checks the hub's certificate before a round's download


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


def upload_refused(err: grpc.RpcError) -> bool:
    """Whether a failed upload was received and refused by the hub (its content, its size, the round's privacy),
    so that sending the same bytes again would be refused again; False when it may simply not have arrived (the
    hub away, a deadline, a cancel) or the hub only asked this silo to wait (a limit refusal's retry-after: calls
    too fast, or too many open, as when its previous upload is still held there)."""
    code = err.code()
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        return retry_after_s(err) is None
    return code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION)


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


class HubCertificateCheck:
    """Refuses a hub whose certificate the federation CA has revoked. gRPC Python cannot check a CRL in its
    handshake, so a handshake of the silo's own (a few ms) fetches the certificate the hub's address serves: before
    joining, and before a round's download at most once a minute, so a key stolen from the hub is refused within a
    minute of the new crl.pem reaching the silo. Off (`enabled` False) without a certificate bundle or in dev mode.

    `certs`: the silo's bundle (its ca.pem is the CA trusted; crl.pem the revocation list unless `crl` names one;
    neither: no revocation check). Raises SiloError at once when the revocation list cannot be read."""

    def __init__(self, hub: str, certs: Path | None, crl: Path | None, enabled: bool):
        self.hub, self.certs, self.enabled = hub, certs, enabled
        self.revocations = self._revocation_list(crl)
        self.trusted_ca = (certs / BUNDLE_CA).read_bytes() if enabled else b""
        self.tls: ssl.SSLContext | None = None  # built when this silo first makes the handshake itself
        self.checked_at = -math.inf
        self.seen = HubSeen(0, "")  # the certificate last verified (for the audit: which hub received what)

    def _revocation_list(self, crl: Path | None) -> RevocationList | None:
        """The CA's revocation list (`crl`, else crl.pem in the bundle when there is one), or None: no check."""
        if self.certs is None:
            return None
        path = crl or self.certs / BUNDLE_CRL
        if crl is None and not path.is_file():
            return None
        try:
            return RevocationList(path, self.certs / BUNDLE_CA, where_set="pass --crl with the CA's crl.pem")
        except CrlError as err:
            raise SiloError(str(err)) from None

    def revoked(self, serial: int) -> bool:
        return self.revocations is not None and self.revocations.is_revoked(serial)

    def identity(self) -> dict[str, str]:
        """For the audit: the hub certificate this silo's own handshake last verified (empty in dev mode)."""
        return {"serial": f"{self.seen.serial:x}" if self.seen.serial else "", "fingerprint": self.seen.fingerprint}

    def check(self, unless_checked_within_s: float = 0.0) -> None:
        """Check the hub's certificate now, unless this silo did within `unless_checked_within_s`. A serial another
        silo of this process saw at the same address under the same CA within the minute is used instead of a
        handshake (HubSerialsSeen), unless this silo's CRL revokes it. SiloError for a revoked hub;
        HubCertificateUnchecked when the hub cannot be reached or does not pass verification (the caller retries)."""
        if not self.enabled or time.monotonic() - self.checked_at < unless_checked_within_s:
            return
        seen = HUB_SERIALS_SEEN.recent(self.hub, self.trusted_ca, within_s=HUB_CHECK_EVERY_S)
        if seen is None or self.revoked(seen.serial):  # a revoked one afresh: the hub may have its new one by now
            seen = self._handshake()
            HUB_SERIALS_SEEN.saw(self.hub, self.trusted_ca, seen)
        if self.revoked(seen.serial):
            raise SiloError(
                f"the hub at {self.hub} presents certificate serial {seen.serial:x}, which the federation CA revoked "
                f"(revocation list {self.revocations.crl_path}); whoever holds that key may not be the hub. Nothing "
                f"was sent. Ask the federation's operator for the hub's current address and certificate")
        self.checked_at = time.monotonic()
        self.seen = seen

    def _handshake(self) -> HubSeen:
        """The certificate the hub presents, from a verified handshake of this silo's own."""
        if self.tls is None:
            self.tls = hub_tls_context(self.certs)
        try:
            cert = hub_certificate(self.hub, self.tls)
            return HubSeen(cert.serial_number, cert.fingerprint(hashes.SHA256()).hex())
        except ssl.SSLError as err:
            permanent = describe_tls_failure(err, self.hub)
            if permanent is not None:
                raise HubTlsRefused(permanent) from None
            raise HubCertificateUnchecked(
                f"TLS handshake with the hub at {self.hub} failed ({err}), so its certificate could not be checked "
                f"against the revocation list; check that --certs holds a bundle issued by the hub's CA and that "
                f"--hub names the host on the hub certificate") from None
        except OSError as err:
            raise HubCertificateUnchecked(f"cannot reach the hub at {self.hub} to check its certificate ({err}); "
                                          f"check --hub HOST:PORT and that silo-server runs") from None
