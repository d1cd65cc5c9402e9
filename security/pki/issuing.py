"""Issuing leaf certificates: the hub's server certificate, each silo's client certificate (one or a thousand at
once), renewing an identity, and what `silo-certs list` shows. A name holds at most one live certificate unless
renewed on purpose."""

from __future__ import annotations

import datetime as dt
import ipaddress
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from security.pki import store
from security.pki.revocation import revoke, revoke_entries
from security.pki.store import (
    BUNDLE_CA,
    BUNDLE_CERT,
    BUNDLE_CRL,
    BUNDLE_KEY,
    CA_CERT,
    CRL,
    DEFAULT_HUB_DNS,
    DEFAULT_HUB_IPS,
    HUB_CN,
    INVENTORY,
    RESERVED_SILO_NAMES,
    IssuedCert,
    PkiError,
)

_SILO_NAME_RE = re.compile(r"[A-Za-z0-9._-]{1,64}")


def issue_hub(
    ca_dir: Path,
    out_dir: Path,
    dns: list[str] | None = None,
    ips: list[str] | None = None,
    days: int = 90,
    passphrase: bytes | None = None,
    *,
    not_before: dt.datetime | None = None,
    replace: bool = False,
) -> Path:
    """Issue the hub's server certificate into the bundle ``out_dir`` and return ``out_dir``.

    SANs are the given DNS names and IP addresses; with neither, ``localhost`` and ``127.0.0.1``. Silos verify
    the hub against these SANs, so list every name or address the silos dial.
    ``passphrase`` unlocks the CA key. The bundle also gets a copy of the CA's current crl.pem.
    ``not_before`` (default: now) starts the validity elsewhere, e.g. in the past to test expiry handling.
    While the hub holds a live certificate this is refused, as for a silo (see :func:`issue_silo`):
    :func:`renew` keeps the identity, ``replace=True`` revokes the old one first.
    """
    mode: _OnLive = "revoke" if replace else "refuse"
    return _issue_bundle(
        ca_dir, out_dir, "hub", HUB_CN, _hub_sans(dns, ips), ExtendedKeyUsageOID.SERVER_AUTH, days, passphrase,
        not_before, mode,
    )


def _hub_sans(dns: list[str] | None, ips: list[str] | None) -> list[x509.GeneralName]:
    dns = list(dns or [])
    ips = list(ips or [])
    if not dns and not ips:
        dns, ips = list(DEFAULT_HUB_DNS), list(DEFAULT_HUB_IPS)
    sans: list[x509.GeneralName] = []
    for d in dns:
        if not d or any(c.isspace() for c in d) or "/" in d:
            raise PkiError(f"invalid DNS name {d!r} for the hub certificate")
        try:
            ipaddress.ip_address(d)
        except ValueError:
            sans.append(x509.DNSName(d))
        else:  # a silo dialling an address checks it against IP entries only: as a DNS name it would never match
            raise PkiError(f"{d} is an IP address, not a DNS name: pass it with --ip {d}")
    for ip in ips:
        try:
            sans.append(x509.IPAddress(ipaddress.ip_address(ip)))
        except ValueError as e:
            raise PkiError(f"invalid IP address {ip!r} for the hub certificate") from e
    return sans


def issue_silo(
    ca_dir: Path,
    name: str,
    out_dir: Path,
    days: int = 90,
    passphrase: bytes | None = None,
    *,
    not_before: dt.datetime | None = None,
    replace: bool = False,
) -> Path:
    """Issue the client certificate of silo ``name`` (its identity: CN = name) into the bundle ``out_dir``.

    ``passphrase`` unlocks the CA key; ``not_before`` as for :func:`issue_hub`.
    A name that holds a live certificate (neither revoked nor expired) is refused with a PkiError that names
    both ways out, and nothing is written: a silent second certificate would leave the old one valid, and the
    operator believing it replaced. :func:`renew` gives the identity a fresh certificate on purpose;
    ``replace=True`` revokes every live certificate of the name, re-signs crl.pem and issues, in one step.
    """
    validate_silo_name(name)
    mode: _OnLive = "revoke" if replace else "refuse"
    return _issue_bundle(
        ca_dir, out_dir, "silo", name, [x509.DNSName(name)], ExtendedKeyUsageOID.CLIENT_AUTH, days, passphrase,
        not_before, mode,
    )


