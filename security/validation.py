"""Checks on everything a silo sends, made before any of it touches the hub's state.

Plain functions over plain values (no gRPC, no hub), so the hub core calls them and tests and the fuzzer drive
them directly. Each failure raises :class:`Invalid` with a gRPC status name, a low-cardinality ``reason`` (the
hub counts refusals by it) and a message that says what is wrong without echoing attacker-sized input.

Status codes, by rule:
- INVALID_ARGUMENT: the message is malformed or not what was planned (bad id, header, stream order, checksum,
  payload, tensor names/shapes/dtypes, NaN/inf, weight, update norm, metrics).
- RESOURCE_EXHAUSTED: a size cap is exceeded (upload bytes, metrics entries). gRPC itself answers
  RESOURCE_EXHAUSTED to any single message over the hub's message cap (wire.chunk_bytes + 64 KiB).
- FAILED_PRECONDITION: the round the upload belongs to closed while it streamed (the hub adds the other
  state-dependent checks: run, task, round, sampled, duplicate).
"""

from __future__ import annotations

import hashlib
import math
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from safetensors.torch import load as st_load

from silo_core.tensors import DTYPE_NAMES, DTYPES, TensorSpec

# Caps on the small fields of every request. Ids the hub hands out are far shorter (run ids are 32 hex digits).
MAX_ID_CHARS = 128
MAX_TEXT_CHARS = 64  # device, client version, each capability, each metric name
MAX_CAPABILITIES = 32
MAX_METRICS = 64
MAX_METRIC_ABS = 1e15  # metrics are counts, losses, seconds: anything bigger is garbage that would swamp sums
MAX_IMAGES = 10**9  # per silo, as declared at Join
MAX_ROUND = 2**31 - 1

_ID_RE = re.compile(r"[A-Za-z0-9._-]*")
_TEXT_RE = re.compile(r"[\x20-\x7e]*")  # printable ASCII: nothing that could forge a log line
_METRIC_RE = re.compile(r"[A-Za-z0-9._/-]+")
_SHA256_RE = re.compile(r"[0-9a-f]{64}")


class Invalid(Exception):
    """A message the hub will not act on; ``code`` is a gRPC status name, ``reason`` a counter label."""

    def __init__(self, code: str, reason: str, message: str):
        super().__init__(message)
        self.code, self.reason, self.message = code, reason, message


def _bad(reason: str, message: str) -> Invalid:
    return Invalid("INVALID_ARGUMENT", reason, message)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


# ------------------------------------------------------------------------------------------------ small fields


def check_id(field: str, value: Any, reason: str = "bad_request") -> str:
    """An id the hub handed out (run id, task id): at most 128 characters from A-Z a-z 0-9 . _ -."""
    if not isinstance(value, str) or len(value) > MAX_ID_CHARS or not _ID_RE.fullmatch(value):
        raise _bad(reason, f"{field} must be at most {MAX_ID_CHARS} characters from A-Z a-z 0-9 . _ - "
                           "(send back the value the hub gave you)")
    return value


def check_text(field: str, value: Any, reason: str = "bad_request") -> str:
    if not isinstance(value, str) or len(value) > MAX_TEXT_CHARS or not _TEXT_RE.fullmatch(value):
        raise _bad(reason, f"{field} must be at most {MAX_TEXT_CHARS} printable ASCII characters")
    return value


def check_count(field: str, value: Any, reason: str = "bad_request") -> int:
    if not _is_int(value) or not 0 <= value <= MAX_IMAGES:
        raise _bad(reason, f"{field} must be an integer from 0 to {MAX_IMAGES}")
    return value


def check_join(num_unlabeled: Any, num_labeled: Any, device: Any, skipped_images: Any) -> None:
    """The JoinRequest fields the hub keeps: counts in range, a short printable device name."""
    check_count("num_unlabeled", num_unlabeled)
    check_count("num_labeled", num_labeled)
    check_count("skipped_images", skipped_images)
    check_text("device", device)


