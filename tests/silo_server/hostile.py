"""Hypothesis strategies for hostile uploads: each draws a mutation of a valid upload that is invalid BY
CONSTRUCTION (so "always a refusal" is a property we can assert), plus the refusal reasons it may earn.

An upload is (header dict, list of (offset, data) chunks), the transport-neutral shape Hub.upload takes; the
servicer fuzz turns the same draws into protobuf messages.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass, field
from typing import Any

import torch
from hypothesis import strategies as st

from silo_core.tensors import encode, iter_chunks, sha256_hex

CHUNK = 16  # small chunks, so stream mutations have several chunks to play with
IMAGES = 10  # what the fuzzed silo declares at Join: the largest weight it may send
MAX_NORM = 10.0


@dataclass
class Hostile:
    kind: str
    header: dict[str, Any]
    chunks: list[tuple[Any, Any]]
    reasons: set[str] = field(default_factory=set)  # acceptable refusal reasons


def valid_tensors() -> dict[str, torch.Tensor]:
    return {"delta/x": torch.tensor([1.0, -2.0, 0.5]), "weight": torch.tensor([1.0])}


def valid_upload(run_id: str, task_id: str, round_: int, tensors: dict[str, torch.Tensor] | None = None
                 ) -> tuple[dict[str, Any], bytes]:
    payload = encode(valid_tensors() if tensors is None else tensors)
    header = {"run_id": run_id, "task_id": task_id, "round": round_, "total_bytes": len(payload),
              "sha256": sha256_hex(payload), "skipped": False, "metrics": {"n": 1.0, "train_loss": 0.5}}
    return header, payload


def _chunks(payload: bytes) -> list[tuple[int, bytes]]:
    return list(iter_chunks(payload, CHUNK))


def _rehashed(header: dict[str, Any], payload: bytes) -> dict[str, Any]:
    return {**header, "total_bytes": len(payload), "sha256": sha256_hex(payload)}


# ------------------------------------------------------------------------------------------------- header fields

_ANY = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=True), st.text(max_size=300),
                 st.binary(max_size=40), st.lists(st.integers(), max_size=3), st.dictionaries(st.text(), st.integers(),
                                                                                             max_size=3))
_BAD_METRIC_VALUES = st.one_of(st.just(math.nan), st.just(math.inf), st.just(-math.inf),
                               st.floats(min_value=1e16, max_value=1e300), st.floats(max_value=-1e16, min_value=-1e300),
                               st.text(max_size=5), st.none(), st.booleans(), st.lists(st.floats(), max_size=2))
_BAD_METRIC_KEYS = st.one_of(st.just(""), st.text(min_size=65, max_size=80, alphabet="abc"),
                             st.text(min_size=1, max_size=10).filter(lambda k: any(
                                 not (c.isascii() and (c.isalnum() or c in "._/-")) for c in k)))
_GOOD_METRICS = st.dictionaries(st.text(alphabet="abcxyz_", min_size=1, max_size=8),
                                st.floats(min_value=-1e6, max_value=1e6), max_size=5)


_PROTO_BAD_METRIC_VALUES = st.one_of(st.just(math.nan), st.just(math.inf), st.just(-math.inf),
                                     st.floats(min_value=1e16, max_value=1e300))


@st.composite
def bad_metrics(draw, proto: bool = False) -> tuple[Any, set[str]]:
    """Metrics that break a rule; ``proto``: only what a map<string, double> can carry."""
    choice = draw(st.sampled_from(["value", "key", "too_many"] + ([] if proto else ["not_a_map"])))
    good = draw(_GOOD_METRICS)
    if choice == "value":
        return {**good, "loss": draw(_PROTO_BAD_METRIC_VALUES if proto else _BAD_METRIC_VALUES)}, {"bad_metrics"}
    if choice == "key":
        return {**good, draw(_BAD_METRIC_KEYS): 1.0}, {"bad_metrics"}
    if choice == "too_many":
        return {f"m{i}": 0.0 for i in range(draw(st.integers(65, 200)))}, {"oversized"}
    return draw(st.one_of(st.lists(st.floats(), max_size=3), st.text(max_size=5), st.integers())), {"bad_metrics"}


_PROTO_TYPED = {"run_id": st.text(max_size=300), "task_id": st.text(max_size=300), "sha256": st.text(max_size=80),
                "round": st.integers(-2**63, 2**63 - 1), "total_bytes": st.integers(-2**63, 2**63 - 1)}


@st.composite
def header_mutation(draw, header: dict[str, Any], payload: bytes, proto: bool = False) -> Hostile:
    """One header field changed to something invalid (``proto``: a value of the field's protobuf type)."""
    name = draw(st.sampled_from(["run_id", "task_id", "round", "total_bytes", "sha256", "skipped", "metrics"]))
    h = dict(header)
    if name == "metrics":
        h["metrics"], reasons = draw(bad_metrics(proto))
        return Hostile(f"header.{name}", h, _chunks(payload), reasons)
    if name == "skipped":
        h["skipped"] = True if proto else draw(st.one_of(st.just(True), _ANY.filter(lambda v: not isinstance(v, bool))))
        return Hostile("header.skipped", h, _chunks(payload), {"bad_header"})
    values = _PROTO_TYPED[name] if proto else _ANY
    h[name] = draw(values.filter(lambda v: v != header[name] or type(v) is not type(header[name])))
    reasons = {"bad_header", "wrong_run", "stale_task", "wrong_round", "bad_stream", "oversized", "bad_checksum"}
    return Hostile(f"header.{name}", h, _chunks(payload), reasons)


# ------------------------------------------------------------------------------------------------------ payload


def _header_span(payload: bytes) -> int:
    return 8 + struct.unpack("<Q", payload[:8])[0]


@st.composite
def payload_mutation(draw, header: dict[str, Any], payload: bytes) -> Hostile:
    kind = draw(st.sampled_from(["flip", "flip_header_rehash", "truncate", "extend", "random"]))
    data = bytearray(payload)
    if kind == "flip":  # corrupted in transit: the checksum catches it
        i = draw(st.integers(0, len(data) - 1))
        data[i] ^= draw(st.integers(1, 255))
        return Hostile(kind, header, _chunks(bytes(data)), {"bad_checksum"})
    if kind == "flip_header_rehash":  # a forged safetensors header (names, dtypes, shapes, offsets)
        span = _header_span(payload)
        # Padding spaces in the JSON header are insignificant; every other byte means something.
        positions = [i for i in range(span) if i < 8 or payload[i:i + 1] != b" "]
        i = draw(st.sampled_from(positions))
        data[i] = draw(st.integers(0, 255).filter(lambda b: b != payload[i] and b not in b" \t\r\n"))
        reasons = {"bad_payload", "bad_tensors"}
    elif kind == "truncate":
        data = data[: draw(st.integers(1, len(data) - 1))]
        reasons = {"bad_payload"}
    elif kind == "extend":
        data += draw(st.binary(min_size=1, max_size=64))
        reasons = {"bad_payload"}
    else:
        data = bytearray(draw(st.binary(min_size=1, max_size=400)))
        reasons = {"bad_payload", "bad_tensors"}
    return Hostile(kind, _rehashed(header, bytes(data)), _chunks(bytes(data)), reasons)


# ------------------------------------------------------------------------------------------------------ tensors


@st.composite
def tensor_mutation(draw, header: dict[str, Any]) -> Hostile:
    t = valid_tensors()
    kind = draw(st.sampled_from(["shape", "dtype", "missing", "extra", "non_finite", "weight", "norm"]))
    reasons = {"bad_tensors"}
    if kind == "shape":
        n = draw(st.integers(0, 8).filter(lambda n: n != 3))
        t["delta/x"] = torch.zeros(draw(st.sampled_from([(n,), (1, 3), (3, 1), (n, 2)])))
    elif kind == "dtype":
        key = draw(st.sampled_from(["delta/x", "weight"]))
        t[key] = t[key].to(draw(st.sampled_from([torch.float64, torch.float16, torch.bfloat16, torch.int32,
                                                 torch.int64])))
    elif kind == "missing":
        del t[draw(st.sampled_from(["delta/x", "weight"]))]
    elif kind == "extra":
        name = draw(st.text(alphabet="abcdelt/_", min_size=1, max_size=12).filter(lambda n: n not in t))
        t[name] = torch.zeros(draw(st.integers(1, 4)))
    elif kind == "non_finite":
        key = draw(st.sampled_from(["delta/x", "weight"]))
        idx = draw(st.integers(0, t[key].numel() - 1))
        t[key].view(-1)[idx] = draw(st.sampled_from([math.nan, math.inf, -math.inf]))
        reasons = {"non_finite"}
    elif kind == "weight":  # zero, negative, or more than the images the silo declared
        t["weight"] = torch.tensor([draw(st.one_of(st.floats(max_value=0.0, allow_nan=False, allow_infinity=False,
                                                             width=32),
                                                   st.floats(min_value=IMAGES + 1, max_value=1e30)))])
        reasons = {"bad_weight"}
    else:  # an update far beyond the norm bound (its size per unit weight)
        t["delta/x"] = t["delta/x"] * draw(st.floats(min_value=MAX_NORM, max_value=1e30))
        reasons = {"update_norm", "non_finite"}
    payload = encode(t)
    return Hostile(f"tensor.{kind}", _rehashed(header, payload), _chunks(payload), reasons)


# ------------------------------------------------------------------------------------------------------- stream


@st.composite
def stream_mutation(draw, header: dict[str, Any], payload: bytes) -> Hostile:
    chunks = _chunks(payload)
    kind = draw(st.sampled_from(["swap", "gap", "duplicate", "empty", "offset", "trailing", "types", "none"]))
    if kind == "swap":
        i = draw(st.integers(0, len(chunks) - 2))
        chunks[i], chunks[i + 1] = chunks[i + 1], chunks[i]
    elif kind == "gap":
        del chunks[draw(st.integers(0, len(chunks) - 2))]
    elif kind == "duplicate":
        i = draw(st.integers(0, len(chunks) - 1))
        chunks.insert(i, chunks[i])
    elif kind == "empty":
        i = draw(st.integers(0, len(chunks)))
        chunks.insert(i, (chunks[i][0] if i < len(chunks) else len(payload), b""))
    elif kind == "offset":
        i = draw(st.integers(0, len(chunks) - 1))
        chunks[i] = (draw(st.integers(-2**63, 2**63 - 1).filter(lambda o, c=chunks[i][0]: o != c)), chunks[i][1])
    elif kind == "trailing":
        chunks.append((len(payload), draw(st.binary(min_size=1, max_size=32))))
    elif kind == "types":
        i = draw(st.integers(0, len(chunks) - 1))
        chunks[i] = draw(st.sampled_from([(str(chunks[i][0]), chunks[i][1]), (chunks[i][0], chunks[i][1].hex()),
                                          (None, chunks[i][1]), (float(chunks[i][0]), chunks[i][1])]))
    else:
        chunks = []
    return Hostile(f"stream.{kind}", header, chunks, {"bad_stream", "oversized"})


def hostile_upload(header: dict[str, Any], payload: bytes, proto: bool = False) -> st.SearchStrategy[Hostile]:
    """Any of the above, around the valid (header, payload); ``proto``: only what protobuf messages can carry."""
    stream = stream_mutation(header, payload)
    if proto:
        stream = stream.filter(lambda h: h.kind != "stream.types")
    return st.one_of(header_mutation(header, payload, proto), payload_mutation(header, payload),
                     tensor_mutation(header), stream)


def describe(h: Hostile) -> str:
    return json.dumps({"kind": h.kind, "header": {k: repr(v)[:80] for k, v in h.header.items()}})
