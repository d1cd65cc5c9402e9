"""SecAgg+: masks cancel, sums are exact under dropouts at every stage up to the threshold, below it the round is
refused, tampering is detected, a masked update looks uniform, quantization stays within its bound."""

import json
import random

import numpy as np
import pytest
import torch
from scipy.stats import chi2

from security.secagg import (
    CapacityError,
    HubSession,
    ProtocolError,
    QuantizationRule,
    RoundAbandoned,
    Rule,
    SecAggError,
    SecAggParams,
    SiloSession,
    check_capacity,
    max_silos,
    shamir,
)
from security.secagg import messages as msg
from security.secagg.graph import degree_for, neighbour_graph, threshold_for
from security.secagg.inprocess import Costs, aggregate
from security.secagg.quantize import decode_sum, encode, rounding_generator

PARAMS = SecAggParams(enabled=True, quantization=[QuantizationRule(pattern="*", clip=1.0, bits=16)])


def make_inputs(n: int, size: int = 300, seed: int = 0) -> dict[str, dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return {f"silo-{i:02d}": {"delta/w": (torch.rand(size, generator=g) * 2 - 1) * 0.9,
                              "delta/b": (torch.rand(3, 2, generator=g) * 2 - 1) * 0.9,
                              "weight": torch.ones(1)}
            for i in range(n)}


def exact_levels_sum(trace: Costs, contributors: list[str], bits: int) -> np.ndarray:
    total = np.zeros_like(trace.silos[contributors[0]].levels)
    for i in contributors:
        np.add(total, trace.silos[i].levels, out=total)
    return total


def flat(sums: dict[str, np.ndarray]) -> np.ndarray:
    return np.concatenate([sums[k].reshape(-1) for k in sorted(sums)])


def test_masks_cancel_exactly_without_dropouts():
    inputs = make_inputs(6)
    trace = Costs()
    result = aggregate(inputs, PARAMS, costs=trace)
    assert result.contributors == sorted(inputs)
    # Every pairwise and self mask is gone: the integer sum equals the sum of the encoded levels bit for bit.
    assert np.array_equal(flat(result.integer_sums), exact_levels_sum(trace, result.contributors, 32))
    true = sum(x["delta/w"].double() for x in inputs.values())
    rule = Rule("*", 1.0, 16)
    assert float((result.sums["delta/w"] - true).abs().max()) <= rule.error_bound(6)
    assert float(result.sums["weight"]) == pytest.approx(6.0, abs=rule.error_bound(6))


def _masked_payload(n: int = 5, size: int = 40_000) -> tuple[bytes, np.ndarray]:
    inputs = make_inputs(n, size=size)
    ids = sorted(inputs)
    shapes = {k: tuple(v.shape) for k, v in inputs[ids[0]].items()}
    hub = HubSession("chi", ids, PARAMS, shapes, rng=random.Random(1))
    silos = {i: SiloSession("chi", i, rounding_seed=3, keep_levels=True) for i in ids}
    for i in ids:
        hub.receive_keys(i, silos[i].advertise_keys())
    rosters = hub.close_advertise()
    for i in ids:
        hub.receive_shares(i, silos[i].share_keys(rosters[i]))
    inboxes = hub.close_share_keys()
    payload = silos[ids[0]].masked_input(inboxes[ids[0]], inputs[ids[0]])
    return payload, silos[ids[0]].levels


def chi_square_bytes(data: bytes) -> float:
    counts = np.bincount(np.frombuffer(data, dtype=np.uint8), minlength=256).astype(np.float64)
    expected = len(data) / 256
    return float(((counts - expected) ** 2 / expected).sum())


def test_a_single_masked_update_is_indistinguishable_from_uniform_bytes():
    payload, levels = _masked_payload()
    arrays = msg.parse_masked(payload, "chi", "silo-00",
                              {"delta/b": (3, 2), "delta/w": (40_000,), "weight": (1,)}, np.dtype(np.uint32), 1 << 30)
    masked = b"".join(arrays[k].tobytes() for k in sorted(arrays))
    # chi-square with 255 degrees of freedom; a false alarm at p < 1e-6 would take a million runs
    assert chi2.sf(chi_square_bytes(masked), 255) > 1e-6
    # the same test has power: the quantized input itself is wildly non-uniform
    assert chi_square_bytes(levels.tobytes()) > 10_000


@pytest.mark.parametrize("stage", ["advertise_keys", "share_keys", "masked_input", "unmask"])
def test_sum_is_exact_with_a_dropout_at_each_stage(stage):
    inputs = make_inputs(6)
    trace = Costs()
    result = aggregate(inputs, PARAMS, drop={"silo-02": stage}, costs=trace)
    # A silo that vanished before its masked input is simply not in the sum; after it, it is.
    in_sum = stage == "unmask"
    assert ("silo-02" in result.contributors) == in_sum
    assert len(result.contributors) == (6 if in_sum else 5)
    assert np.array_equal(flat(result.integer_sums), exact_levels_sum(trace, result.contributors, 32))
    true = sum(inputs[i]["delta/w"].double() for i in result.contributors)
    assert float((result.sums["delta/w"] - true).abs().max()) <= Rule("*", 1.0, 16).error_bound(6)


def test_the_largest_tolerated_number_of_dropouts_and_one_more():
    # complete graph on 7 silos: k = 6, t = 4. A survivor needs t surviving neighbours: at most 7 - 4 - 1 = 2 drop.
    inputs = make_inputs(7)
    trace = Costs()
    result = aggregate(inputs, PARAMS, drop={"silo-01": "masked_input", "silo-05": "masked_input"}, costs=trace)
    assert (trace.hub.degree, trace.hub.threshold) == (6, 4)
    assert len(result.contributors) == 5
    assert np.array_equal(flat(result.integer_sums), exact_levels_sum(trace, result.contributors, 32))
    # one drop before the masked input and one during unmasking: every secret still has 5 >= t revealers
    result = aggregate(inputs, PARAMS, drop={"silo-01": "masked_input", "silo-05": "unmask"}, costs=(trace := Costs()))
    assert len(result.contributors) == 6 and result.stats["u4"] == 5
    assert np.array_equal(flat(result.integer_sums), exact_levels_sum(trace, result.contributors, 32))
    with pytest.raises(RoundAbandoned, match="fewer than t = 4"):
        aggregate(inputs, PARAMS, drop={i: "masked_input" for i in ["silo-01", "silo-03", "silo-05"]})


@pytest.mark.parametrize("stage", ["advertise_keys", "share_keys", "masked_input", "unmask"])
def test_below_threshold_the_round_is_refused_at_every_stage(stage):
    inputs = make_inputs(7)
    with pytest.raises(RoundAbandoned):
        aggregate(inputs, PARAMS, drop={i: stage for i in ["silo-00", "silo-03", "silo-04"]})


def test_sparse_graph_tolerates_dropouts_per_neighbourhood():
    params = SecAggParams(enabled=True, neighbours=6, threshold=0.6,
                          quantization=[QuantizationRule(pattern="*", clip=1.0, bits=16)])
    inputs = make_inputs(20, size=50)
    trace = Costs()
    # k = 6, t = 4: every survivor must keep 4 of its 6 neighbours.
    base = aggregate(inputs, params, costs=trace, seed=5)
    graph = trace.hub.graph
    assert all(len(graph[i]) == 6 for i in graph) and (trace.hub.degree, trace.hub.threshold) == (6, 4)
    victim = "silo-07"
    two, three = sorted(graph[victim])[:2], sorted(graph[victim])[:3]
    ok = aggregate(inputs, params, drop={j: "masked_input" for j in two}, costs=(trace := Costs()), seed=5)
    assert len(ok.contributors) == 18
    assert np.array_equal(flat(ok.integer_sums), exact_levels_sum(trace, ok.contributors, 32))
    with pytest.raises(RoundAbandoned, match=victim):
        aggregate(inputs, params, drop={j: "masked_input" for j in three}, seed=5)
    # In a ring lattice, losing k - t + 1 of one silo's neighbours always starves another silo too, so pruning
    # cascades; the round is then abandoned, never answered with a wrong sum.
    with pytest.raises(RoundAbandoned, match="left after share_keys"):
        aggregate(inputs, params, drop={j: "share_keys" for j in three}, seed=5)
    assert base.stats["u3"] == 20


def test_a_silo_that_lost_its_neighbourhood_before_sharing_is_left_out_not_the_round():
    inputs = make_inputs(8)
    ids = sorted(inputs)
    shapes = {k: tuple(v.shape) for k, v in inputs[ids[0]].items()}
    hub = HubSession("p", ids, PARAMS, shapes)
    # a hand-made graph: a clique of seven, and silo-07 hanging on four of them
    clique = ids[:7]
    hub.graph = {i: set(clique) - {i} for i in clique}
    hub.graph[ids[7]] = set(ids[:4])
    for j in ids[:4]:
        hub.graph[j].add(ids[7])
    hub.degree, hub.threshold, hub.min_survivors = 7, 4, 4
    silos = {i: SiloSession("p", i, keep_levels=True) for i in ids}
    for i in ids:
        hub.receive_keys(i, silos[i].advertise_keys())
    rosters = hub.close_advertise()
    for i in ids:
        if i not in (ids[2], ids[3]):  # two of silo-07's four neighbours vanish before sharing keys
            hub.receive_shares(i, silos[i].share_keys(rosters[i]))
    inboxes = hub.close_share_keys()
    assert sorted(inboxes) == [ids[0], ids[1], ids[4], ids[5], ids[6]]  # silo-07 pruned: it kept only 2 < t
    for i in inboxes:
        hub.receive_masked_input(i, silos[i].masked_input(inboxes[i], inputs[i]))
    survivors = hub.close_masked_input()
    for i in survivors:
        hub.receive_consistency(i, silos[i].consistency(survivors[i]))
    requests = hub.close_consistency()
    for i in requests:
        hub.receive_unmask(i, silos[i].unmask(requests[i]))
    result = hub.finish()
    assert result.contributors == sorted(inboxes)
    assert np.array_equal(flat(result.integer_sums), sum(silos[i].levels for i in inboxes).astype(np.uint32))


def test_a_tampered_share_is_detected_and_its_recipient_drops_out():
    inputs = make_inputs(6)

    def flip_a_bit(stage: str, recipient: str, payload: bytes) -> bytes:
        if stage != "masked_input" or recipient != "silo-04":
            return payload
        inbox = json.loads(payload)
        sender = sorted(inbox["shares"])[0]
        raw = bytearray(msg.unb64(inbox["shares"][sender]))
        raw[20] ^= 1
        inbox["shares"][sender] = msg.b64(bytes(raw))
        return json.dumps(inbox).encode()

    trace = Costs()
    result = aggregate(inputs, PARAMS, tamper=flip_a_bit, costs=trace)
    assert "failed authentication" in trace.aborted["silo-04"]
    assert "silo-04" not in result.contributors and len(result.contributors) == 5
    assert np.array_equal(flat(result.integer_sums), exact_levels_sum(trace, result.contributors, 32))


def test_a_lying_share_holder_is_caught_and_never_yields_a_wrong_sum():
    inputs = make_inputs(6)

    def lie(silo_payload: bytes) -> bytes:
        reply = json.loads(silo_payload)
        owner = sorted(reply["shares"])[0]
        y = shamir.from_bytes(msg.unb64(reply["shares"][owner]["y"]))
        reply["shares"][owner]["y"] = msg.b64(shamir.to_bytes((y + 1) % shamir.P))
        return json.dumps(reply).encode()

    ids = sorted(inputs)
    shapes = {k: tuple(v.shape) for k, v in inputs[ids[0]].items()}
    hub = HubSession("lie", ids, PARAMS, shapes, rng=random.Random(0))
    silos = {i: SiloSession("lie", i, keep_levels=True) for i in ids}
    for i in ids:
        hub.receive_keys(i, silos[i].advertise_keys())
    rosters = hub.close_advertise()
    for i in ids:
        hub.receive_shares(i, silos[i].share_keys(rosters[i]))
    inboxes = hub.close_share_keys()
    for i in ids:
        hub.receive_masked_input(i, silos[i].masked_input(inboxes[i], inputs[i]))
    survivors = hub.close_masked_input()
    for i in ids:
        hub.receive_consistency(i, silos[i].consistency(survivors[i]))
    requests = hub.close_consistency()
    for i in ids:
        reply = silos[i].unmask(requests[i])
        hub.receive_unmask(i, lie(reply) if i == "silo-03" else reply)
    result = hub.finish()  # 5 honest shares of every secret, t = 4: the lie is outvoted and named
    assert result.suspects == ["silo-03"]
    total = sum(silos[i].levels for i in ids)
    assert np.array_equal(flat(result.integer_sums), total.astype(np.uint32))


def test_protocol_misuse_is_refused():
    inputs = make_inputs(4)
    ids = sorted(inputs)
    shapes = {k: tuple(v.shape) for k, v in inputs[ids[0]].items()}
    hub = HubSession("s", ids, PARAMS, shapes)
    silo = SiloSession("s", ids[0])
    with pytest.raises(SecAggError, match="stage new"):
        silo.masked_input(b"{}", inputs[ids[0]])
    keys = silo.advertise_keys()
    with pytest.raises(ProtocolError, match="not part of stage"):
        hub.receive_keys("intruder", keys)
    hub.receive_keys(ids[0], keys)
    with pytest.raises(ProtocolError, match="already sent"):
        hub.receive_keys(ids[0], keys)
    with pytest.raises(ProtocolError, match="session"):
        hub.receive_keys(ids[1], SiloSession("other", ids[1]).advertise_keys())
    with pytest.raises(ProtocolError, match="malformed"):
        hub.receive_keys(ids[1], b'{"session": "s", "c_pk": "AAAA"}')
    low_order = json.dumps({"session": "s", "c_pk": msg.b64(bytes(32)), "s_pk": json.loads(keys)["s_pk"]}).encode()
    with pytest.raises(ProtocolError, match="unusable public key"):
        hub.receive_keys(ids[1], low_order)
    with pytest.raises(ProtocolError, match="stage advertise_keys, not masked_input"):
        hub.receive_masked_input(ids[0], b"")


def test_a_silo_refuses_a_weak_roster_and_an_inconsistent_unmask_request():
    silo = SiloSession("s", "a")
    keys = json.loads(silo.advertise_keys())
    other = [json.loads(SiloSession("s", n).advertise_keys()) for n in "bc"]
    roster = {"session": "s", "silo_id": "a", "index": 1, "degree": 4, "threshold": 2, "modulus_bits": 32,
              "rules": [{"pattern": "*", "clip": 1.0, "bits": 16}],
              "neighbours": [{"silo_id": n, "index": k + 2, "c_pk": o["c_pk"], "s_pk": o["s_pk"]}
                             for k, (n, o) in enumerate(zip("bc", other, strict=True))]}
    with pytest.raises(SecAggError, match="not a strict majority"):
        silo.share_keys(json.dumps(roster).encode())
    assert keys["session"] == "s" and silo.stage.value == "aborted"

    inputs = make_inputs(5)
    ids = sorted(inputs)
    shapes = {k: tuple(v.shape) for k, v in inputs[ids[0]].items()}
    hub = HubSession("u", ids, PARAMS, shapes)
    silos = {i: SiloSession("u", i) for i in ids}
    for i in ids:
        hub.receive_keys(i, silos[i].advertise_keys())
    rosters = hub.close_advertise()
    for i in ids:
        hub.receive_shares(i, silos[i].share_keys(rosters[i]))
    inboxes = hub.close_share_keys()
    for i in ids:
        hub.receive_masked_input(i, silos[i].masked_input(inboxes[i], inputs[i]))
    survivors = hub.close_masked_input()
    for i in ids:
        silos[i].consistency(survivors[i])
    neighbours = sorted(set(ids) - {ids[0]})
    both = {"session": "u", "survivors": neighbours, "dropped": neighbours[:1]}
    with pytest.raises(SecAggError, match="both survived and dropped"):
        silos[ids[0]].unmask(json.dumps(both).encode())
    few = {"session": "u", "survivors": neighbours[:1], "dropped": neighbours[1:]}
    with pytest.raises(SecAggError, match="threshold"):
        silos[ids[1]].unmask(json.dumps({**few, "survivors": [ids[0]], "dropped": neighbours[1:]}).encode())


def test_capacity_check_refuses_a_configuration_that_could_overflow():
    rules = [Rule("*", 1.0, 20)]
    assert max_silos(rules, 32) == 4096
    check_capacity(rules, 32, 4096)
    with pytest.raises(CapacityError, match="at most 4096 silos"):
        check_capacity(rules, 32, 4097)
    check_capacity(rules, 64, 1_000_000)
    params = SecAggParams(enabled=True, quantization=[QuantizationRule(pattern="*", clip=1.0, bits=30)])
    with pytest.raises(CapacityError):
        HubSession("s", [f"s{i}" for i in range(5)], params, {"x": (3,)})
    with pytest.raises(ValueError, match="below modulus_bits"):
        SecAggParams(quantization=[QuantizationRule(pattern="*", clip=1.0, bits=40)])


def test_the_worst_case_sum_at_capacity_does_not_wrap():
    # 16 silos at +clip with 27-bit levels in Z_2^32: 16 * (2^27 - 1) < 2^32, and the decoded sum is exact.
    params = SecAggParams(enabled=True, quantization=[QuantizationRule(pattern="*", clip=1.0, bits=27)])
    inputs = {f"s{i:02d}": {"x": torch.full((5,), 1.0)} for i in range(16)}
    result = aggregate(inputs, params)
    assert torch.allclose(result.sums["x"], torch.full((5,), 16.0, dtype=torch.float64), atol=1e-9)
    inputs = {f"s{i:02d}": {"x": torch.full((5,), -1.0)} for i in range(16)}
    assert torch.allclose(aggregate(inputs, params).sums["x"], torch.full((5,), -16.0, dtype=torch.float64))


def test_quantization_error_stays_within_its_bound_and_is_unbiased():
    rule = Rule("*", 0.5, 12)
    g = torch.Generator().manual_seed(0)
    n = 10
    xs = [(torch.rand(20_000, generator=g) - 0.5) for _ in range(n)]
    rounding = rounding_generator(1)
    q = sum(encode(x, rule, 32, rounding)[0] for x in xs)
    error = decode_sum(q, rule, n) - sum(x.double() for x in xs)
    assert float(error.abs().max()) <= rule.error_bound(n)  # n levels: 10 / (4095 / 1.0)
    assert rule.error_bound(n) == pytest.approx(10 / 4095)
    # stochastic rounding is unbiased: the mean error over 20k coordinates is a tiny fraction of one level
    assert abs(float(error.mean())) < 0.05 / rule.scale * n ** 0.5
    levels, clipped = encode(torch.tensor([0.7, -3.0, 0.1]), rule, 32, rounding)
    assert clipped == 2 and int(levels[0]) == rule.levels and int(levels[1]) == 0


def test_shamir_any_t_shares_recover_and_fewer_do_not():
    secret = bytes(range(32))
    shares = shamir.split(secret, range(1, 8), t=4)
    for subset in [(1, 2, 3, 4), (4, 5, 6, 7), (1, 3, 5, 7)]:
        value, off = shamir.reconstruct({x: shares[x] for x in subset}, 4)
        assert value == secret and off == []
    with pytest.raises(shamir.ReconstructionError, match="3 shares, 4 needed"):
        shamir.reconstruct({x: shares[x] for x in (1, 2, 3)}, 4)
    # t - 1 shares fit every secret: for any candidate there is a degree-3 polynomial through them and it
    three = {x: shares[x] for x in (1, 2, 3)}
    other = bytes(32)
    fake = {**three, 0: int.from_bytes(other, "big")}
    assert shamir.interpolate(fake, 0) == 0 and all(shamir.interpolate(fake, x) == y for x, y in three.items())


def test_graph_is_symmetric_regular_and_threshold_a_strict_majority():
    ids = [f"s{i:03d}" for i in range(100)]
    k = degree_for(100, None)
    assert k == 22  # 3 * ceil(log2 100) = 21, rounded up to even
    g = neighbour_graph(ids, k, random.Random(0))
    assert all(len(g[i]) == k and i not in g[i] for i in ids)
    assert all(i in g[j] for i in ids for j in g[i])
    assert degree_for(10, None) == 9  # small federations: the complete graph
    assert threshold_for(22, 2 / 3) == 15 and threshold_for(22, 0.1) == 12 and threshold_for(3, 0.5) == 2
    with pytest.raises(ValueError, match="at least 3 silos"):
        threshold_for(1, 0.5)
