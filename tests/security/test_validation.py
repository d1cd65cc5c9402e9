"""security.validation on its own: exact rules, precise reasons and codes, and random input that can only ever
produce a valid result or an Invalid (never another exception)."""

from __future__ import annotations

import hashlib
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from security import validation as v
from silo_core.tensors import TensorSpec, encode

PLAN = {"delta/w": TensorSpec((2, 2), "float32"), "weight": TensorSpec((1,), "float32")}


def _header(**kw):
    base = {"run_id": "run1", "task_id": "t-r1-a1-abc", "round": 1, "total_bytes": 0,
            "sha256": hashlib.sha256(b"").hexdigest(), "skipped": True, "metrics": {"n": 2}}
    return {**base, **kw}


def _invalid(call) -> v.Invalid:
    with pytest.raises(v.Invalid) as info:
        call()
    return info.value


def test_a_good_header_comes_back_typed() -> None:
    h = v.check_upload_header(_header())
    assert h == v.UploadHeader("run1", "t-r1-a1-abc", 1, 0, hashlib.sha256(b"").hexdigest(), True, {"n": 2.0})
    assert isinstance(h.metrics["n"], float)


@pytest.mark.parametrize("change, reason, code", [
    ({"run_id": "r" * 129}, "bad_header", "INVALID_ARGUMENT"),
    ({"task_id": "t\nINFO forged log line"}, "bad_header", "INVALID_ARGUMENT"),
    ({"round": -1}, "bad_header", "INVALID_ARGUMENT"),
    ({"round": True}, "bad_header", "INVALID_ARGUMENT"),
    ({"total_bytes": 5}, "bad_header", "INVALID_ARGUMENT"),  # skipped with bytes
    ({"sha256": "A" * 64}, "bad_header", "INVALID_ARGUMENT"),
    ({"skipped": "no"}, "bad_header", "INVALID_ARGUMENT"),
    ({"metrics": {"loss": math.nan}}, "bad_metrics", "INVALID_ARGUMENT"),
    ({"metrics": {"loss": 1e16}}, "bad_metrics", "INVALID_ARGUMENT"),
    ({"metrics": {"bad key": 1.0}}, "bad_metrics", "INVALID_ARGUMENT"),
    ({"metrics": {"x" * 65: 1.0}}, "bad_metrics", "INVALID_ARGUMENT"),
    ({"metrics": {f"m{i}": 0.0 for i in range(65)}}, "oversized", "RESOURCE_EXHAUSTED"),
])
def test_header_rules(change, reason, code) -> None:
    e = _invalid(lambda: v.check_upload_header(_header(**change)))
    assert (e.reason, e.code) == (reason, code)
    assert "forged" not in e.message and "x" * 65 not in e.message  # never echoes what it refuses


def test_metrics_at_the_caps_pass() -> None:
    assert len(v.check_metrics({f"m{i}": 1e15 for i in range(64)})) == 64
    assert v.check_metrics({"a/b.c-d_e": -1e15}) == {"a/b.c-d_e": -1e15}


def test_stream_rules() -> None:
    data = b"0123456789"
    sha = hashlib.sha256(data).hexdigest()
    assert v.read_stream(10, sha, [(0, data[:4]), (4, data[4:])], 100) == data
    cases = [
        ((200, sha, [], 100), "oversized", "RESOURCE_EXHAUSTED"),
        ((10, sha, [(0, data), (10, b"x")], 100), "oversized", "RESOURCE_EXHAUSTED"),
        ((10, sha, [(0, b"")], 100), "bad_stream", "INVALID_ARGUMENT"),
        ((10, sha, [(4, data[4:]), (0, data[:4])], 100), "bad_stream", "INVALID_ARGUMENT"),
        ((10, sha, [(0, data[:4])], 100), "bad_stream", "INVALID_ARGUMENT"),
        ((10, "0" * 64, [(0, data)], 100), "bad_checksum", "INVALID_ARGUMENT"),
    ]
    for args, reason, code in cases:
        e = _invalid(lambda args=args: v.read_stream(*args))
        assert (e.reason, e.code) == (reason, code), args
    e = _invalid(lambda: v.read_stream(10, sha, [(0, data)], 100, still_open=lambda: False))
    assert (e.reason, e.code) == ("stale_task", "FAILED_PRECONDITION")


