"""The CA directory: its files and their layout (see security/pki/__init__.py), the lock every change holds, the
inventory of what was issued, the signed CRL file, and making and loading the CA itself. The other rooms of the PKI
(issuing, revocation, certificates) build on these."""

from __future__ import annotations

import datetime as dt
import fcntl
import json
import os
import tempfile
import threading
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

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
# Backdate notBefore a little so a peer whose clock runs slightly behind does not reject a fresh certificate.
CLOCK_SKEW = dt.timedelta(minutes=5)
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


def utc_now() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


def write_new(path: Path, data: bytes, mode: int = 0o644) -> None:
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


def write_atomic(path: Path, data: bytes) -> None:
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


def refuse_existing(paths: Iterable[Path]) -> None:
    for p in paths:
        if p.exists():
            raise PkiError(
                f"{p} already exists; refusing to overwrite it (use a new directory or delete it first)"
            )


def check_days(days: int) -> None:
    if days < 1:
        raise PkiError(f"validity must be at least 1 day, got {days}")


def new_key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def key_pem(key: ec.EllipticCurvePrivateKey, passphrase: bytes | None = None) -> bytes:
    encryption: serialization.KeySerializationEncryption = (
        serialization.BestAvailableEncryption(passphrase) if passphrase else serialization.NoEncryption()
    )
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, encryption)


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


def save_inventory(ca_dir: Path, entries: list[IssuedCert]) -> None:
    data = json.dumps([asdict(e) for e in entries], indent=2) + "\n"
    write_atomic(Path(ca_dir) / INVENTORY, data.encode())


def revoked_of(entries: list[IssuedCert]) -> list[tuple[int, dt.datetime]]:
    return [
        (int(e.serial, 16), dt.datetime.fromisoformat(e.revoked_at) if e.revoked_at else utc_now())
        for e in entries
        if e.status == "revoked"
    ]


def write_crl_file(
    ca_dir: Path,
    ca_cert: x509.Certificate,
    ca_key: ec.EllipticCurvePrivateKey,
    revoked: list[tuple[int, dt.datetime]],
) -> Path:
    now = utc_now()
    builder = (
        x509.CertificateRevocationListBuilder()
        .issuer_name(ca_cert.subject)
        .last_update(now - CLOCK_SKEW)
        .next_update(now + _CRL_VALIDITY)
    )
    for serial, when in revoked:
        builder = builder.add_revoked_certificate(
            x509.RevokedCertificateBuilder().serial_number(serial).revocation_date(when).build()
        )
    crl = builder.sign(ca_key, hashes.SHA256())
    path = ca_dir / CRL
    write_atomic(path, crl.public_bytes(serialization.Encoding.PEM))
    return path


def init_ca(
    out_dir: Path, name: str = "silokit CA", days: int = 3650, passphrase: bytes | None = None
) -> Path:
    """Create the federation CA in ``out_dir`` and return ``out_dir``.

    Writes ca.pem, ca.key (0600, encrypted when ``passphrase`` is given), an empty signed crl.pem and an empty
    issued.json. Refuses to touch a directory that already holds any of them.
    """
    out_dir = Path(out_dir)
    check_days(days)
    if not name.strip():
        raise PkiError("the CA name must not be empty")
    refuse_existing(out_dir / f for f in (CA_KEY, CA_CERT, CRL, INVENTORY))
    out_dir.mkdir(parents=True, exist_ok=True, mode=0o700)  # only the CA admin needs to look inside

    key = new_key()
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = utc_now()
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - CLOCK_SKEW)
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
    write_new(out_dir / CA_KEY, key_pem(key, passphrase), mode=0o600)
    write_new(out_dir / CA_CERT, cert.public_bytes(serialization.Encoding.PEM))
    write_crl_file(out_dir, cert, key, revoked=[])
    save_inventory(out_dir, [])
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
