"""Reading a PEM certificate: its common name (a silo's id) and the days it has left."""

from __future__ import annotations

import datetime as dt

from cryptography import x509
from cryptography.x509.oid import NameOID

from security.pki import store
from security.pki.store import PkiError


def load_cert(cert_pem: bytes) -> x509.Certificate:
    try:
        return x509.load_pem_x509_certificate(cert_pem)
    except ValueError as e:
        raise PkiError(f"not a PEM certificate: {e}") from e


def cert_common_name(cert_pem: bytes) -> str:
    """The subject CN of a PEM certificate (for a silo certificate: the silo id)."""
    attrs = load_cert(cert_pem).subject.get_attributes_for_oid(NameOID.COMMON_NAME)
    if not attrs:
        raise PkiError("certificate has no common name")
    value = attrs[0].value
    return value.decode() if isinstance(value, bytes) else value


def cert_days_left(cert_pem: bytes, now: dt.datetime | None = None) -> float:
    """Days until the certificate expires (negative once expired). ``now`` defaults to the current UTC time."""
    now = now or store.utc_now()
    if now.tzinfo is None:
        now = now.replace(tzinfo=dt.UTC)  # naive datetimes are taken as UTC, like the certificate's times
    return (load_cert(cert_pem).not_valid_after_utc - now).total_seconds() / 86400.0