def test_update_rules() -> None:
    good = {"delta/w": torch.tensor([[3.0, 0.0], [0.0, 4.0]]), "weight": torch.tensor([1.0])}
    v.check_update(good, PLAN, max_update_norm=5.0, max_weight=1.0)
    for tensors, reason in (
        ({**good, "extra": torch.zeros(1)}, "bad_tensors"),
        ({"delta/w": good["delta/w"]}, "bad_tensors"),
        ({**good, "delta/w": torch.zeros(4)}, "bad_tensors"),
        ({**good, "delta/w": torch.zeros(2, 2, dtype=torch.float64)}, "bad_tensors"),
        ({**good, "delta/w": torch.tensor([[math.inf, 0.0], [0.0, 0.0]])}, "non_finite"),
        ({**good, "weight": torch.tensor([0.0])}, "bad_weight"),
        ({**good, "weight": torch.tensor([2.0])}, "bad_weight"),  # over max_weight
        ({**good, "delta/w": good["delta/w"] * 1.01}, "update_norm"),
    ):
        e = _invalid(lambda t=tensors: v.check_update(t, PLAN, max_update_norm=5.0, max_weight=1.0))
        assert (e.reason, e.code) == (reason, "INVALID_ARGUMENT"), tensors
    # No bound configured: only the structure and values are checked.
    v.check_update({**good, "delta/w": good["delta/w"] * 1e6}, PLAN)


def test_join_and_client_info_rules() -> None:
    v.check_join(0, 10**9, "cuda:0", 3)
    v.check_client_info("0.1.0", ["semifl"] * 32)
    for call in (lambda: v.check_join(-1, 0, "cpu", 0), lambda: v.check_join(0, 0, "c\x00pu", 0),
                 lambda: v.check_join(0, 0, "cpu", 10**9 + 1), lambda: v.check_client_info("v" * 65, []),
                 lambda: v.check_client_info("", ["x"] * 33), lambda: v.check_client_info("", ["\n"])):
        assert _invalid(call).reason == "bad_request"


# -------------------------------------------------------------------------------------------------- random input

_ANY = st.recursive(st.one_of(st.none(), st.booleans(), st.integers(), st.floats(), st.text(max_size=80),
                              st.binary(max_size=20)),
                    lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=8), inner,
                                                                                         max_size=3)), max_leaves=8)


@settings(max_examples=300, deadline=None)
@given(header=st.one_of(_ANY, st.dictionaries(st.sampled_from(["run_id", "task_id", "round", "total_bytes",
                                                                "sha256", "skipped", "metrics"]), _ANY)))
def test_fuzz_header_is_typed_or_invalid(header) -> None:
    try:
        h = v.check_upload_header(header)
    except v.Invalid as e:
        assert e.code in ("INVALID_ARGUMENT", "RESOURCE_EXHAUSTED") and e.reason
        return
    assert isinstance(h.round, int) and 0 <= h.round and isinstance(h.total_bytes, int) and h.total_bytes >= 0
    assert len(h.sha256) == 64 and all(math.isfinite(x) for x in h.metrics.values()) and len(h.metrics) <= 64


@settings(max_examples=300, deadline=None)
@given(total=st.integers(-5, 300), chunks=st.lists(st.tuples(st.one_of(st.integers(-5, 300), st.none(), st.text()),
                                                             st.one_of(st.binary(max_size=80), st.text(max_size=3))),
                                                   max_size=6))
def test_fuzz_stream_is_exact_or_invalid(total, chunks) -> None:
    joined = b"".join(d for _, d in chunks if isinstance(d, bytes))
    sha = hashlib.sha256(joined).hexdigest()
    try:
        out = v.read_stream(total, sha, chunks, max_bytes=256)
    except v.Invalid as e:
        assert e.reason in ("oversized", "bad_stream", "bad_checksum")
        return
    assert out == joined and len(out) == total <= 256


@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_fuzz_payload_decodes_to_the_plan_or_is_invalid(data) -> None:
    good = encode({"delta/w": torch.ones(2, 2), "weight": torch.ones(1)})
    payload = data.draw(st.one_of(
        st.binary(max_size=300),
        st.builds(lambda i, b: good[:i] + bytes([b]) + good[i + 1:], st.integers(0, len(good) - 1),
                  st.integers(0, 255)),
        st.builds(lambda i: good[:i], st.integers(0, len(good))),
    ))
    try:
        tensors = v.decode_tensors(payload)
        v.check_update(tensors, PLAN, max_update_norm=100.0, max_weight=10.0)
    except v.Invalid as e:
        assert e.reason in ("bad_payload", "bad_tensors", "non_finite", "bad_weight", "update_norm")
        return
    # Accepted: then it really is the plan, finite, with a sane weight (a flipped data byte can be all of that).
    assert {k: tuple(t.shape) for k, t in tensors.items()} == {"delta/w": (2, 2), "weight": (1,)}
    assert all(bool(torch.isfinite(t).all()) for t in tensors.values()) and 0 < float(tensors["weight"]) <= 10
