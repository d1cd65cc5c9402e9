"""gRPC mutual-TLS credentials built from a bundle directory (ca.pem, cert.pem, key.pem; see security.pki).

The hub serves with ``server_credentials`` (client certificates required and verified against the federation
CA); a silo dials with ``secure_channel``. On the hub, ``peer_identity(context)`` is the only source of a
caller's identity: the CN of the client certificate that the TLS handshake verified.

Bundles are checked here before gRPC sees them (files present, key matches certificate, certificate signed by
the bundle's CA, right purpose, not expired) because gRPC reports all of those as an opaque handshake failure
on the *other* machine.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import grpc
from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.x509.oid import ExtendedKeyUsageOID

from security.pki import BUNDLE_CA, BUNDLE_CERT, BUNDLE_KEY

# auth_context() keys set by gRPC's TLS transport for a verified peer.
_CN_KEY = "x509_common_name"
_PEM_KEY = "x509_pem_cert"


class TlsError(Exception):
    """A bundle cannot be used for TLS; the message names the file and what to do."""


def _hint(role: str, bundle_dir: Path) -> str:
    if role == "server":
        return f"run `silo-certs issue-hub --ca CA_DIR --out {bundle_dir}` and copy the bundle to the hub"
    return (
        f"run `silo-certs issue-silo NAME --ca CA_DIR --out {bundle_dir}` on the CA machine "
        "and copy the bundle to this silo"
    )


def _read_bundle(bundle_dir: Path, role: str) -> tuple[bytes, bytes, bytes]:
    """Return (ca, cert, key) PEM bytes of a bundle after checking it can work for ``role`` ("server"/"client")."""
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
    return ca_pem, cert_pem, key_pem


def server_credentials(bundle_dir: Path) -> grpc.ServerCredentials:
    """Hub credentials: serve the hub certificate and require a client certificate signed by the bundle's CA."""
    ca, cert, key = _read_bundle(bundle_dir, "server")
    return grpc.ssl_server_credentials([(key, cert)], root_certificates=ca, require_client_auth=True)


def channel_credentials(bundle_dir: Path) -> grpc.ChannelCredentials:
    """Silo credentials: trust only the federation CA and present the silo's client certificate."""
    ca, cert, key = _read_bundle(bundle_dir, "client")
    return grpc.ssl_channel_credentials(root_certificates=ca, private_key=key, certificate_chain=cert)


def secure_channel(
    target: str,
    bundle_dir: Path,
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
    return grpc.secure_channel(target, channel_credentials(bundle_dir), options=opts)


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