def validate_silo_name(name: str) -> None:
    """Raise PkiError unless ``name`` is a usable silo id."""
    if not _SILO_NAME_RE.fullmatch(name or "") or name.startswith("."):
        raise PkiError(
            f"invalid silo name {name!r}: use 1-64 characters from A-Z a-z 0-9 . _ - (not starting with '.')"
        )
    if name in RESERVED_SILO_NAMES:
        raise PkiError(f"invalid silo name {name!r}: it is reserved for the hub's own certificate; pick another")


# What issuing does when the name already holds a live certificate: refuse (issue-hub, issue-silo), revoke it
# in the same step (--replace) or keep it valid beside the new one (renew: the rollover overlap).
_OnLive = Literal["refuse", "revoke", "keep"]


def _issue_bundle(
    ca_dir: Path,
    out_dir: Path,
    kind: str,
    cn: str,
    sans: list[x509.GeneralName],
    eku: x509.ObjectIdentifier,
    days: int,
    passphrase: bytes | None,
    not_before: dt.datetime | None,
    on_live: _OnLive,
) -> Path:
    return _issue_bundles(ca_dir, [_Request(out_dir, kind, cn, sans, eku)], days, passphrase, not_before, on_live)[0]


@dataclass(frozen=True)
class _Request:
    out_dir: Path
    kind: str
    cn: str
    sans: list[x509.GeneralName]
    eku: x509.ObjectIdentifier


def issue_silos(ca_dir: Path, bundles: list[tuple[str, Path]], days: int = 90,
                passphrase: bytes | None = None) -> list[Path]:
    """Issue many silos' certificates (name, bundle folder) as :func:`issue_silo` would one by one, under one lock
    with one read and one write of the inventory: a thousand simulated silos take seconds, not minutes."""
    for name, _ in bundles:
        validate_silo_name(name)
    requests = [_Request(Path(out), "silo", name, [x509.DNSName(name)], ExtendedKeyUsageOID.CLIENT_AUTH)
                for name, out in bundles]
    return _issue_bundles(ca_dir, requests, days, passphrase, None, "refuse")


def _issue_bundles(
    ca_dir: Path,
    requests: list[_Request],
    days: int,
    passphrase: bytes | None,
    not_before: dt.datetime | None,
    on_live: _OnLive,
) -> list[Path]:
    ca_dir = Path(ca_dir)
    store.check_days(days)
    issued: list[Path] = []
    with store.ca_lock(ca_dir):  # from reading the inventory to writing it: no concurrent issue can be lost
        now = store.utc_now()
        # Backdated a little by default (clock skew); an explicit not_before is taken as is and counts the days.
        valid_from = now - store.CLOCK_SKEW if not_before is None else not_before
        not_after = (now if not_before is None else not_before) + dt.timedelta(days=days)

        entries = store.load_inventory(ca_dir)
        ca: tuple[x509.Certificate, ec.EllipticCurvePrivateKey] | None = None
        try:
            for request in requests:
                out_dir, kind, cn = Path(request.out_dir), request.kind, request.cn
                live = _live(entries, cn, now)
                # A certificate born expired (not_before far in the past, to test expiry handling) adds no second
                # live identity, so only a live new one is refused.
                if live and on_live == "refuse" and not_after > now:
                    raise PkiError(_live_conflict(ca_dir, out_dir, kind, cn, live))
                # Check the destination before unlocking the CA, so a typo costs nothing.
                store.refuse_existing(out_dir / f for f in (BUNDLE_KEY, BUNDLE_CERT, BUNDLE_CA, BUNDLE_CRL))
                if ca is None:
                    ca = store.load_ca(ca_dir, passphrase)
                ca_cert, ca_key = ca
                if not_after > ca_cert.not_valid_after_utc:
                    # A leaf that outlives its CA would fail verification on the day the CA expires anyway.
                    raise PkiError(
                        f"the certificate would outlive the CA (CA expires {ca_cert.not_valid_after_utc:%Y-%m-%d}); "
                        "use fewer --days or a new CA"
                    )
                key, cert = _sign_leaf(ca_cert, ca_key, cn, request.sans, request.eku, valid_from, not_after)

                out_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
                store.write_new(out_dir / BUNDLE_KEY, store.key_pem(key), mode=0o600)
                store.write_new(out_dir / BUNDLE_CERT, cert.public_bytes(serialization.Encoding.PEM))
                shutil.copyfile(ca_dir / CA_CERT, out_dir / BUNDLE_CA)
                if live and on_live == "revoke":
                    # After the bundle (the step most likely to fail) and before the copy below, so the new bundle
                    # already carries the list that refuses the certificates it replaces.
                    revoke_entries(ca_dir, ca_cert, ca_key, entries, {e.serial for e in live})
                # The hub checks every caller against this copy, a silo the hub; `silo-certs revoke` says when to
                # replace it.
                shutil.copyfile(ca_dir / CRL, out_dir / BUNDLE_CRL)

                entries.append(
                    IssuedCert(
                        kind=kind,
                        name=cn,
                        serial=format(cert.serial_number, "x"),
                        not_after=cert.not_valid_after_utc.isoformat(),
                        path=str(out_dir.resolve()),
                    )
                )
                issued.append(out_dir)
        finally:
            if issued:  # what was issued before a failure stays in the inventory (a revocation target)
                store.save_inventory(ca_dir, entries)
    return issued


