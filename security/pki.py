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
"""

from __future__ import annotations

import datetime as dt
import fcntl
import ipaddress
import json
import os
import re
import shutil
import tempfile
import threading
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Literal

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

CA_CERT = "ca.pem"
CA_KEY = "ca.key"
CRL = "crl.pem"
INVENTORY = "issued.json"
LOCK = "issued.lock"
BUNDLE_CA = "ca.pem"
BUNDLE_CERT = "cert.pem"
BUNDLE_KEY = "key.pem"
BUNDLE_CRL = "crl.pem"

HUB_CN = "hub"
DEFAULT_HUB_DNS = ("localhost",)
DEFAULT_HUB_IPS = ("127.0.0.1",)

# "hub" is the hub's CN; a silo of that name would be ambiguous in logs, metrics and `silo-certs revoke hub`.
RESERVED_SILO_NAMES = frozenset({HUB_CN})
# Silo names become a certificate CN, a DNS SAN and a directory name, so keep them to a boring, portable set.
_SILO_NAME_RE = re.compile(r"[A-Za-z0-9._-]{1,64}")
# Backdate notBefore a little so a peer whose clock runs slightly behind does not reject a fresh certificate.
_CLOCK_SKEW = dt.timedelta(minutes=5)
# The CRL is re-signed whenever the inventory changes; nextUpdate only tells verifiers how stale it may get.
_CRL_VALIDITY = dt.timedelta(days=30)


class PkiError(Exception):
    """A PKI operation failed for a reason the user can fix; the message says what to do."""


@dataclass
class IssuedCert:
    """One row of ``issued.json``."""

    kind: str  # "hub" or "silo"
    name: str  # CN
    serial: str  # hex, lower case, no 0x
    not_after: str  # ISO 8601, UTC
    path: str  # bundle directory, absolute
    status: str = "valid"  # "valid" or "revoked" (`silo-certs revoke`); expiry is computed, never stored
    revoked_at: str | None = None


# --------------------------------------------------------------------------------------------------------------
# small file helpers


def _now() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


def _write_new(path: Path, data: bytes, mode: int = 0o644) -> None:
    """Create ``path`` with ``mode``; fail if it exists (O_EXCL), so a key is never silently replaced.

    The mode is given to open() rather than chmod-ed afterwards so a private key is never readable by others,
    not even for an instant.
    """
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    except FileExistsError:
        raise PkiError(
            f"{path} already exists; refusing to overwrite it (use a new directory or delete it first)"
        ) from None
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    # umask may have removed bits we asked for (never added any): make the mode exact.
    os.chmod(path, mode)


def _write_atomic(path: Path, data: bytes) -> None:
    """Replace ``path`` atomically so a crash never leaves a half-written inventory or CRL."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _refuse_existing(paths: Iterable[Path]) -> None:
    for p in paths:
        if p.exists():
            raise PkiError(
                f"{p} already exists; refusing to overwrite it (use a new directory or delete it first)"
            )


def _check_days(days: int) -> None:
    if days < 1:
        raise PkiError(f"validity must be at least 1 day, got {days}")


def _new_key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _key_pem(key: ec.EllipticCurvePrivateKey, passphrase: bytes | None = None) -> bytes:
    encryption: serialization.KeySerializationEncryption = (
        serialization.BestAvailableEncryption(passphrase) if passphrase else serialization.NoEncryption()
    )
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, encryption)


# --------------------------------------------------------------------------------------------------------------
# the CA directory's lock

# Lock depth per CA directory, per thread: a locked operation may call another (renew -> issue and revoke, the CLI
# around issue), and flock would deadlock on a second open of the same file by the same holder.
_held = threading.local()


