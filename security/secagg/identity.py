"""Who said what in secure aggregation: silo certificates of the federation CA, and the exact bytes they sign.

Against a hub that deviates (Bonawitz et al. 2017, the malicious-server variant), two things a silo is told by
the hub must come from the silo they are about, not from the hub:

- a neighbour's public keys (c_pk, s_pk): otherwise the hub hands out keys of its own, opens every share sealed
  for that "neighbour" and learns the shares of b and s_sk that unmask the sender;
- the survivor set U3 each silo was shown: otherwise the hub tells some neighbours of v that v survived (they
  reveal shares of b_v) and others that v dropped (they reveal shares of s_sk_v), and with t of each it removes
  both of v's masks from y_v.

So every silo signs (ECDSA P-256 over SHA-256, with the key of its federation certificate: CN = silo id,
clientAuth EKU) its advertised keys and, before revealing anything, the survivor set it was shown; peers verify
the certificate against the CA and the CRL and the signature over the statement. The signed bytes are canonical
JSON (sorted keys, no spaces, ASCII), domain-separated by a purpose label and bound to the run and the session,
so a signature made for one run, session (= round) or purpose verifies for no other.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.exceptions import InvalidSignature, UnsupportedAlgorithm
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from security.secagg.primitives import PROTOCOL

BUNDLE_CERT = "cert.pem"  # as security.pki writes a bundle
BUNDLE_KEY = "key.pem"
MAX_CERT_BYTES = 8192  # a P-256 leaf of the federation CA is ~500 bytes of DER; anything far larger is refused unread
_CACHE_LIMIT = 4096  # verified certificates remembered per verifier (a round's neighbours, many rounds over)

ADVERTISE_PURPOSE = "advertise-keys"
SURVIVORS_PURPOSE = "survivor-set"


class IdentityError(ValueError):
    """A certificate or signature that does not verify; the message names the silo and the cause."""


def _signature_algorithm() -> ec.ECDSA:
    return ec.ECDSA(hashes.SHA256())


def _common_name(cert: x509.Certificate) -> str | None:
    attrs = cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
    if len(attrs) != 1:
        return None
    value = attrs[0].value
    return value.decode() if isinstance(value, bytes) else value


def _is_p256(key: object) -> bool:
    return isinstance(key, ec.EllipticCurvePublicKey | ec.EllipticCurvePrivateKey) and isinstance(
        key.curve, ec.SECP256R1)


@dataclass(frozen=True)
class SiloIdentity:
    """This silo's certificate and key, to sign what it advertises (its keys, the survivor set it was shown)."""

    silo_id: str
    cert_der: bytes
    key: ec.EllipticCurvePrivateKey

    @classmethod
    def from_bundle(cls, certs_dir: Path) -> SiloIdentity:
        """cert.pem + key.pem of a silo bundle (security.pki.issue_silo); the silo id is the certificate's CN."""
        certs_dir = Path(certs_dir)
        try:
            cert = x509.load_pem_x509_certificate((certs_dir / BUNDLE_CERT).read_bytes())
            key = serialization.load_pem_private_key((certs_dir / BUNDLE_KEY).read_bytes(), password=None)
        except (OSError, ValueError, TypeError, UnsupportedAlgorithm) as err:
            raise IdentityError(f"cannot load the silo bundle in {certs_dir}: {err}") from None
        return cls.of(cert, key, certs_dir)

    @classmethod
    def of(cls, cert: x509.Certificate, key: object, certs_dir: Path) -> SiloIdentity:
        """The identity of a bundle parsed already (security.tls.read_bundle, which the silo's channel uses too);
        `certs_dir` names its files in errors."""
        certs_dir = Path(certs_dir)
        silo_id = _common_name(cert)
        if silo_id is None:
            raise IdentityError(f"{certs_dir / BUNDLE_CERT} has no single common name to serve as the silo id")
        if (not isinstance(key, ec.EllipticCurvePrivateKey) or not _is_p256(key)
                or key.public_key() != cert.public_key()):
            raise IdentityError(f"{certs_dir / BUNDLE_KEY} is not the EC P-256 key of {certs_dir / BUNDLE_CERT} "
                                f"(silo {silo_id})")
        return cls(silo_id, cert.public_bytes(serialization.Encoding.DER), key)

    def sign(self, data: bytes) -> bytes:
        """ECDSA P-256 over SHA-256(data), DER-encoded (r, s); a fresh random nonce each time."""
        return self.key.sign(data, _signature_algorithm())


@dataclass(frozen=True)
class _Checked:
    """What a certificate was found to be once its CA signature, key type and EKU passed."""

    common_name: str
    serial: int
    not_before: dt.datetime
    not_after: dt.datetime
    public_key: ec.EllipticCurvePublicKey


