"""The tensor codec: named tensors <-> safetensors bytes, streamed in chunks with a sha256 over the whole.

Nothing here ever unpickles: safetensors is a JSON header plus raw little-endian buffers. Every decoded payload is
checked against what the receiver planned (names, shapes, dtypes) and for non-finite values before anyone uses it.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

FLOAT16_MAX = float(torch.finfo(torch.float16).max)  # 65504: past it a float16 cast gives inf
CHUNK_BYTES = 256 << 10  # 256 KiB: far under gRPC's 4 MiB message cap, and little held per open stream

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
    "int64": torch.int64,
    "int32": torch.int32,
    "uint8": torch.uint8,
}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}


class CodecError(ValueError):
    """A payload that is corrupt, oversized, or not what the receiver planned."""


class TooLarge(CodecError):
    """A payload or stream over its cap or its announced size: a receiver answers RESOURCE_EXHAUSTED, where other
    CodecErrors are INVALID_ARGUMENT."""


@dataclass(frozen=True)
class TensorSpec:
    shape: tuple[int, ...]
    dtype: str

    @classmethod
    def of(cls, t: torch.Tensor) -> TensorSpec:
        return cls(tuple(t.shape), DTYPE_NAMES[t.dtype])


def encode(tensors: Mapping[str, torch.Tensor], half: bool = False) -> bytes:
    """Serialise named tensors to safetensors bytes (optionally float32 -> float16 to halve the wire)."""
    prepared = {}
    for name, t in tensors.items():
        t = t.detach().to("cpu")
        if half and t.dtype == torch.float32:
            t = t.to(torch.float16)
        prepared[name] = t.contiguous()
    return st_save(prepared)


def decode(payload: bytes, max_bytes: int | None = None) -> dict[str, torch.Tensor]:
    """Parse safetensors bytes; any malformed payload raises CodecError, never anything looser."""
    if max_bytes is not None and len(payload) > max_bytes:
        raise TooLarge(f"payload of {len(payload)} bytes exceeds the cap of {max_bytes} bytes")
    try:
        return dict(st_load(bytes(payload)))
    except Exception as exc:  # safetensors raises several error types for malformed input
        raise CodecError(f"payload is not valid safetensors data: {exc}") from None


def sha256_hex(payload: bytes) -> str:
    return hashlib.sha256(payload).hexdigest()


def iter_chunks(payload: bytes, chunk_bytes: int = CHUNK_BYTES) -> Iterator[tuple[int, bytes]]:
    """(offset, bytes) pieces of at most chunk_bytes; an empty payload yields nothing."""
    view = memoryview(payload)
    for offset in range(0, len(payload), chunk_bytes):
        yield offset, bytes(view[offset : offset + chunk_bytes])


class ChunkAssembler:
    """Reassembles a chunked stream, refusing gaps, overlaps and anything past the announced size."""

    def __init__(self, total_bytes: int, max_bytes: int):
        if total_bytes < 0 or total_bytes > max_bytes:
            raise TooLarge(f"announced size {total_bytes} bytes is outside 0..{max_bytes}")
        self.total_bytes = total_bytes
        self._buffer = bytearray()

    def add(self, offset: int, data: bytes) -> None:
        if offset != len(self._buffer):
            raise CodecError(f"chunk at offset {offset} but {len(self._buffer)} bytes received so far")
        if len(self._buffer) + len(data) > self.total_bytes:
            raise TooLarge(f"stream is longer than the announced {self.total_bytes} bytes")
        self._buffer.extend(data)

    def finish(self, expected_sha256: str) -> bytes:
        if len(self._buffer) != self.total_bytes:
            raise CodecError(f"stream ended after {len(self._buffer)} of {self.total_bytes} bytes")
        payload = bytes(self._buffer)
        if sha256_hex(payload) != expected_sha256:
            raise CodecError("sha256 of the received bytes does not match the announced digest")
        return payload


def assemble(chunks: Iterable[tuple[int, bytes]], total_bytes: int, sha256: str, max_bytes: int) -> bytes:
    assembler = ChunkAssembler(total_bytes, max_bytes)
    for offset, data in chunks:
        assembler.add(offset, data)
    return assembler.finish(sha256)


def check_tensors(
    tensors: Mapping[str, torch.Tensor],
    expected: Mapping[str, TensorSpec],
    groups: Mapping[str, Sequence[str]] | None = None,
) -> None:
    """Refuse anything but the planned names, shapes and dtypes, with finite values.

    Without ``groups`` the result must hold exactly the names in ``expected``. With ``groups`` (group -> names,
    a partition of ``expected``) it may hold any non-empty set of WHOLE groups: a site uploads only the models it
    trained, but never a part of one.
    """
    required = set(expected)
    if groups:
        present = [g for g, names in groups.items() if any(n in tensors for n in names)]
        if not present:
            raise CodecError(f"result holds none of the planned groups ({', '.join(sorted(groups))})")
        for g in present:
            lacking = [n for n in groups[g] if n not in tensors]
            if lacking:
                raise CodecError(f"group {g} is incomplete: missing {', '.join(lacking[:5])}")
        required = {n for g in present for n in groups[g]}
    missing = sorted(required - set(tensors))
    extra = sorted(set(tensors) - required)
    if missing:
        raise CodecError(f"missing tensors: {', '.join(missing[:5])}")
    if extra:
        raise CodecError(f"unexpected tensors: {', '.join(extra[:5])}")
    for name in sorted(required):
        spec = expected[name]
        t = tensors[name]
        if tuple(t.shape) != tuple(spec.shape):
            raise CodecError(f"tensor {name} has shape {tuple(t.shape)}, expected {tuple(spec.shape)}")
        if DTYPE_NAMES.get(t.dtype) != spec.dtype:
            raise CodecError(f"tensor {name} has dtype {t.dtype}, expected {spec.dtype}")
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            # float16 (wire.half_precision) overflows past 65504: a delta times a silo's image count can get there
            where = (" (float16, as wire.half_precision sends it, ends at +-65504: values past it overflow; set "
                     "wire.half_precision: false at the hub)") if t.dtype == torch.float16 else ""
            raise CodecError(f"tensor {name} holds NaN or infinite values{where}")