@contextmanager
def ca_lock(ca_dir: Path) -> Iterator[None]:
    """Hold the CA directory's exclusive lock for the block (re-entrant within a thread).

    Every read-modify-write of issued.json and crl.pem runs under it, from the first read to the last write, so
    two `silo-certs` runs at once never lose an inventory entry (a revocation target) or a revocation. An OS
    lock (flock on ``issued.lock``) rather than a lock file that is created and deleted: the kernel releases it
    when the process dies, so a crash never leaves the CA locked.
    """
    ca_dir = Path(ca_dir)
    if not (ca_dir / CA_CERT).is_file():  # never drop a lock file into a directory that is not a CA
        raise PkiError(
            f"{ca_dir / CA_CERT} not found; is {ca_dir} a CA directory? (create one with `silo-certs init --dir DIR`)"
        )
    key = str(ca_dir.resolve())
    depth: dict[str, int] = _held.__dict__.setdefault("depth", {})
    if depth.get(key):
        depth[key] += 1
        try:
            yield
        finally:
            depth[key] -= 1
        return
    fd = os.open(ca_dir / LOCK, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # waits for any other holder; released by close (or the process's death)
        depth[key] = 1
        try:
            yield
        finally:
            depth[key] = 0
    finally:
        os.close(fd)


# --------------------------------------------------------------------------------------------------------------
# CA


def init_ca(
    out_dir: Path, name: str = "silokit CA", days: int = 3650, passphrase: bytes | None = None
) -> Path:
    """Create the federation CA in ``out_dir`` and return ``out_dir``.

    Writes ca.pem, ca.key (0600, encrypted when ``passphrase`` is given), an empty signed crl.pem and an empty
    issued.json. Refuses to touch a directory that already holds any of them.
    """
    out_dir = Path(out_dir)
    _check_days(days)
    if not name.strip():
        raise PkiError("the CA name must not be empty")
    _refuse_existing(out_dir / f for f in (CA_KEY, CA_CERT, CRL, INVENTORY))
    out_dir.mkdir(parents=True, exist_ok=True, mode=0o700)  # only the CA admin needs to look inside

    key = _new_key()
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = _now()
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - _CLOCK_SKEW)
        .not_valid_after(now + dt.timedelta(days=days))
        # path_length=0: this CA signs leaf certificates only, never another CA.
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=False,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )

    # Key first: if anything fails after it, the directory is clearly "taken" and nothing is half-overwritten.
    _write_new(out_dir / CA_KEY, _key_pem(key, passphrase), mode=0o600)
    _write_new(out_dir / CA_CERT, cert.public_bytes(serialization.Encoding.PEM))
    _write_crl_file(out_dir, cert, key, revoked=[])
    _save_inventory(out_dir, [])
    return out_dir


def load_ca(
    ca_dir: Path, passphrase: bytes | None = None
) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    """Load the CA certificate and key from ``ca_dir``; every failure becomes a PkiError that says what to do."""
    ca_dir = Path(ca_dir)
    cert_path, key_path = ca_dir / CA_CERT, ca_dir / CA_KEY
    for p in (cert_path, key_path):
        if not p.is_file():
            raise PkiError(
                f"{p} not found; is {ca_dir} a CA directory? (create one with `silo-certs init --dir DIR`)"
            )
    try:
        cert = x509.load_pem_x509_certificate(cert_path.read_bytes())
    except ValueError as e:
        raise PkiError(f"{cert_path} is not a PEM certificate: {e}") from e
    key_bytes = key_path.read_bytes()
    try:
        key = serialization.load_pem_private_key(key_bytes, password=passphrase or None)
    except TypeError as e:
        # cryptography raises TypeError both for "encrypted but no password" and "password but not encrypted".
        if passphrase:
            raise PkiError(f"{key_path} is not encrypted; run again without a passphrase") from e
        raise PkiError(f"{key_path} is encrypted; give its passphrase (--passphrase-file FILE)") from e
    except ValueError as e:
        if passphrase:
            raise PkiError(f"cannot decrypt {key_path}: wrong passphrase?") from e
        raise PkiError(f"{key_path} is not a PEM private key: {e}") from e
    if not isinstance(key, ec.EllipticCurvePrivateKey) or key.public_key() != cert.public_key():
        raise PkiError(f"{key_path} does not belong to {cert_path}; the CA directory is inconsistent")
    return cert, key


