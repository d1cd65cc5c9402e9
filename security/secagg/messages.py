"""The stage messages, as bytes on the wire: JSON validated by strict pydantic models (binary fields base64), and
the masked input as safetensors. Nothing is ever unpickled; anything malformed raises ProtocolError.

    silo -> hub    AdvertiseKeys   two X25519 public keys (c: share encryption, s: pairwise masks); signed
                                   sessions add the silo's certificate and its signature over the keys
    hub  -> silo   Roster          the round's parameters and the silo's neighbours with their public keys (and
                                   each neighbour's own certificate and signature, relayed unchanged)
    silo -> hub    SharedKeys      a commitment to the self-mask seed and one AES-GCM ciphertext per neighbour
    hub  -> silo   Inbox           the ciphertexts neighbours addressed to this silo
    silo -> hub    masked input    y = quantized x + self mask +- pairwise masks  (safetensors, uint32/uint64)
    hub  -> silo   ConsistencyRequest    the survivor set U3, the same for every silo in it
    silo -> hub    ConsistencySignature  the silo's signature over U3 (empty in an unsigned session)
    hub  -> silo   UnmaskRequest   which neighbours survived and which dropped, and every signature over U3
    silo -> hub    UnmaskReply     for each: a share of its self-mask seed (survived) or masking key (dropped)
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
from collections.abc import Sequence
from typing import Annotated, Literal, Protocol, TypeVar

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from safetensors.numpy import load as st_load
from safetensors.numpy import save as st_save

MAX_JSON_BYTES = 8 << 20
# The hub hands a silo each stage's input in one Task message (its secagg_payload, not chunked): the gRPC message
# caps of both ends must hold the largest input with the Task's other fields.
MAX_TASK_MESSAGE_BYTES = MAX_JSON_BYTES + (64 << 10)


class ProtocolError(ValueError):
    """A stage message that is malformed, out of order, misaddressed or not what this session planned."""


class DuplicateMessage(ProtocolError):
    """A second message from a silo for a stage it already answered: the first stands (ALREADY_EXISTS)."""


class StageNotOpen(ProtocolError):
    """A message for a stage the session is not at (late, after its deadline, or early): not a broken message."""


class _Msg(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


# base64 DER of a silo certificate, and of an ECDSA P-256 signature (at most 72 bytes raw); "" when unsigned
CertB64 = Annotated[str, Field(max_length=16_384)]
SignatureB64 = Annotated[str, Field(max_length=256)]


class AdvertiseKeys(_Msg):
    session: str
    c_pk: str  # base64, 32 bytes
    s_pk: str
    cert: CertB64 = ""
    signature: SignatureB64 = ""  # over identity.advertise_statement(run, session, silo, c_pk, s_pk)


class NeighbourKeys(_Msg):
    silo_id: str
    index: int = Field(ge=1)
    c_pk: str
    s_pk: str
    cert: CertB64 = ""  # the neighbour's own certificate and signature, as it advertised them
    signature: SignatureB64 = ""


class RuleMsg(_Msg):
    pattern: str
    clip: float
    bits: int


class Roster(_Msg):
    session: str
    silo_id: str
    index: int = Field(ge=1)
    degree: int = Field(ge=1)  # k: neighbourhood size of the graph before any dropout
    threshold: int = Field(ge=2)  # t
    modulus_bits: Literal[32, 64]
    rules: list[RuleMsg]
    neighbours: list[NeighbourKeys]

    def parameters(self) -> str:
        return session_parameters(self.modulus_bits, self.degree, self.threshold, self.rules)


class _RuleLike(Protocol):
    pattern: str
    clip: float
    bits: int


def session_parameters(modulus_bits: int, degree: int, threshold: int, rules: Sequence[_RuleLike]) -> str:
    """A fingerprint of what every silo of a session must be shown alike: the ring, k, t and the quantization rules
    in order. A hub that gave one silo a fine encoding and the others a one-bit encoding of a huge range could read
    that silo's input out of an honest-looking sum (the others' levels would add at most n - 1 to it), so each share
    carries its sender's fingerprint and each survivor-set signature covers the signer's: a silo refuses both from a
    silo shown other parameters (security/secagg/silo.py)."""
    shown = {"modulus_bits": modulus_bits, "degree": degree, "threshold": threshold,
             "rules": [[r.pattern, float(r.clip), int(r.bits)] for r in rules]}
    return hashlib.sha256(json.dumps(shown, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


class SharedKeys(_Msg):
    session: str
    commitment: str  # base64 SHA-256 commitment to the self-mask seed
    shares: dict[str, str]  # recipient silo id -> base64 AES-GCM ciphertext


class SharePlaintext(_Msg):
    session: str
    sender: str
    recipient: str
    x: int
    self_mask: str  # base64 Shamir share value of the self-mask seed
    masking_key: str  # base64 Shamir share value of the X25519 masking private key
    parameters: str  # the sender's session_parameters(): the recipient refuses a share made under others


class Inbox(_Msg):
    session: str
    shares: dict[str, str]  # sender silo id -> base64 ciphertext


class ConsistencyRequest(_Msg):
    session: str
    survivors: list[str]  # U3: every silo whose masked input the hub summed


class ConsistencySignature(_Msg):
    session: str
    signature: SignatureB64 = ""  # over identity.survivors_statement(run, session, survivors, parameters)


class SignedSurvivors(_Msg):
    silo_id: str
    cert: CertB64 = ""
    signature: SignatureB64 = ""


class UnmaskRequest(_Msg):
    session: str
    survivors: list[str]
    dropped: list[str]
    signatures: list[SignedSurvivors] = Field(default_factory=list)  # U4's signatures over the survivor set


class RevealedShare(_Msg):
    kind: Literal["self_mask", "masking_key"]
    y: str  # base64 share value


class UnmaskReply(_Msg):
    session: str
    x: int = Field(ge=1)
    shares: dict[str, RevealedShare]  # owner silo id -> share


M = TypeVar("M", bound=_Msg)


def dump(message: _Msg) -> bytes:
    return message.model_dump_json().encode()


def parse(model: type[M], payload: bytes, session: str) -> M:
    if len(payload) > MAX_JSON_BYTES:
        raise ProtocolError(f"{model.__name__} of {len(payload)} bytes exceeds {MAX_JSON_BYTES}")
    try:
        message = model.model_validate_json(payload)
    except ValidationError as err:
        raise ProtocolError(f"malformed {model.__name__}: {err.errors()[0]['msg']}") from None
    if getattr(message, "session", session) != session:
        raise ProtocolError(f"{model.__name__} is for session {message.session!r}, not {session!r}")
    return message


def b64(raw: bytes) -> str:
    return base64.b64encode(raw).decode()


def unb64(text: str, length: int | None = None) -> bytes:
    try:
        raw = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise ProtocolError("field is not valid base64") from None
    if length is not None and len(raw) != length:
        raise ProtocolError(f"field holds {len(raw)} bytes, expected {length}")
    return raw


def dump_masked(session: str, silo_id: str, arrays: dict[str, np.ndarray]) -> bytes:
    return st_save(arrays, metadata={"session": session, "silo": silo_id})


def parse_masked(payload: bytes, session: str, silo_id: str, shapes: dict[str, tuple[int, ...]],
                 dtype: np.dtype, max_bytes: int) -> dict[str, np.ndarray]:
    """Parse and check a masked input: this session and sender, exactly the planned names and shapes, ring dtype."""
    if len(payload) > max_bytes:
        raise ProtocolError(f"masked input of {len(payload)} bytes exceeds the cap of {max_bytes}")
    try:
        header_len = int.from_bytes(payload[:8], "little")
        metadata = json.loads(payload[8 : 8 + header_len]).get("__metadata__", {})
        arrays = st_load(bytes(payload))
    except Exception as err:  # safetensors and json raise several types for malformed input
        raise ProtocolError(f"masked input is not valid safetensors data: {err}") from None
    if metadata.get("session") != session or metadata.get("silo") != silo_id:
        raise ProtocolError("masked input is labelled for another session or silo")
    if set(arrays) != set(shapes):
        raise ProtocolError(f"masked input names {sorted(arrays)[:5]} differ from the plan {sorted(shapes)[:5]}")
    for name, shape in shapes.items():
        a = arrays[name]
        if tuple(a.shape) != tuple(shape) or a.dtype != dtype:
            raise ProtocolError(f"masked tensor {name} is {a.dtype}{tuple(a.shape)}, expected {dtype}{tuple(shape)}")
    return arrays