class PeerVerifier:
    """What a silo (and the hub) checks a peer's certificate and signature against: the federation CA and,
    optionally, its revocation list (`is_revoked(serial)`, e.g. security.crl.RevocationList.is_revoked).

    The checks that depend on the certificate alone (it parses, the CA signed it, P-256 key, clientAuth) are
    cached by SHA-256 of the DER: a round verifies the same neighbours' certificates again and again. The validity
    window, the name and revocation are checked on every call (time passes, and a CRL can change mid-run)."""

    def __init__(self, ca_pem: bytes, is_revoked: Callable[[int], bool] | None = None):
        try:
            self._ca = x509.load_pem_x509_certificate(ca_pem)
        except ValueError as err:
            raise IdentityError(f"the federation CA certificate does not parse: {err}") from None
        if not isinstance(self._ca.public_key(), ec.EllipticCurvePublicKey):
            raise IdentityError("the federation CA's key is not an elliptic-curve key")
        self._is_revoked = is_revoked
        self._cache: dict[bytes, _Checked] = {}
        self._lock = threading.Lock()

    def _check_certificate(self, silo_id: str, cert_der: bytes) -> _Checked:
        if len(cert_der) > MAX_CERT_BYTES:
            raise IdentityError(f"silo {silo_id}: a certificate of {len(cert_der)} bytes is not one the "
                                f"federation CA issues")
        digest = hashlib.sha256(cert_der).digest()
        with self._lock:
            checked = self._cache.get(digest)
        if checked is not None:
            return checked
        try:
            cert = x509.load_der_x509_certificate(cert_der)
        except ValueError as err:
            raise IdentityError(f"silo {silo_id}: the certificate does not parse ({err})") from None
        try:
            # issuer == the CA's subject, and the CA's key verifies the certificate's signature
            cert.verify_directly_issued_by(self._ca)
        except (ValueError, TypeError, InvalidSignature, UnsupportedAlgorithm):
            raise IdentityError(f"silo {silo_id}: the certificate is not signed by the federation CA") from None
        key = cert.public_key()
        if not _is_p256(key):
            raise IdentityError(f"silo {silo_id}: the certificate's key is not EC P-256")
        try:
            eku = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
        except x509.ExtensionNotFound:
            eku = []
        if ExtendedKeyUsageOID.CLIENT_AUTH not in eku:
            raise IdentityError(f"silo {silo_id}: the certificate is not a silo's (no clientAuth extended key "
                                f"usage)")
        name = _common_name(cert)
        if name is None:
            raise IdentityError(f"silo {silo_id}: the certificate has no single common name")
        checked = _Checked(name, cert.serial_number, cert.not_valid_before_utc, cert.not_valid_after_utc, key)
        with self._lock:
            if len(self._cache) >= _CACHE_LIMIT:
                self._cache.clear()
            self._cache[digest] = checked
        return checked

    def verify(self, silo_id: str, cert_der: bytes, data: bytes, signature: bytes) -> None:
        """IdentityError unless `cert_der` is a live silo certificate of the federation CA for `silo_id` (issued
        and signed by the CA, within its validity window now, clientAuth, CN = silo_id, serial not revoked) and
        `signature` is its key's ECDSA P-256 / SHA-256 signature over `data`."""
        checked = self._check_certificate(silo_id, cert_der)
        if checked.common_name != silo_id:
            raise IdentityError(f"silo {silo_id}: the certificate is silo {checked.common_name!r}'s")
        now = dt.datetime.now(dt.UTC)
        if not checked.not_before <= now <= checked.not_after:
            raise IdentityError(f"silo {silo_id}: the certificate is outside its validity window "
                                f"({checked.not_before:%Y-%m-%d %H:%M} to {checked.not_after:%Y-%m-%d %H:%M} UTC)")
        if self._is_revoked is not None and self._is_revoked(checked.serial):
            raise IdentityError(f"silo {silo_id}: the certificate (serial {checked.serial:x}) is revoked")
        try:
            checked.public_key.verify(signature, data, _signature_algorithm())
        except (InvalidSignature, ValueError):
            raise IdentityError(f"silo {silo_id}: the signature does not verify with its certificate's key") from None


def _canonical(statement: dict[str, object]) -> bytes:
    return json.dumps(statement, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()


def advertise_statement(run_id: str, session: str, silo_id: str, c_pk: bytes, s_pk: bytes) -> bytes:
    """What a silo signs at advertise_keys: its two X25519 public keys, for this run and session only."""
    return _canonical({"protocol": PROTOCOL.decode(), "purpose": ADVERTISE_PURPOSE, "run": run_id,
                       "session": session, "silo": silo_id, "c_pk": c_pk.hex(), "s_pk": s_pk.hex()})


def survivors_statement(run_id: str, session: str, survivors: Sequence[str], parameters: str) -> bytes:
    """What a silo signs at the consistency stage: the survivor set U3 it was shown (sorted, deduplicated, so
    the same set always gives the same bytes) and the session parameters it was shown
    (messages.session_parameters), for this run and session only."""
    return _canonical({"protocol": PROTOCOL.decode(), "purpose": SURVIVORS_PURPOSE, "run": run_id,
                       "session": session, "survivors": sorted(set(survivors)), "parameters": parameters})
