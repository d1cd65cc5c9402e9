"""gRPC mutual-TLS credentials built from a bundle directory (ca.pem, cert.pem, key.pem; see security.pki).

The hub serves with ``ReloadingServerCredentials`` (client certificates required and verified against the
federation CA; a renewed hub certificate in the bundle is served to new connections without a restart) or the
static ``server_credentials``; a silo dials with ``secure_channel``. On the hub, ``peer_identity(context)`` is
the only source of a caller's identity: the CN of the client certificate that the TLS handshake verified.

TLS versions: gRPC Python exposes no minimum-version setting, so silokit cannot force TLS 1.3. The TLS stack
inside grpcio (BoringSSL) accepts TLS 1.2 and 1.3 and nothing older; two silokit peers always negotiate TLS 1.3
(both sides offer it). A TLS 1.2 client still needs a client certificate from the federation CA, and gets only
ECDHE key exchange with AEAD ciphers (forward secrecy). docs/security.md has the details.

``insecure_dev_channel`` is the silo's side of ``silo-server --insecure-dev-only``: plaintext, loopback only, with
a *declared* silo id in the call metadata. The hub reads that id only in that mode; with TLS it never looks.

Bundles are checked here before gRPC sees them (files present, key matches certificate, certificate signed by
the bundle's CA, right purpose, not expired) because gRPC reports all of those as an opaque handshake failure
on the *other* machine.
"""

from __future__ import annotations

import collections
import datetime as dt
import ipaddress
import logging
import os
import socket
import ssl
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.types import PrivateKeyTypes
from cryptography.x509.oid import ExtendedKeyUsageOID

from security.pki import BUNDLE_CA, BUNDLE_CERT, BUNDLE_KEY, PkiError, validate_silo_name

log = logging.getLogger("security")

# auth_context() keys set by gRPC's TLS transport for a verified peer.
_CN_KEY = "x509_common_name"
_PEM_KEY = "x509_pem_cert"
# Call metadata carrying a silo's declared id in --insecure-dev-only mode (and only there).
DEV_IDENTITY_KEY = "silokit-insecure-dev-silo-id"
# Trailing metadata of a call the hub refused for its rate: how many milliseconds until the silo may call again.
RETRY_AFTER_KEY = "retry-after-ms"


class TlsError(Exception):
    """A bundle cannot be used for TLS; the message names the file and what to do."""


def _hint(role: str, bundle_dir: Path) -> str:
    if role == "server":
        return f"run `silo-certs issue-hub --ca CA_DIR --out {bundle_dir}` and copy the bundle to the hub"
    return (
        f"run `silo-certs issue-silo NAME --ca CA_DIR --out {bundle_dir}` on the CA machine "
        "and copy the bundle to this silo"
    )


@dataclass(frozen=True)
class Bundle:
    """A certificate bundle read and checked by :func:`read_bundle`: its three PEM files, and the certificate and key
    parsed (a silo signs its secure-aggregation keys with them, so they are parsed once for the channel and that)."""

    dir: Path
    ca_pem: bytes
    cert_pem: bytes
    key_pem: bytes
    cert: x509.Certificate
    key: PrivateKeyTypes