def check_client_info(client_version: Any, capabilities: Iterable[Any]) -> None:
    """The JoinRequest fields the hub only logs or ignores: still bounded, so they cannot flood anything."""
    check_text("client_version", client_version)
    caps = list(capabilities)
    if len(caps) > MAX_CAPABILITIES:
        raise _bad("bad_request", f"at most {MAX_CAPABILITIES} capabilities")
    for c in caps:
        check_text("capability", c)


# ----------------------------------------------------------------------------------------------------- upload


@dataclass(frozen=True)
class UploadHeader:
    run_id: str
    task_id: str
    round: int
    total_bytes: int
    sha256: str
    skipped: bool
    metrics: dict[str, float]


def check_upload_header(header: Mapping[str, Any]) -> UploadHeader:
    """The UploadHeader as plain values, every field typed and bounded; Invalid otherwise."""
    if not isinstance(header, Mapping):
        raise _bad("bad_header", "the upload header is missing")
    run_id = check_id("run_id", header.get("run_id", ""), "bad_header")
    task_id = check_id("task_id", header.get("task_id", ""), "bad_header")
    rnd, total = header.get("round", -1), header.get("total_bytes", -1)
    if not _is_int(rnd) or not 0 <= rnd <= MAX_ROUND:
        raise _bad("bad_header", f"round must be an integer from 0 to {MAX_ROUND}")
    if not _is_int(total) or total < 0:
        raise _bad("bad_header", "total_bytes must be a non-negative integer")
    sha = header.get("sha256", "")
    if not isinstance(sha, str) or not _SHA256_RE.fullmatch(sha):
        raise _bad("bad_header", "sha256 must be 64 lower-case hex digits (the digest of the whole payload)")
    skipped = header.get("skipped", False)
    if not isinstance(skipped, bool):
        raise _bad("bad_header", "skipped must be true or false")
    if skipped and total != 0:
        raise _bad("bad_header", "a skipped upload carries no tensors: total_bytes must be 0")
    return UploadHeader(run_id, task_id, rnd, total, sha, skipped, check_metrics(header.get("metrics", {})))


def check_metrics(metrics: Any) -> dict[str, float]:
    """At most 64 named, finite, bounded numbers (they are summed over silos and land in the history)."""
    if not isinstance(metrics, Mapping):
        raise _bad("bad_metrics", "metrics must be a map of names to numbers")
    if len(metrics) > MAX_METRICS:
        raise Invalid("RESOURCE_EXHAUSTED", "oversized", f"at most {MAX_METRICS} metrics per upload")
    out: dict[str, float] = {}
    for key, value in metrics.items():
        if not isinstance(key, str) or len(key) > MAX_TEXT_CHARS or not _METRIC_RE.fullmatch(key):
            raise _bad("bad_metrics", f"metric names must be 1-{MAX_TEXT_CHARS} characters from A-Z a-z 0-9 . _ / -")
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise _bad("bad_metrics", f"metric {key} is not a number")
        if not math.isfinite(value) or abs(value) > MAX_METRIC_ABS:
            raise _bad("bad_metrics", f"metric {key} is NaN, infinite or beyond {MAX_METRIC_ABS:g}")
        out[key] = float(value)
    return out


def planned_upload_bytes(expected: Mapping[str, TensorSpec]) -> int:
    """The most bytes a safetensors payload of exactly these tensors can take: their numbers plus a generous
    allowance for the JSON header (name, dtype, shape and offsets of each tensor)."""
    data = sum(math.prod(spec.shape) * DTYPES[spec.dtype].itemsize for spec in expected.values())
    header = sum(len(name.encode()) + 64 + 24 * len(spec.shape) for name, spec in expected.items())
    return 8 + 1024 + header + data


