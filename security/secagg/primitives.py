"""The named primitives secure aggregation is built on, and nothing hand-made.

Everything here comes from `cryptography`:

- X25519 (RFC 7748) for key agreement: ``KA(sk_i, pk_j) = KA(sk_j, pk_i)``.
- HKDF-SHA256 (RFC 5869) turns a shared secret into a key, bound to the session and to a purpose label, so the same
  X25519 secret can never serve two purposes or two sessions.
- ChaCha20 (RFC 8439) as the pseudo-random generator that expands a 256-bit key into a mask: the keystream over a
  zero plaintext, read as little-endian unsigned words, is uniform over Z_{2^m} for m = 32 or 64. The full 256-bit
  derived key keys the stream (the nonce is zero: every key is fresh per session and per purpose, used for one
  stream only).
- AES-256-GCM for the Shamir shares that travel silo -> hub -> silo: confidentiality from the hub and an
  authentication tag that detects any change, with the session and both silo ids as associated data.
"""

from __future__ import annotations

import hashlib
import json
import os

import numpy as np
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

KEY_BYTES = 32
NONCE_BYTES = 12  # AES-GCM
PROTOCOL = b"silokit/secagg/v1"

# Purpose labels: HKDF's `info`. One label per use of a secret.
PAIR_MASK = b"pair-mask"
SHARE_KEY = b"share-encryption"
SELF_MASK = b"self-mask"
COMMIT = b"self-mask-commitment"


class TamperedShare(ValueError):
    """An encrypted share failed AES-GCM authentication: it was altered, truncated or misaddressed."""


def new_keypair() -> X25519PrivateKey:
    return X25519PrivateKey.generate()


def public_bytes(key: X25519PrivateKey) -> bytes:
    return key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


def private_bytes(key: X25519PrivateKey) -> bytes:
    return key.private_bytes_raw()


def load_public(raw: bytes) -> X25519PublicKey:
    if len(raw) != KEY_BYTES:
        raise ValueError(f"an X25519 public key is {KEY_BYTES} bytes, got {len(raw)}")
    return X25519PublicKey.from_public_bytes(raw)


def load_private(raw: bytes) -> X25519PrivateKey:
    if len(raw) != KEY_BYTES:
        raise ValueError(f"an X25519 private key is {KEY_BYTES} bytes, got {len(raw)}")
    return X25519PrivateKey.from_private_bytes(raw)


def _context(session_id: str, purpose: bytes, *parts: str) -> bytes:
    """Unambiguous HKDF info: protocol, purpose and the ordered parts, JSON-encoded (no concatenation games)."""
    return PROTOCOL + b"|" + purpose + b"|" + json.dumps([session_id, *parts]).encode()


def hkdf(secret: bytes, session_id: str, purpose: bytes, *parts: str) -> bytes:
    """K = HKDF-SHA256(ikm=secret, salt=SHA256(session id), info=protocol|purpose|parts), 32 bytes."""
    return HKDF(
        algorithm=hashes.SHA256(),
        length=KEY_BYTES,
        salt=hashlib.sha256(session_id.encode()).digest(),
        info=_context(session_id, purpose, *parts),
    ).derive(secret)


def agree(own: X25519PrivateKey, peer_public: bytes, session_id: str, purpose: bytes, a: str, b: str) -> bytes:
    """The key two silos a and b share for a purpose: HKDF(X25519(sk_a, pk_b)), symmetric in (a, b)."""
    shared = own.exchange(load_public(peer_public))
    if shared == bytes(KEY_BYTES):
        raise ValueError("X25519 produced the all-zero secret: the peer sent a low-order public key")
    lo, hi = sorted((a, b))
    return hkdf(shared, session_id, purpose, lo, hi)


def prg_words(key: bytes, count: int, bits: int) -> np.ndarray:
    """`count` uniform words of Z_{2^bits} (bits 32 or 64): the ChaCha20 keystream under `key`, zero nonce."""
    if len(key) != KEY_BYTES:
        raise ValueError("the PRG needs a 256-bit key")
    dtype = {32: np.dtype("<u4"), 64: np.dtype("<u8")}[bits]
    nbytes = count * dtype.itemsize
    encryptor = Cipher(algorithms.ChaCha20(key, bytes(16)), mode=None).encryptor()
    out = bytearray(nbytes + 64)
    written = encryptor.update_into(bytes(nbytes), out)
    assert written == nbytes
    return np.frombuffer(memoryview(out)[:nbytes], dtype=dtype).astype(dtype.newbyteorder("="), copy=False)


def seal(key: bytes, plaintext: bytes, associated: bytes) -> bytes:
    """AES-256-GCM with a random 96-bit nonce: nonce || ciphertext || tag."""
    nonce = os.urandom(NONCE_BYTES)
    return nonce + AESGCM(key).encrypt(nonce, plaintext, associated)


def open_sealed(key: bytes, sealed: bytes, associated: bytes) -> bytes:
    if len(sealed) < NONCE_BYTES + 16:
        raise TamperedShare("encrypted share is too short to be genuine")
    try:
        return AESGCM(key).decrypt(sealed[:NONCE_BYTES], sealed[NONCE_BYTES:], associated)
    except InvalidTag:
        raise TamperedShare("encrypted share failed authentication (altered in transit or not meant for us)") from None


def commitment(session_id: str, silo_id: str, seed: bytes) -> bytes:
    """A hiding, binding commitment to a 256-bit uniform seed: SHA-256 over protocol, session, silo and seed.

    The hub checks the self-mask seed it reconstructs against it, so a silo that reveals a wrong share can make
    the round fail but can never make it produce a wrong sum.
    """
    return hashlib.sha256(_context(session_id, COMMIT, silo_id) + seed).digest()