def read_bundle(bundle_dir: Path, role: str) -> Bundle:
    """A bundle's files, after checking they can work for ``role`` ("server"/"client"); TlsError naming the file
    and the fix otherwise."""
    bundle_dir = Path(bundle_dir)
    if not bundle_dir.is_dir():
        raise TlsError(f"certificate bundle {bundle_dir} is not a directory; {_hint(role, bundle_dir)}")
    data: dict[str, bytes] = {}
    for name in (BUNDLE_CA, BUNDLE_CERT, BUNDLE_KEY):
        path = bundle_dir / name
        if not path.is_file():
            raise TlsError(f"{path} not found; {_hint(role, bundle_dir)}")
        data[name] = path.read_bytes()

    ca_pem, cert_pem, key_pem = data[BUNDLE_CA], data[BUNDLE_CERT], data[BUNDLE_KEY]
    try:
        ca = x509.load_pem_x509_certificate(ca_pem)
    except ValueError as e:
        raise TlsError(
            f"{bundle_dir / BUNDLE_CA} is not a PEM certificate ({e}); {_hint(role, bundle_dir)}"
        ) from e
    try:
        cert = x509.load_pem_x509_certificate(cert_pem)
    except ValueError as e:
        raise TlsError(
            f"{bundle_dir / BUNDLE_CERT} is not a PEM certificate ({e}); {_hint(role, bundle_dir)}"
        ) from e
    try:
        key = serialization.load_pem_private_key(key_pem, password=None)
    except TypeError as e:
        raise TlsError(f"{bundle_dir / BUNDLE_KEY} is encrypted; gRPC needs an unencrypted key") from e
    except ValueError as e:
        raise TlsError(
            f"{bundle_dir / BUNDLE_KEY} is not a PEM private key ({e}); {_hint(role, bundle_dir)}"
        ) from e

    if key.public_key() != cert.public_key():
        raise TlsError(
            f"{bundle_dir / BUNDLE_KEY} does not match {bundle_dir / BUNDLE_CERT}; {_hint(role, bundle_dir)}"
        )
    try:
        cert.verify_directly_issued_by(ca)
    except (ValueError, TypeError, InvalidSignature) as e:  # wrong issuer name, key type or signature
        raise TlsError(
            f"{bundle_dir / BUNDLE_CERT} was not issued by {bundle_dir / BUNDLE_CA}; the bundle mixes two CAs. "
            + _hint(role, bundle_dir)
        ) from e
    wanted = ExtendedKeyUsageOID.SERVER_AUTH if role == "server" else ExtendedKeyUsageOID.CLIENT_AUTH
    try:
        eku = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    except x509.ExtensionNotFound:
        eku = None  # no EKU means "any purpose"
    if eku is not None and wanted not in eku:
        other = "a silo (client)" if role == "server" else "the hub (server)"
        raise TlsError(f"{bundle_dir / BUNDLE_CERT} is a certificate for {other}; {_hint(role, bundle_dir)}")
    now = dt.datetime.now(dt.UTC)
    if cert.not_valid_after_utc <= now:
        raise TlsError(
            f"{bundle_dir / BUNDLE_CERT} expired on {cert.not_valid_after_utc:%Y-%m-%d}; issue a new one: "
            + _hint(role, bundle_dir)
        )
    return Bundle(bundle_dir, ca_pem, cert_pem, key_pem, cert, key)


def server_credentials(bundle_dir: Path) -> grpc.ServerCredentials:
    """Hub credentials: serve the hub certificate and require a client certificate signed by the bundle's CA."""
    b = read_bundle(bundle_dir, "server")
    return grpc.ssl_server_credentials([(b.key_pem, b.cert_pem)], root_certificates=b.ca_pem, require_client_auth=True)


class ReloadingServerCredentials:
    """Hub credentials that serve a renewed certificate (or a rotated CA, for TLS: with secure aggregation on, the
    hub checks silos' signed keys against the CA it read at start, so a rotated CA needs a restart, as
    docs/security.md says) to new connections without a restart.

    gRPC asks ``_fetch`` before every new TLS handshake; it stat()s the bundle's three files and, when one
    changed, re-reads and re-checks the whole bundle. A bundle caught half-copied (a new cert.pem with the old
    key.pem) or otherwise unusable is skipped with one warning, and the current certificate stays in service
    until the files are consistent again. Established connections keep the certificate they started with.
    ``on_load(cert_pem)`` runs for the first certificate and each reloaded one (the hub records its expiry).
    """

    def __init__(self, bundle_dir: Path, on_load: Callable[[bytes], None] | None = None):
        self.bundle_dir = Path(bundle_dir)
        self.on_load = on_load
        self._lock = threading.Lock()
        self.reloads = 0
        seen = self._signatures()
        bundle = read_bundle(self.bundle_dir, "server")
        self._loaded, self._rejected = seen, None
        if on_load is not None:
            on_load(bundle.cert_pem)
        self.credentials = grpc.dynamic_ssl_server_credentials(
            self._configuration(bundle), self._fetch, require_client_authentication=True
        )

    @staticmethod
    def _configuration(bundle: Bundle) -> grpc.ServerCertificateConfiguration:
        return grpc.ssl_server_certificate_configuration([(bundle.key_pem, bundle.cert_pem)],
                                                         root_certificates=bundle.ca_pem)

    def _signatures(self) -> tuple:
        out = []
        for name in (BUNDLE_CA, BUNDLE_CERT, BUNDLE_KEY):
            try:
                st = os.stat(self.bundle_dir / name)
                out.append((st.st_mtime_ns, st.st_size, st.st_ino))
            except OSError:
                out.append(None)
        return tuple(out)

    def _fetch(self) -> grpc.ServerCertificateConfiguration | None:
        # Runs inside gRPC's handshake: it must never raise, and it returns None for "no change".
        try:
            seen = self._signatures()
            if seen in (self._loaded, self._rejected):
                return None
            with self._lock:
                if seen in (self._loaded, self._rejected):
                    return None
                try:
                    bundle = read_bundle(self.bundle_dir, "server")
                except TlsError as e:
                    self._rejected = seen
                    log.warning("hub certificate bundle changed but is not usable yet (%s); still serving the "
                                "previous certificate", e)
                    return None
                self._loaded, self._rejected = seen, None
                self.reloads += 1
                if self.on_load is not None:
                    self.on_load(bundle.cert_pem)
                return self._configuration(bundle)
        except Exception:  # a bug here must not take the listener down
            log.exception("reloading the hub certificate failed; still serving the previous certificate")
            return None


