"""Who is calling, and may they? The hub asks this on every call, before a message touches anything.

With TLS (always, outside development) the only source of identity is the client certificate the handshake
verified against the federation CA; message bodies and metadata are never read for it. On top of the handshake,
every call checks what the handshake cannot or did not:

- the certificate's serial is not on the CRL (gRPC Python cannot check a CRL during the handshake, and an HTTP/2
  connection outlives any handshake-time check anyway): UNAUTHENTICATED, reason ``revoked``;
- the certificate has not expired since its connection was opened: UNAUTHENTICATED, ``expired``;
- it is a silo (clientAuth) certificate with a valid silo id as CN, not e.g. the hub's own certificate:
  UNAUTHENTICATED, ``not_silo_certificate``;
- the silo id is on the hub's allowlist when hub.yaml sets ``security.allowed_silos``: PERMISSION_DENIED,
  ``not_allowed``.

In ``--insecure-dev-only`` mode there is no certificate: the caller's *declared* id (call metadata, see
security.tls.insecure_dev_channel) is taken at its word. That is only acceptable because that mode listens on
127.0.0.1 alone and says so loudly; nothing in TLS mode ever reads that metadata.
"""

from __future__ import annotations

import datetime as dt
import functools
from collections.abc import Iterable
from dataclasses import dataclass

import grpc
from cryptography import x509
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from security.crl import RevocationList
from security.pki import PkiError, validate_silo_name
from security.tls import declared_identity, peer_certificate, peer_identity


class AccessDenied(Exception):
    """A caller the hub will not serve. ``code`` is a gRPC status name, ``reason`` a low-cardinality label."""

    def __init__(self, code: str, reason: str, message: str, silo_id: str | None = None, serial: int | None = None):
        super().__init__(message)
        self.code, self.reason, self.message, self.silo_id = code, reason, message, silo_id
        self.serial = serial  # of the refused certificate, where the refusal is about that one certificate


@dataclass(frozen=True)
class Peer:
    silo_id: str
    serial: int | None = None  # None in --insecure-dev-only mode
    not_after: dt.datetime | None = None


@dataclass(frozen=True)
class _CertFacts:
    cn: str | None
    serial: int
    not_after: dt.datetime
    client_auth: bool


@functools.lru_cache(maxsize=4096)
def _facts(pem: bytes) -> _CertFacts:
    """Parse once per distinct certificate (every call of a connection presents the same bytes)."""
    cert = x509.load_pem_x509_certificate(pem)
    cns = cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
    cn = cns[0].value if cns else None
    try:
        eku = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
        client_auth = ExtendedKeyUsageOID.CLIENT_AUTH in eku
    except x509.ExtensionNotFound:
        client_auth = False  # silokit issues every silo certificate with clientAuth; anything else is not ours
    return _CertFacts(cn if isinstance(cn, str) else None, cert.serial_number, cert.not_valid_after_utc, client_auth)


class PeerGate:
    def __init__(
        self,
        *,
        revocations: RevocationList | None = None,
        allowed_silos: Iterable[str] | None = None,
        insecure_dev: bool = False,
    ):
        self.revocations = revocations
        self.allowed = frozenset(allowed_silos) if allowed_silos is not None else None
        self.insecure_dev = insecure_dev

    def admit(self, context: grpc.ServicerContext) -> Peer:
        """The caller's identity, or AccessDenied saying why not."""
        peer = self._declared(context) if self.insecure_dev else self._certified(context)
        if self.allowed is not None and peer.silo_id not in self.allowed:
            raise AccessDenied(
                "PERMISSION_DENIED", "not_allowed",
                f"silo {peer.silo_id} is not on this hub's allowlist (security.allowed_silos); ask the hub's "
                "operator to add it", peer.silo_id,
            )
        return peer

    def _declared(self, context: grpc.ServicerContext) -> Peer:
        silo_id = declared_identity(context)
        try:
            validate_silo_name(silo_id or "")
        except PkiError:
            raise AccessDenied(
                "UNAUTHENTICATED", "no_identity",
                "this hub runs with --insecure-dev-only: declare a silo id with silo-client --insecure-dev-only "
                "--silo-id NAME",
            ) from None
        return Peer(silo_id)

    def _certified(self, context: grpc.ServicerContext) -> Peer:
        cn, pem = peer_identity(context), peer_certificate(context)
        if not cn or not pem:
            raise AccessDenied("UNAUTHENTICATED", "no_identity",
                               "a client certificate issued by the federation CA is required")
        try:
            facts = _facts(pem)
        except ValueError:
            raise AccessDenied("UNAUTHENTICATED", "not_silo_certificate",
                               "the client certificate cannot be parsed", cn) from None
        try:
            validate_silo_name(cn)
            ok = facts.client_auth and facts.cn == cn
        except PkiError:
            ok = False
        if not ok:
            raise AccessDenied(
                "UNAUTHENTICATED", "not_silo_certificate",
                "the client certificate is not a silo certificate (issue one with `silo-certs issue-silo NAME`)", cn,
            )
        if self.revocations is not None and self.revocations.is_revoked(facts.serial):
            raise AccessDenied(
                "UNAUTHENTICATED", "revoked",
                f"the certificate of silo {cn} (serial {facts.serial:x}) has been revoked; ask the federation "
                "operator for a new one", cn, facts.serial,
            )
        if facts.not_after <= dt.datetime.now(dt.UTC):
            raise AccessDenied(
                "UNAUTHENTICATED", "expired",
                f"the certificate of silo {cn} expired on {facts.not_after:%Y-%m-%d %H:%M} UTC; ask the federation "
                f"operator to renew it (`silo-certs renew {cn}`)", cn,
            )
        return Peer(cn, facts.serial, facts.not_after)