def check_upload_size(total_bytes: int, max_bytes: int, expected: Mapping[str, TensorSpec] | None = None) -> None:
    """Refuse an announced size over the hub's cap, or (given the planned tensors) over what they can take."""
    if total_bytes > max_bytes:
        raise Invalid("RESOURCE_EXHAUSTED", "oversized",
                      f"upload of {total_bytes} bytes exceeds this hub's cap of {max_bytes} bytes (wire.max_upload_bytes)")
    if expected is not None and total_bytes > (planned := planned_upload_bytes(expected)):
        raise Invalid("RESOURCE_EXHAUSTED", "oversized",
                      f"upload of {total_bytes} bytes is larger than the {planned} bytes the round's planned tensors "
                      "can take; send exactly the tensors of the round's plan")


def read_stream(
    total_bytes: int,
    sha256: str,
    chunks: Iterable[tuple[Any, Any]],
    max_bytes: int,
    still_open: Callable[[], bool] = lambda: True,
) -> bytes:
    """Reassemble (offset, data) chunks into exactly ``total_bytes`` bytes whose sha256 is ``sha256``.

    Refuses early, before buffering more: an announced size over ``max_bytes``, a chunk past the announced size,
    empty chunks (a stream of them would never end), gaps and overlaps, and a round that closed meanwhile. A source
    that waits for its next chunk (the gRPC stream) is told ``still_open`` through its ``stop_waiting_when``, so a
    stream stalled between chunks ends when its round closes, not when the next chunk or the idle limit comes (it
    held its room in the upload budget into the next round meanwhile).
    """
    check_upload_size(total_bytes, max_bytes)
    stop_waiting_when = getattr(chunks, "stop_waiting_when", None)
    if stop_waiting_when is not None:
        stop_waiting_when(still_open)
    buffer = bytearray()
    digest = hashlib.sha256()
    for offset, data in chunks:
        if not still_open():
            raise Invalid("FAILED_PRECONDITION", "stale_task", "the round closed during the upload")
        if not _is_int(offset) or not isinstance(data, bytes | bytearray):
            raise _bad("bad_stream", "a chunk needs an integer offset and bytes")
        if not data:
            raise _bad("bad_stream", "empty chunk; every chunk carries at least one byte")
        if offset != len(buffer):
            raise _bad("bad_stream", f"chunk at offset {offset}, expected {len(buffer)} (chunks go in order, "
                                     "without gaps or overlaps)")
        if len(buffer) + len(data) > total_bytes:
            raise Invalid("RESOURCE_EXHAUSTED", "oversized",
                          f"the stream is longer than the {total_bytes} bytes its header announced")
        buffer.extend(data)
        digest.update(data)
    if len(buffer) != total_bytes:
        raise _bad("bad_stream", f"the stream ended after {len(buffer)} of {total_bytes} announced bytes")
    if digest.hexdigest() != sha256:
        raise _bad("bad_checksum", "sha256 of the received bytes does not match the header")
    return bytes(buffer)


def decode_tensors(payload: bytes) -> dict[str, torch.Tensor]:
    """safetensors bytes -> named tensors; never unpickles, and any malformed payload is Invalid."""
    try:
        return dict(st_load(bytes(payload)))
    except Exception:  # safetensors raises several error types for malformed input
        raise _bad("bad_payload", "the payload is not a valid safetensors file") from None


