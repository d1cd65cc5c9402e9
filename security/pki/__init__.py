"""Federation PKI: one small CA that issues the hub's server certificate and one client certificate per silo.

Layout of a CA directory (made by :func:`init_ca`)::

    ca.pem        CA certificate (public; copied into every bundle)
    ca.key        CA private key (0600; optionally passphrase-encrypted; keep it off the hub if you can)
    crl.pem       certificate revocation list signed by the CA (empty until something is revoked)
    issued.json   inventory of every certificate issued: kind, name, serial, not_after, path, status
    issued.lock   empty; every command that changes issued.json or crl.pem holds an exclusive flock on it

Layout of a bundle directory (made by :func:`issue_hub` / :func:`issue_silo`), the unit that is copied to a
machine::

    ca.pem        the federation CA certificate (trust anchor for the peer)
    cert.pem      this machine's certificate
    key.pem       this machine's private key (0600, never encrypted: gRPC cannot read encrypted keys)
    crl.pem       a copy of the CA's revocation list: the hub checks every caller against it on every call, a
                  silo checks the hub's certificate against it before joining and before every round (replace
                  it with the CA's crl.pem after each `silo-certs revoke`; both re-read it when it changes)

All keys are ECDSA P-256 and all signatures SHA-256: small, fast, and supported by every TLS stack gRPC uses.
The inventory keeps a ``status`` per certificate and the CRL is rebuilt from it (:func:`write_crl`), so revoking
is "mark the entry revoked, rewrite the CRL" (:func:`revoke`) and renewing is "issue again under a new serial"
(:func:`renew`). A name holds at most one live certificate unless renewed on purpose: issuing again for a live
name is refused unless ``replace=True`` revokes the old one in the same step (:func:`issue_silo`).

The rooms: ``store`` (the CA directory: layout, lock, inventory, the CRL file, init_ca/load_ca), ``issuing`` (hub
and silo certificates, renew), ``revocation`` (revoke, write_crl, reading a CRL back) and ``certificates`` (reading
a PEM certificate). This module is the PKI's public face: import from ``security.pki``.
"""

from __future__ import annotations

from security.pki.certificates import cert_common_name, cert_days_left
from security.pki.issuing import (
    display_status,
    issue_hub,
    issue_silo,
    issue_silos,
    live_certificates,
    renew,
    validate_silo_name,
)
from security.pki.revocation import find_certificates, load_crl, parse_crl, revoke, write_crl
from security.pki.store import (
    BUNDLE_CA,
    BUNDLE_CERT,
    BUNDLE_CRL,
    BUNDLE_KEY,
    CA_CERT,
    CA_KEY,
    CRL,
    DEFAULT_HUB_DNS,
    DEFAULT_HUB_IPS,
    HUB_CN,
    INVENTORY,
    LOCK,
    RESERVED_SILO_NAMES,
    IssuedCert,
    PkiError,
    ca_lock,
    init_ca,
    load_ca,
    load_inventory,
)

__all__ = [
    "BUNDLE_CA", "BUNDLE_CERT", "BUNDLE_CRL", "BUNDLE_KEY", "CA_CERT", "CA_KEY", "CRL", "DEFAULT_HUB_DNS",
    "DEFAULT_HUB_IPS", "HUB_CN", "INVENTORY", "LOCK", "RESERVED_SILO_NAMES", "IssuedCert", "PkiError", "ca_lock",
    "cert_common_name", "cert_days_left", "display_status", "find_certificates", "init_ca", "issue_hub",
    "issue_silo", "issue_silos", "live_certificates", "load_ca", "load_crl", "load_inventory", "parse_crl", "renew",
    "revoke", "validate_silo_name", "write_crl",
]