# --------------------------------------------------------------------------------------------------------------
# leaf certificates


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
        sans.append(x509.DNSName(d))
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
    _check_days(days)
    issued: list[Path] = []
    with ca_lock(ca_dir):  # from reading the inventory to writing it: no concurrent issue can be lost
        now = _now()
        # Backdated a little by default (clock skew); an explicit not_before is taken as is and counts the days.
        valid_from = now - _CLOCK_SKEW if not_before is None else not_before
        not_after = (now if not_before is None else not_before) + dt.timedelta(days=days)

        entries = load_inventory(ca_dir)
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
                _refuse_existing(out_dir / f for f in (BUNDLE_KEY, BUNDLE_CERT, BUNDLE_CA, BUNDLE_CRL))
                if ca is None:
                    ca = load_ca(ca_dir, passphrase)
                ca_cert, ca_key = ca
                if not_after > ca_cert.not_valid_after_utc:
                    # A leaf that outlives its CA would fail verification on the day the CA expires anyway.
                    raise PkiError(
                        f"the certificate would outlive the CA (CA expires {ca_cert.not_valid_after_utc:%Y-%m-%d}); "
                        "use fewer --days or a new CA"
                    )
                key, cert = _sign_leaf(ca_cert, ca_key, cn, request.sans, request.eku, valid_from, not_after)

                out_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
                _write_new(out_dir / BUNDLE_KEY, _key_pem(key), mode=0o600)
                _write_new(out_dir / BUNDLE_CERT, cert.public_bytes(serialization.Encoding.PEM))
                shutil.copyfile(ca_dir / CA_CERT, out_dir / BUNDLE_CA)
                if live and on_live == "revoke":
                    # After the bundle (the step most likely to fail) and before the copy below, so the new bundle
                    # already carries the list that refuses the certificates it replaces.
                    _revoke_entries(ca_dir, ca_cert, ca_key, entries, {e.serial for e in live})
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
                _save_inventory(ca_dir, entries)
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
    key = _new_key()
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
    return _live(load_inventory(ca_dir), name, _now())


def _live_conflict(ca_dir: Path, out_dir: Path, kind: str, cn: str, live: list[IssuedCert]) -> str:
    serials = ", ".join(e.serial for e in live)
    expires = max(dt.datetime.fromisoformat(e.not_after) for e in live)
    who = "the hub" if kind == "hub" else f"silo {cn!r}"
    again = (
        f"silo-certs issue-hub --ca {ca_dir} --out {out_dir} --replace"
        if kind == "hub"
        else f"silo-certs issue-silo {cn} --ca {ca_dir} --replace"
    )
    return (
        f"{who} already holds a live certificate (serial {serials}, valid until {expires:%Y-%m-%d}); "
        f"to keep the identity with a new certificate run `silo-certs renew {cn} --ca {ca_dir}`, "
        f"or to revoke the old one and issue anew run `{again}`"
    )


# --------------------------------------------------------------------------------------------------------------
# inventory and CRL


def load_inventory(ca_dir: Path) -> list[IssuedCert]:
    """Read ``issued.json`` of ``ca_dir``."""
    path = Path(ca_dir) / INVENTORY
    if not path.is_file():
        raise PkiError(
            f"{path} not found; is {ca_dir} a CA directory? (create one with `silo-certs init --dir DIR`)"
        )
    try:
        rows = json.loads(path.read_text())
        return [IssuedCert(**row) for row in rows]
    except (ValueError, TypeError) as e:
        raise PkiError(f"{path} is corrupt ({e}); restore it from a backup") from e


def _save_inventory(ca_dir: Path, entries: list[IssuedCert]) -> None:
    data = json.dumps([asdict(e) for e in entries], indent=2) + "\n"
    _write_atomic(Path(ca_dir) / INVENTORY, data.encode())


def write_crl(ca_dir: Path, passphrase: bytes | None = None) -> Path:
    """Re-sign ``crl.pem`` from the inventory: every entry with status "revoked" is listed.

    Also the way to refresh the CRL before its nextUpdate passes (`silo-certs crl`).
    """
    ca_dir = Path(ca_dir)
    with ca_lock(ca_dir):  # a concurrent revoke must not be undone by re-signing an older inventory
        ca_cert, ca_key = load_ca(ca_dir, passphrase)
        return _write_crl_file(ca_dir, ca_cert, ca_key, _revoked_of(load_inventory(ca_dir)))