def _sign_leaf(
    ca_cert: x509.Certificate,
    ca_key: ec.EllipticCurvePrivateKey,
    cn: str,
    sans: list[x509.GeneralName],
    eku: x509.ObjectIdentifier,
    valid_from: dt.datetime,
    not_after: dt.datetime,
) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    """A new key and its leaf certificate signed by the CA."""
    key = store.new_key()
    ca_ski = ca_cert.extensions.get_extension_for_class(x509.SubjectKeyIdentifier).value
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)]))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(valid_from)
        .not_valid_after(not_after)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,  # ECDHE + ECDSA: the key only ever signs the handshake
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=False,
                crl_sign=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.ExtendedKeyUsage([eku]), critical=False)
        .add_extension(x509.SubjectAlternativeName(sans), critical=False)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(ca_ski), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    return key, cert


def _live(entries: list[IssuedCert], name: str, now: dt.datetime) -> list[IssuedCert]:
    """The certificates of ``name`` that a peer would still accept: not revoked and not expired."""
    return [
        e for e in entries
        if e.name == name and e.status != "revoked" and dt.datetime.fromisoformat(e.not_after) > now
    ]


def live_certificates(ca_dir: Path, name: str) -> list[IssuedCert]:
    """Inventory entries of ``name`` that are neither revoked nor expired (what ``replace=True`` revokes)."""
    return _live(store.load_inventory(ca_dir), name, store.utc_now())


def _live_conflict(ca_dir: Path, out_dir: Path, kind: str, cn: str, live: list[IssuedCert]) -> str:
    serials = ", ".join(e.serial for e in live)
    expires = max(dt.datetime.fromisoformat(e.not_after) for e in live)
    who = "the hub" if kind == "hub" else f"silo {cn!r}"
    # A folder without a key: the live bundle's own (the default --out) holds one, which is never overwritten.
    fresh = f"{out_dir}.new" if (Path(out_dir) / "key.pem").exists() else str(out_dir)
    again = (
        f"silo-certs issue-hub --ca {ca_dir} --out {fresh} --replace"
        if kind == "hub"
        else f"silo-certs issue-silo {cn} --ca {ca_dir} --out {fresh} --replace"
    )
    return (
        f"{who} already holds a live certificate (serial {serials}, valid until {expires:%Y-%m-%d}); "
        f"to keep the identity with a new certificate run `silo-certs renew {cn} --ca {ca_dir}`, "
        f"or to revoke the old one and issue anew run `{again}`"
    )