def check_update(
    tensors: Mapping[str, torch.Tensor],
    expected: Mapping[str, TensorSpec],
    max_update_norm: float | None = None,
    max_weight: float | None = None,
    groups: Mapping[str, Sequence[str]] | None = None,
    unit_weight: bool = False,
) -> None:
    """Exactly the planned tensors, all finite, a sane weight, and an update norm within the bound.

    Convention shared by the algorithms: tensors named ``delta/<param>`` hold ``weight * (local - global)`` and
    a scalar ``weight`` (shape (1,)) holds the silo's weight. Under uniform averaging (``unit_weight``, the
    plan's ``RoundPlan.unit_weight``) the weight must be exactly 1. Otherwise it must be positive (a zero or
    negative one would shrink or flip the hub's division by the summed weights) and at most ``max_weight`` (the
    images the silo declared when it first joined). The update norm is the L2 norm over all ``delta/*`` tensors
    divided by the weight: the size of the silo's own model change, whatever its weight.

    With ``groups`` (``RoundPlan.groups``: group -> names, a partition of ``expected``) a result may hold any
    non-empty set of WHOLE groups (a site uploads only the models it trained), and the weight and norm rules apply
    per group, to ``<group>/weight`` and ``<group>/delta/*``.
    """
    prefixes = [""]
    if groups:
        present = [g for g, names in groups.items() if any(n in tensors for n in names)]
        if not present:
            raise _bad("bad_tensors", "the result holds none of the planned tensor groups")
        for g in present:
            lacking = [n for n in groups[g] if n not in tensors]
            if lacking:
                raise _bad("bad_tensors", f"group {g} is incomplete: missing {', '.join(lacking[:5])}")
        expected = {n: expected[n] for g in present for n in groups[g]}
        prefixes = [f"{g}/" for g in present]
    missing, extra = sorted(set(expected) - set(tensors)), sorted(set(tensors) - set(expected))
    if missing or extra:
        parts = ([f"missing {', '.join(missing[:5])}"] if missing else []) + (
            [f"{len(extra)} unexpected tensor(s)"] if extra else [])
        raise _bad("bad_tensors", f"tensors are not the ones planned for this round: {'; '.join(parts)}")
    for name, spec in expected.items():
        t = tensors[name]
        if tuple(t.shape) != tuple(spec.shape):
            raise _bad("bad_tensors", f"tensor {name} has shape {tuple(t.shape)}, expected {tuple(spec.shape)}")
        if DTYPE_NAMES.get(t.dtype) != spec.dtype:
            raise _bad("bad_tensors", f"tensor {name} has dtype {DTYPE_NAMES.get(t.dtype, 'unknown')}, "
                                      f"expected {spec.dtype}")
    for name, t in tensors.items():
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            raise _bad("non_finite", f"tensor {name} holds NaN or infinite values")
    for prefix in prefixes:
        _check_weight_and_norm(tensors, prefix, max_update_norm, max_weight, unit_weight)


def _check_weight_and_norm(tensors: Mapping[str, torch.Tensor], prefix: str, max_update_norm: float | None,
                           max_weight: float | None, unit_weight: bool) -> None:
    weight = 1.0
    if f"{prefix}weight" in tensors and tensors[f"{prefix}weight"].numel() == 1:
        weight = float(tensors[f"{prefix}weight"].double().item())
        if unit_weight and weight != 1.0:
            raise _bad("bad_weight", f"weight must be exactly 1 in this run (uniform averaging), got {weight:g}")
        if weight <= 0:
            raise _bad("bad_weight", f"weight must be positive, got {weight:g}")
        if max_weight is not None and weight > max_weight:
            raise _bad("bad_weight", f"weight {weight:g} exceeds the {max_weight:g} images this silo declared at Join")
    if max_update_norm is not None:
        squares = sum(float(t.double().square().sum()) for n, t in tensors.items()
                      if n.startswith(f"{prefix}delta/") and t.is_floating_point())
        norm = math.sqrt(squares) / weight
        if not norm <= max_update_norm:  # also catches a norm that overflowed to inf
            raise _bad("update_norm", f"update norm {norm:.4g} exceeds this hub's bound of {max_update_norm:g} "
                                      "(security.max_update_norm)")


# ------------------------------------------------------------------------------------- weights across a round


def weight_cap(declared: Mapping[str, int], factor: float) -> dict[str, float]:
    """The most weight each sampled silo may carry in a round: its own declared images, and never more than
    ``factor`` times the median declared by the round's sampled silos, so that no single silo can own the mean."""
    if not declared:
        return {}
    counts = sorted(max(1, n) for n in declared.values())
    mid = len(counts) // 2
    median = counts[mid] if len(counts) % 2 else (counts[mid - 1] + counts[mid]) / 2
    return {s: float(min(max(1, n), factor * median)) for s, n in declared.items()}