def _revoked_of(entries: list[IssuedCert]) -> list[tuple[int, dt.datetime]]:
    return [
        (int(e.serial, 16), dt.datetime.fromisoformat(e.revoked_at) if e.revoked_at else _now())
        for e in entries
        if e.status == "revoked"
    ]


def _normalise_serial(text: str) -> str | None:
    """'0x3F:a2...' -> '3fa2...' (openssl prints serials with colons); None if ``text`` is not hex."""
    t = text.strip().lower().replace(":", "")
    t = t[2:] if t.startswith("0x") else t
    if not t or any(c not in "0123456789abcdef" for c in t):
        return None
    return t.lstrip("0") or "0"  # the inventory writes serials without leading zeros


def find_certificates(ca_dir: Path, target: str) -> list[IssuedCert]:
    """Inventory entries that ``target`` names: a serial (or a unique prefix of 8+ hex digits) or a CN.

    A serial selects exactly one certificate; a name selects every certificate ever issued under it.
    """
    entries = load_inventory(ca_dir)
    serial = _normalise_serial(target)
    if serial is not None:
        exact = [e for e in entries if e.serial == serial]
        if exact:
            return exact
        if len(serial) >= 8:
            prefixed = [e for e in entries if e.serial.startswith(serial)]
            if len(prefixed) == 1:
                return prefixed
            if len(prefixed) > 1:
                raise PkiError(f"serial prefix {target!r} matches {len(prefixed)} certificates; give more digits")
    named = [e for e in entries if e.name == target]
    if not named:
        raise PkiError(
            f"no certificate named {target!r} or with that serial in {Path(ca_dir) / INVENTORY}; "
            f"see `silo-certs list --ca {ca_dir}`"
        )
    return named


def revoke(ca_dir: Path, target: str, passphrase: bytes | None = None) -> list[IssuedCert]:
    """Revoke the certificate(s) ``target`` names (see :func:`find_certificates`) and re-sign crl.pem.

    Returns the entries revoked now. Revoking a name revokes every certificate of that identity that is not
    revoked yet (a stolen key makes all of them suspect). Raises PkiError when there is nothing left to revoke.
    """
    ca_dir = Path(ca_dir)
    with ca_lock(ca_dir):
        matches = find_certificates(ca_dir, target)
        fresh = [e for e in matches if e.status != "revoked"]
        if not fresh:
            serials = ", ".join(e.serial for e in matches)
            raise PkiError(f"{target!r} is already revoked (serial {serials}); nothing to do")
        # Unlock the CA before changing anything, so a wrong passphrase leaves the inventory as it was.
        ca_cert, ca_key = load_ca(ca_dir, passphrase)
        entries = load_inventory(ca_dir)
        chosen = {e.serial for e in fresh}
        _revoke_entries(ca_dir, ca_cert, ca_key, entries, chosen)
        _save_inventory(ca_dir, entries)
        return [e for e in entries if e.serial in chosen]


def _revoke_entries(
    ca_dir: Path,
    ca_cert: x509.Certificate,
    ca_key: ec.EllipticCurvePrivateKey,
    entries: list[IssuedCert],
    serials: set[str],
) -> None:
    """Mark ``serials`` revoked in ``entries`` and re-sign crl.pem; the caller saves the inventory next.

    The CRL first: it is what the hub enforces. Should saving the inventory fail afterwards, revoking again finds
    the entry still valid and simply re-signs the same list.
    """
    when = _now().isoformat()
    for e in entries:
        if e.serial in serials:
            e.status, e.revoked_at = "revoked", when
    _write_crl_file(ca_dir, ca_cert, ca_key, _revoked_of(entries))


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
    with ca_lock(ca_dir):  # one step: the previous certificates read here are the ones revoke_old revokes
        previous = [e for e in load_inventory(ca_dir) if e.name == name]
        if not previous:
            raise PkiError(
                f"no certificate named {name!r} in {ca_dir / INVENTORY}; issue one with "
                f"`silo-certs issue-silo {name} --ca {ca_dir}` (see `silo-certs list --ca {ca_dir}`)"
            )
        latest = previous[-1]
        if out_dir is None:
            out_dir = Path(latest.path).parent / f"{name}.renewed-{_now():%Y-%m-%d}"
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
                _write_atomic(out / BUNDLE_CRL, (ca_dir / CRL).read_bytes())
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
    if dt.datetime.fromisoformat(entry.not_after) <= (now or _now()):
        return "expired"
    later = entries[entries.index(entry) + 1 :]
    if any(e.name == entry.name and e.kind == entry.kind for e in later):
        return "superseded"  # still accepted until it expires or is revoked
    return "valid"