def renew(
    ca_dir: Path,
    name: str,
    out_dir: Path | None = None,
    days: int = 90,
    passphrase: bytes | None = None,
    dns: list[str] | None = None,
    ips: list[str] | None = None,
    revoke_old: bool = False,
) -> Path:
    """Issue a fresh certificate (new key, new serial) for the identity ``name`` and return its bundle directory.

    The kind (hub or silo) comes from the newest certificate of that name. A hub keeps the SANs of its newest
    certificate unless ``dns``/``ips`` are given. The old certificates stay valid until they expire, so the
    new bundle can be rolled out without downtime, unless ``revoke_old`` revokes them once the new one exists.
    ``out_dir`` defaults to ``NAME.renewed-YYYY-MM-DD`` beside the newest bundle; nothing is ever overwritten.
    """
    ca_dir = Path(ca_dir)
    with store.ca_lock(ca_dir):  # one step: the previous certificates read here are the ones revoke_old revokes
        previous = [e for e in store.load_inventory(ca_dir) if e.name == name]
        if not previous:
            issue = (f"silo-certs issue-hub --ca {ca_dir} --out HUB_DIR" if name == HUB_CN
                     else f"silo-certs issue-silo {name} --ca {ca_dir}")
            raise PkiError(
                f"no certificate named {name!r} in {ca_dir / INVENTORY}; issue one with "
                f"`{issue}` (see `silo-certs list --ca {ca_dir}`)"
            )
        latest = previous[-1]
        if out_dir is None:
            out_dir = Path(latest.path).parent / f"{name}.renewed-{store.utc_now():%Y-%m-%d}"
            if out_dir.exists():
                raise PkiError(
                    f"{out_dir} already exists (renewed today already?); choose a directory with --out"
                )
        # "keep": the old certificate stays valid beside the new one until the new bundle is rolled out.
        if latest.kind == "hub":
            if not dns and not ips:
                dns, ips = _sans_of(Path(latest.path) / BUNDLE_CERT, latest.serial)
            out = _issue_bundle(
                ca_dir, out_dir, "hub", HUB_CN, _hub_sans(dns, ips), ExtendedKeyUsageOID.SERVER_AUTH, days,
                passphrase, None, "keep",
            )
        else:
            if dns or ips:
                raise PkiError("--dns/--ip apply to the hub's certificate only; a silo is named by its CN")
            out = _issue_bundle(
                ca_dir, out_dir, "silo", name, [x509.DNSName(name)], ExtendedKeyUsageOID.CLIENT_AUTH, days,
                passphrase, None, "keep",
            )
        if revoke_old:
            for e in previous:
                if e.status != "revoked":
                    revoke(ca_dir, e.serial, passphrase)
            if latest.kind == "hub":  # the new bundle's CRL copy predates these revocations
                store.write_atomic(out / BUNDLE_CRL, (ca_dir / CRL).read_bytes())
        return out


def _sans_of(cert_path: Path, serial: str) -> tuple[list[str], list[str]]:
    """The DNS and IP SANs of the hub certificate at ``cert_path`` (it must be the one with ``serial``)."""
    hint = "give the hub's names again with --dns/--ip"
    try:
        cert = x509.load_pem_x509_certificate(cert_path.read_bytes())
    except (OSError, ValueError) as e:
        raise PkiError(f"cannot read the previous hub certificate {cert_path} to copy its names; {hint}") from e
    if format(cert.serial_number, "x") != serial:
        raise PkiError(f"{cert_path} is not the certificate the inventory lists (serial {serial}); {hint}")
    try:
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        raise PkiError(f"{cert_path} has no subject alternative names; {hint}") from None
    return list(san.get_values_for_type(x509.DNSName)), [str(a) for a in san.get_values_for_type(x509.IPAddress)]


def display_status(entry: IssuedCert, entries: list[IssuedCert], now: dt.datetime | None = None) -> str:
    """What `silo-certs list` shows: revoked, expired, superseded (a newer one of the same name exists) or valid."""
    if entry.status == "revoked":
        return "revoked"
    if dt.datetime.fromisoformat(entry.not_after) <= (now or store.utc_now()):
        return "expired"
    later = entries[entries.index(entry) + 1 :]
    if any(e.name == entry.name and e.kind == entry.kind for e in later):
        return "superseded"  # still accepted until it expires or is revoked
    return "valid"