def channel_credentials(bundle: Path | Bundle) -> grpc.ChannelCredentials:
    """Silo credentials: trust only the federation CA and present the silo's client certificate. ``bundle``: its
    folder, or the bundle read_bundle(folder, "client") gave."""
    b = bundle if isinstance(bundle, Bundle) else read_bundle(bundle, "client")
    return grpc.ssl_channel_credentials(root_certificates=b.ca_pem, private_key=b.key_pem, certificate_chain=b.cert_pem)


def secure_channel(
    target: str,
    bundle: Path | Bundle,
    options: Sequence[tuple[str, Any]] = (),
    server_name: str | None = None,
) -> grpc.Channel:
    """Open an mTLS channel to the hub at ``target`` ("host:port").

    The hub certificate is checked against the host part of ``target``, which must be one of its SANs (by
    default ``localhost`` and ``127.0.0.1``). Pass ``server_name`` only when the dialed address is not in the
    SANs (e.g. through a tunnel): the certificate is then checked against that name instead.
    """
    opts = list(options)
    if server_name:
        opts.append(("grpc.ssl_target_name_override", server_name))
    return grpc.secure_channel(target, channel_credentials(bundle), options=opts)


def target_host(target: str) -> str:
    """The host part of a "host:port" or "[v6]:port" target (the whole target when it has no port)."""
    host = target.rsplit(":", 1)[0] if ":" in target else target
    return host.strip("[]")


def split_target(target: str) -> tuple[str, int]:
    """("host", port) of a "host:port" or "[v6]:port" target."""
    port = target.rpartition(":")[2]
    if ":" not in target or not port.isdigit():
        raise ValueError(f"hub address {target!r} is not host:port")
    return target_host(target), int(port)


def hub_tls_context(bundle_dir: Path) -> ssl.SSLContext:
    """A TLS client context like the silo's gRPC channel: its own certificate, the federation CA as the only trust
    anchor, the hub's name checked, ALPN h2. For :func:`hub_certificate`; build it once and reuse it."""
    ca = read_bundle(bundle_dir, "client").ca_pem
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)  # verifies the chain and the name
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.load_verify_locations(cadata=ca.decode())
    context.load_cert_chain(Path(bundle_dir) / BUNDLE_CERT, Path(bundle_dir) / BUNDLE_KEY)
    context.set_alpn_protocols(["h2"])
    return context


def hub_certificate(target: str, context: ssl.SSLContext, timeout_s: float = 10.0) -> x509.Certificate:
    """The certificate the hub at ``target`` presents, verified in a handshake of our own (``hub_tls_context``;
    the host part of ``target`` checked against its names). Lets a silo check the hub's serial against the CA's
    revocation list, which gRPC Python cannot do in its own handshake. Raises OSError (ssl.SSLError included)
    when no verified handshake happens."""
    host, port = split_target(target)
    with socket.create_connection((host, port), timeout=timeout_s) as raw:
        with context.wrap_socket(raw, server_hostname=host) as conn:
            der = conn.getpeercert(binary_form=True)
            # Under TLS 1.3 the hub judges our certificate after our side of the handshake is done: say hello as an
            # HTTP/2 client would and read its first frame, so a hub that refuses our certificate shows up here as
            # an alert (ssl.SSLError), not later as a retried UNAVAILABLE.
            conn.sendall(_H2_PREFACE)
            conn.settimeout(min(timeout_s, 5.0))
            try:
                conn.recv(9)
            except TimeoutError:
                pass  # said nothing, refused nothing: gRPC's own call will tell
    if der is None:
        raise ssl.SSLError(f"the hub at {target} presented no certificate")
    return x509.load_der_x509_certificate(der)


# HTTP/2 client connection preface and an empty SETTINGS frame: enough for a gRPC server to answer with its own.
_H2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"


