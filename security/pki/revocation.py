"""Revoking: finding certificates by serial or name, marking them revoked and re-signing crl.pem, and reading a
CRL back with a check that the federation CA signed it."""

from __future__ import annotations

from pathlib import Path

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric import ec

from security.pki import store
from security.pki.certificates import load_cert
from security.pki.store import CA_CERT, CRL, INVENTORY, IssuedCert, PkiError


def write_crl(ca_dir: Path, passphrase: bytes | None = None) -> Path:
    """Re-sign ``crl.pem`` from the inventory: every entry with status "revoked" is listed.

    Also the way to refresh the CRL before its nextUpdate passes (`silo-certs crl`).
    """
    ca_dir = Path(ca_dir)
    with store.ca_lock(ca_dir):  # a concurrent revoke must not be undone by re-signing an older inventory
        ca_cert, ca_key = store.load_ca(ca_dir, passphrase)
        return store.write_crl_file(ca_dir, ca_cert, ca_key, store.revoked_of(store.load_inventory(ca_dir)))


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
    entries = store.load_inventory(ca_dir)
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
    with store.ca_lock(ca_dir):
        matches = find_certificates(ca_dir, target)
        fresh = [e for e in matches if e.status != "revoked"]
        if not fresh:
            serials = ", ".join(e.serial for e in matches)
            raise PkiError(f"{target!r} is already revoked (serial {serials}); nothing to do")
        # Unlock the CA before changing anything, so a wrong passphrase leaves the inventory as it was.
        ca_cert, ca_key = store.load_ca(ca_dir, passphrase)
        entries = store.load_inventory(ca_dir)
        chosen = {e.serial for e in fresh}
        revoke_entries(ca_dir, ca_cert, ca_key, entries, chosen)
        store.save_inventory(ca_dir, entries)
        return [e for e in entries if e.serial in chosen]


def revoke_entries(
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
    when = store.utc_now().isoformat()
    for e in entries:
        if e.serial in serials:
            e.status, e.revoked_at = "revoked", when
    store.write_crl_file(ca_dir, ca_cert, ca_key, store.revoked_of(entries))


def load_crl(ca_dir: Path) -> x509.CertificateRevocationList:
    """Load ``crl.pem`` and check it is signed by the CA in the same directory."""
    ca_dir = Path(ca_dir)
    return parse_crl((ca_dir / CRL).read_bytes(), (ca_dir / CA_CERT).read_bytes(), str(ca_dir / CRL))


def parse_crl(crl_pem: bytes, ca_pem: bytes, where: str = CRL) -> x509.CertificateRevocationList:
    """Parse a PEM CRL and check that the CA in ``ca_pem`` issued and signed it; PkiError otherwise.

    ``where`` names the file in error messages.
    """
    ca_cert = load_cert(ca_pem)
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
