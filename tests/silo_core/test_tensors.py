import hashlib

import pytest
import torch

from silo_core.tensors import (
    ChunkAssembler,
    CodecError,
    TensorSpec,
    assemble,
    check_tensors,
    decode,
    encode,
    iter_chunks,
    sha256_hex,
)


def sample():
    g = torch.Generator().manual_seed(0)
    return {"model/w": torch.randn(64, 33, generator=g), "model/b": torch.arange(7, dtype=torch.int64),
            "weight": torch.tensor([3.0])}


def test_round_trip_keeps_names_values_and_dtypes():
    tensors = sample()
    back = decode(encode(tensors))
    assert set(back) == set(tensors)
    for k in tensors:
        assert back[k].dtype == tensors[k].dtype
        assert torch.equal(back[k], tensors[k])


def test_half_precision_halves_float_payload_and_stays_close():
    t = {"w": torch.randn(1000, 100)}
    full, half = encode(t), encode(t, half=True)
    assert len(half) < 0.55 * len(full)
    back = decode(half)["w"]
    assert back.dtype == torch.float16
    assert torch.allclose(back.float(), t["w"], atol=2e-3, rtol=1e-3)


def test_chunking_splits_at_the_size_and_reassembles_exactly():
    payload = encode({"w": torch.randn(300_000)})  # ~1.2 MB
    chunks = list(iter_chunks(payload, 1 << 20))
    assert [len(c) for _, c in chunks] == [1 << 20, len(payload) - (1 << 20)]
    assert [o for o, _ in chunks] == [0, 1 << 20]
    assert assemble(chunks, len(payload), sha256_hex(payload), max_bytes=len(payload)) == payload
    assert sha256_hex(payload) == hashlib.sha256(payload).hexdigest()


def test_corruption_is_detected_by_the_digest():
    payload = encode(sample())
    chunks = list(iter_chunks(payload, 100))
    offset, data = chunks[3]
    chunks[3] = (offset, bytes([data[0] ^ 1]) + data[1:])
    with pytest.raises(CodecError, match="sha256"):
        assemble(chunks, len(payload), sha256_hex(payload), max_bytes=10**6)


def test_gaps_overruns_and_short_streams_are_refused():
    payload = encode(sample())
    chunks = list(iter_chunks(payload, 100))
    with pytest.raises(CodecError, match="offset"):
        assemble([chunks[0], chunks[2]], len(payload), sha256_hex(payload), 10**6)
    with pytest.raises(CodecError, match="longer"):
        assemble(chunks, len(payload) - 1, sha256_hex(payload), 10**6)
    with pytest.raises(CodecError, match="ended after"):
        assemble(chunks[:-1], len(payload), sha256_hex(payload), 10**6)
    with pytest.raises(CodecError, match="outside"):
        ChunkAssembler(10**7, max_bytes=10**6)


def test_garbage_is_not_safetensors():
    with pytest.raises(CodecError, match="not valid safetensors"):
        decode(b"\x00" * 64)
    with pytest.raises(CodecError, match="exceeds"):
        decode(b"\x00" * 64, max_bytes=10)


def test_check_tensors_refuses_names_shapes_dtypes_and_nan():
    t = {"a": torch.zeros(2, 3), "b": torch.zeros(1)}
    spec = {"a": TensorSpec((2, 3), "float32"), "b": TensorSpec((1,), "float32")}
    check_tensors(t, spec)
    with pytest.raises(CodecError, match="missing"):
        check_tensors({"a": t["a"]}, spec)
    with pytest.raises(CodecError, match="unexpected"):
        check_tensors({**t, "c": torch.zeros(1)}, spec)
    with pytest.raises(CodecError, match="shape"):
        check_tensors({**t, "a": torch.zeros(3, 2)}, spec)
    with pytest.raises(CodecError, match="dtype"):
        check_tensors({**t, "a": torch.zeros(2, 3, dtype=torch.float64)}, spec)
    bad = torch.zeros(2, 3)
    bad[1, 2] = float("nan")
    with pytest.raises(CodecError, match="NaN"):
        check_tensors({**t, "a": bad}, spec)


GROUPED = {
    "S/delta/w": TensorSpec((2, 3), "float32"), "S/count": TensorSpec((2,), "float32"),
    "U/delta/w": TensorSpec((2, 3), "float32"), "U/count": TensorSpec((2,), "float32"),
}
GROUPS = {"S": ["S/delta/w", "S/count"], "U": ["U/delta/w", "U/count"]}


def grouped(*names):
    return {n: torch.zeros(GROUPED[n].shape) for n in names}


def test_check_tensors_with_groups_accepts_any_union_of_whole_groups():
    check_tensors(grouped("S/delta/w", "S/count"), GROUPED, GROUPS)
    check_tensors(grouped("U/delta/w", "U/count"), GROUPED, GROUPS)
    check_tensors(grouped(*GROUPED), GROUPED, GROUPS)


@pytest.mark.parametrize("tensors, message", [
    (grouped("S/delta/w"), "group S is incomplete: missing S/count"),
    (grouped("S/delta/w", "S/count", "U/count"), "group U is incomplete: missing U/delta/w"),
    ({}, "none of the planned groups"),
    ({**grouped("S/delta/w", "S/count"), "X/w": torch.zeros(1)}, "unexpected tensors: X/w"),
    ({**grouped("S/count"), "S/delta/w": torch.zeros(3, 2)}, "shape"),
    ({**grouped("U/delta/w"), "U/count": torch.tensor([1.0, float("inf")])}, "NaN or infinite"),
])
def test_check_tensors_with_groups_refuses_partial_groups_strangers_and_bad_values(tensors, message):
    with pytest.raises(CodecError, match=message):
        check_tensors(tensors, GROUPED, GROUPS)


def test_without_groups_a_subset_is_still_refused():
    with pytest.raises(CodecError, match="missing tensors"):
        check_tensors(grouped("S/delta/w", "S/count"), GROUPED)


def test_a_float16_tensor_that_overflowed_names_the_half_precision_setting():
    # A delta times a silo's image count can pass float16's 65504 under wire.half_precision: the cast gives inf,
    # and "NaN or infinite values" alone did not say where they came from or what to change.
    spec = {"delta/x": TensorSpec((3,), "float16")}
    with pytest.raises(CodecError, match=r"float16, as wire.half_precision sends it, ends at \+-65504"):
        check_tensors({"delta/x": torch.full((3,), 70000.0).to(torch.float16)}, spec)
    with pytest.raises(CodecError) as plain:
        check_tensors({"delta/x": torch.tensor([1.0, float("nan"), 2.0])}, {"delta/x": TensorSpec((3,), "float32")})
    assert "half_precision" not in str(plain.value)