def _write_crl_file(
    ca_dir: Path,
    ca_cert: x509.Certificate,
    ca_key: ec.EllipticCurvePrivateKey,
    revoked: list[tuple[int, dt.datetime]],
) -> Path:
    now = _now()
    builder = (
        x509.CertificateRevocationListBuilder()
        .issuer_name(ca_cert.subject)
        .last_update(now - _CLOCK_SKEW)
        .next_update(now + _CRL_VALIDITY)
    )
    for serial, when in revoked:
        builder = builder.add_revoked_certificate(
            x509.RevokedCertificateBuilder().serial_number(serial).revocation_date(when).build()
        )
    crl = builder.sign(ca_key, hashes.SHA256())
    path = ca_dir / CRL
    _write_atomic(path, crl.public_bytes(serialization.Encoding.PEM))
    return path


def load_crl(ca_dir: Path) -> x509.CertificateRevocationList:
    """Load ``crl.pem`` and check it is signed by the CA in the same directory."""
    ca_dir = Path(ca_dir)
    return parse_crl((ca_dir / CRL).read_bytes(), (ca_dir / CA_CERT).read_bytes(), str(ca_dir / CRL))


def parse_crl(crl_pem: bytes, ca_pem: bytes, where: str = CRL) -> x509.CertificateRevocationList:
    """Parse a PEM CRL and check that the CA in ``ca_pem`` issued and signed it; PkiError otherwise.

    ``where`` names the file in error messages.
    """
    ca_cert = _load_cert(ca_pem)
    try:
        crl = x509.load_pem_x509_crl(crl_pem)
    except ValueError as e:
        raise PkiError(f"{where} is not a PEM certificate revocation list ({e})") from e
    try:
        valid = crl.issuer == ca_cert.subject and crl.is_signature_valid(ca_cert.public_key())  # type: ignore[arg-type]
    except (InvalidSignature, TypeError):
        valid = False
    if not valid:
        raise PkiError(
            f"{where} is not signed by the federation CA; copy the crl.pem from the CA directory that issued "
            "the certificates"
        )
    return crl


# --------------------------------------------------------------------------------------------------------------
# certificate helpers


def _load_cert(cert_pem: bytes) -> x509.Certificate:
    try:
        return x509.load_pem_x509_certificate(cert_pem)
    except ValueError as e:
        raise PkiError(f"not a PEM certificate: {e}") from e


def cert_common_name(cert_pem: bytes) -> str:
    """The subject CN of a PEM certificate (for a silo certificate: the silo id)."""
    attrs = _load_cert(cert_pem).subject.get_attributes_for_oid(NameOID.COMMON_NAME)
    if not attrs:
        raise PkiError("certificate has no common name")
    value = attrs[0].value
    return value.decode() if isinstance(value, bytes) else value


def cert_days_left(cert_pem: bytes, now: dt.datetime | None = None) -> float:
    """Days until the certificate expires (negative once expired). ``now`` defaults to the current UTC time."""
    now = now or _now()
    if now.tzinfo is None:
        now = now.replace(tzinfo=dt.UTC)  # naive datetimes are taken as UTC, like the certificate's times
    return (_load_cert(cert_pem).not_valid_after_utc - now).total_seconds() / 86400.0