def cap_weight(tensors: dict[str, torch.Tensor], cap: float, prefixes: Sequence[str] = ("",)) -> float:
    """Scale ``<prefix>weight`` and ``<prefix>delta/*`` down together so the weight is at most ``cap``: the silo's
    model change is kept, only its share of the mean shrinks. Returns the smallest factor applied (1: untouched)."""
    smallest = 1.0
    for prefix in prefixes:
        w = tensors.get(f"{prefix}weight")
        if w is None or w.numel() != 1 or float(w.double().item()) <= cap:
            continue
        factor = cap / float(w.double().item())
        for name in list(tensors):
            if name == f"{prefix}weight" or name.startswith(f"{prefix}delta/"):
                tensors[name] = (tensors[name].double() * factor).to(tensors[name].dtype)
        tensors[f"{prefix}weight"] = torch.tensor([cap], dtype=w.dtype)
        smallest = min(smallest, factor)
    return smallest


def weight_prefixes(names: Iterable[str]) -> list[str]:
    """The prefixes under which a result carries a weight: "" for ``weight``, "S/" for ``S/weight``, ..."""
    return sorted(n[: -len("weight")] for n in names if n == "weight" or n.endswith("/weight"))


def check_aggregate(
    summed: Mapping[str, torch.Tensor],
    contributors: int,
    *,
    unit_weight: bool,
    max_weight_sum: float,
    max_update_norm: float | None,
    tolerance: Callable[[str], float],
) -> None:
    """What the hub can still check when it only sees a round's SUM (secure aggregation).

    For each weight (``weight``, or ``<group>/weight``): the sum lies in [0, ``max_weight_sum``]; under uniform
    averaging it is a whole number of silos (each sends 1, or 0 when it skips), at most ``contributors``. With
    ``max_update_norm`` the summed update obeys the bound every honest silo obeys: ||sum of deltas|| <= bound *
    sum of weights. ``tolerance(name)`` is the largest error fixed-point quantization may add to one element of
    the named sum. Raises Invalid (reason ``bad_aggregate``) naming the rule that failed.
    """
    for prefix in weight_prefixes(summed):
        name = f"{prefix}weight"
        total = float(summed[name].double().sum())
        tol = tolerance(name)
        if not math.isfinite(total) or total < -tol or total > max_weight_sum + tol:
            raise Invalid("INVALID_ARGUMENT", "bad_aggregate",
                          f"the summed {name} is {total:.6g}, outside [0, {max_weight_sum:g}] for {contributors} "
                          "silos: a silo sent a weight it may not send")
        if unit_weight and (abs(total - round(total)) > tol or round(total) > contributors):
            raise Invalid("INVALID_ARGUMENT", "bad_aggregate",
                          f"the summed {name} is {total:.6g}; with uniform averaging it must be a whole number of "
                          f"silos from 0 to {contributors}: a silo sent a weight other than 1")
        if max_update_norm is not None:
            deltas = [n for n in summed if n.startswith(f"{prefix}delta/")]
            squares = sum(float(summed[n].double().square().sum()) for n in deltas)
            slack = math.sqrt(sum(summed[n].numel() * tolerance(n) ** 2 for n in deltas))
            norm, bound = math.sqrt(squares), max_update_norm * max(total, 0.0)
            if not norm <= bound + slack:
                raise Invalid("INVALID_ARGUMENT", "bad_aggregate",
                              f"the summed {prefix}delta has norm {norm:.6g}, above {max_update_norm:g} x the summed "
                              f"weight {total:.6g} (security.max_update_norm): a silo sent a larger update")


# -------------------------------------------------------------------------------------------- peer text in logs

MAX_PEER_TEXT = 200


def printable(text: Any, limit: int = MAX_PEER_TEXT) -> str:
    """A peer-supplied string made safe to log or echo: anything but printable ASCII escaped (so a newline cannot
    start a forged log line) and cut to ``limit`` characters."""
    if isinstance(text, bytes | bytearray):
        text = bytes(text[: limit * 4]).decode("utf-8", errors="replace")
    text = str(text)
    cut = len(text) > limit
    safe = "".join(c if " " <= c <= "~" else c.encode("unicode_escape").decode("ascii") for c in text[:limit])
    return safe[:limit] + ("..." if cut else "")