def describe_tls_failure(err: ssl.SSLError, target: str) -> str | None:
    """A verification failure that will not fix itself, as one line naming the cause and the fix; None when the
    error may be transient (a reset, a timeout)."""
    if isinstance(err, ssl.SSLCertVerificationError):
        why = err.verify_message or str(err)
        if "issuer" in why or "self-signed" in why or "self signed" in why:
            fix = ("--certs holds a bundle from another CA than the hub's: ask the federation's operator for a bundle "
                   "issued by its CA")
        elif "Hostname mismatch" in why or "IP address mismatch" in why:
            fix = (f"--hub {target} names a host the hub's certificate does not list: dial one of its names, or have "
                   "the operator reissue it (`silo-certs renew hub --dns/--ip`)")
        elif "expired" in why:
            fix = "the hub's certificate has expired: its operator must renew it (`silo-certs renew hub`)"
        else:
            fix = "check that --certs and --hub belong to this federation"
        return f"the hub at {target} presents a certificate this silo cannot verify ({why}); {fix}"
    reason = (getattr(err, "reason", None) or "").upper()
    if "ALERT" in reason and any(word in reason for word in ("CERTIFICATE", "UNKNOWN_CA", "BAD_CERTIFICATE",
                                                             "ACCESS_DENIED", "DECRYPT_ERROR")):
        return (f"the hub at {target} refused this silo's certificate ({reason.lower()}): it is not from the "
                "hub's CA, has expired or is not a silo certificate; check --certs, or ask the federation's "
                "operator for a new bundle (`silo-certs renew NAME`)")
    return None


def peer_identity(context: grpc.ServicerContext) -> str | None:
    """The CN of the caller's verified client certificate (the silo id), or None without one."""
    values = context.auth_context().get(_CN_KEY) or []
    if not values:
        return None
    value = values[0]
    return value.decode() if isinstance(value, bytes) else str(value)


def peer_certificate(context: grpc.ServicerContext) -> bytes | None:
    """The caller's verified client certificate as PEM (e.g. to check its serial against the CRL), or None."""
    values = context.auth_context().get(_PEM_KEY) or []
    if not values:
        return None
    value = values[0]
    return value if isinstance(value, bytes) else str(value).encode()


# ---------------------------------------------------------------------------------------------- development mode


def is_loopback_target(target: str) -> bool:
    """True when ``target`` ("host:port") names this machine: localhost, 127.0.0.0/8 or ::1."""
    host = target_host(target)
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class _CallDetails(
    collections.namedtuple(
        "_CallDetails", ("method", "timeout", "metadata", "credentials", "wait_for_ready", "compression")
    ),
    grpc.ClientCallDetails,
):
    pass


class _DeclaredIdentity(
    grpc.UnaryUnaryClientInterceptor,
    grpc.UnaryStreamClientInterceptor,
    grpc.StreamUnaryClientInterceptor,
    grpc.StreamStreamClientInterceptor,
):
    """Adds the declared silo id to every call's metadata."""

    def __init__(self, silo_id: str):
        self.silo_id = silo_id

    def _details(self, d: grpc.ClientCallDetails) -> _CallDetails:
        metadata = [*(d.metadata or ()), (DEV_IDENTITY_KEY, self.silo_id)]
        return _CallDetails(d.method, d.timeout, metadata, d.credentials, d.wait_for_ready, d.compression)

    def intercept_unary_unary(self, continuation, client_call_details, request):
        return continuation(self._details(client_call_details), request)

    def intercept_unary_stream(self, continuation, client_call_details, request):
        return continuation(self._details(client_call_details), request)

    def intercept_stream_unary(self, continuation, client_call_details, request_iterator):
        return continuation(self._details(client_call_details), request_iterator)

    def intercept_stream_stream(self, continuation, client_call_details, request_iterator):
        return continuation(self._details(client_call_details), request_iterator)


def insecure_dev_channel(target: str, silo_id: str, options: Sequence[tuple[str, Any]] = ()) -> grpc.Channel:
    """A plaintext channel to a hub started with ``--insecure-dev-only``, declaring ``silo_id`` on every call.

    Development only: nothing is encrypted and nothing proves the id, which is why the hub offers this mode on
    127.0.0.1 only and why this refuses any other target.
    """
    if not is_loopback_target(target):
        raise TlsError(
            f"--insecure-dev-only talks to a hub on this machine only (127.0.0.1, ::1 or localhost), not {target}; "
            "use --certs with a bundle from `silo-certs issue-silo` for a real hub"
        )
    try:
        validate_silo_name(silo_id)
    except PkiError as e:
        raise TlsError(f"{e} (--silo-id)") from None
    return grpc.intercept_channel(grpc.insecure_channel(target, options=list(options)), _DeclaredIdentity(silo_id))


def declared_identity(context: grpc.ServicerContext) -> str | None:
    """The silo id a caller declared in its metadata. Meaningful ONLY on a --insecure-dev-only hub."""
    for key, value in context.invocation_metadata() or ():
        if key == DEV_IDENTITY_KEY:
            return value if isinstance(value, str) else value.decode(errors="replace")
    return None
