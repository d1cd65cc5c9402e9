"""One enrolled silo against the hub core (no network): it cannot buy the mean with a large weight, in the clear or
under secure aggregation, cannot take another session's place with a second certificate, cannot stall a round by
dropping out, aborting or being revoked, and cannot write lines of its own into the hub's log."""

from __future__ import annotations

import logging
import threading
import time

import pytest
import torch

from security.secagg import SecAggParams
from silo_core.algorithms.base import RoundPlan, SiloResult
from silo_core.tensors import TensorSpec, encode, iter_chunks, sha256_hex
from silo_server.hub import Refusal
from silo_server.rounds.aggregate import RunningSum
from silo_server.rounds.privacy import PrivacySection
from tests.silo_server import hostile
from tests.silo_server.test_hub import MeanOfSilos, make_hub, start_round, upload, wait_task
from tests.silo_server.test_privacy import D, Mean, Silo, make


class UniformMean(MeanOfSilos):
    """MeanOfSilos under uniform averaging: every silo must send weight exactly 1."""

    def begin_round(self, state):
        plan = super().begin_round(state)
        plan.unit_weight = True
        return plan


class UniformMeanD(Mean):
    def begin_round(self, state):
        return RoundPlan(state.round + 1, dict(state.tensors), {},
                         {"delta/x": TensorSpec((D,), "float32"), "weight": TensorSpec((1,), "float32")},
                         unit_weight=True)


def _refused(call) -> Refusal:
    with pytest.raises(Refusal) as info:
        call()
    return info.value


def _send(hub, silo, task, tensors):
    header, payload = hostile.valid_upload(hub.run_id, task.task_id, task.round, tensors)
    hub.upload(silo, header, iter_chunks(payload, 64))


def _wait(predicate, timeout=30.0):
    end = time.time() + timeout
    while not predicate():
        assert time.time() < end, "timed out"
        time.sleep(0.02)


# ------------------------------------------------------------------------------------------------ take over


def test_under_uniform_averaging_a_weight_other_than_one_is_refused(tmp_path):
    hub = make_hub(tmp_path)
    hub.rounds.algorithm = UniformMean()
    hub.join("a", 10**9, 0, "cpu")  # declares a billion images
    hub.join("b", 10, 0, "cpu")
    thread, out = start_round(hub)
    ta, tb = wait_task(hub, "a"), wait_task(hub, "b")
    inflated = {"delta/x": torch.full((3,), 1e9), "weight": torch.tensor([1e9])}  # per unit: a change of 1
    refusal = _refused(lambda: _send(hub, "a", ta, inflated))
    assert (refusal.code, refusal.reason) == ("INVALID_ARGUMENT", "bad_weight")
    assert "exactly 1" in refusal.message
    # the refusal changed nothing: a's slot is still its own, for a result it may send
    _send(hub, "a", ta, {"delta/x": torch.full((3,), 1.0), "weight": torch.ones(1)})
    _send(hub, "b", tb, {"delta/x": torch.full((3,), 3.0), "weight": torch.ones(1)})
    thread.join(10)
    assert torch.allclose(out["state"].tensors["model/x"], torch.full((3,), 2.0))
    record = hub.records.history[-1]
    assert (record.silos_reported, record.silos_dropped, record.attempt) == (2, 0, 1)


def test_a_silos_declared_images_are_fixed_at_first_join_and_its_share_is_capped(tmp_path, caplog):
    hub = make_hub(tmp_path, min_silos=4, quorum=0.5)
    hub.join("big", 1000, 0, "cpu")
    for s in ("b", "c", "d"):
        hub.join(s, 10, 0, "cpu")
    hub.join("d", 10**9, 0, "cpu")  # a re-join cannot raise the count
    assert hub.registry.silos["d"].declared_images == 10
    assert "keeps the 10 it declared first" in caplog.text
    thread, out = start_round(hub)
    tasks = {s: wait_task(hub, s) for s in ("big", "b", "c", "d")}
    # d may not exceed what it declared first
    assert _refused(lambda: _send(hub, "d", tasks["d"], {"delta/x": torch.full((3,), 20.0),
                                                          "weight": torch.tensor([20.0])})).reason == "bad_weight"
    # big declared 1000, but no silo carries more than 4 x the median declared (10): its weight is scaled to 40
    _send(hub, "big", tasks["big"], {"delta/x": torch.full((3,), 1000 * 10.0), "weight": torch.tensor([1000.0])})
    _send(hub, "b", tasks["b"], {"delta/x": torch.full((3,), 10 * 1.0), "weight": torch.tensor([10.0])})
    _send(hub, "c", tasks["c"], {"delta/x": torch.full((3,), 10 * 1.0), "weight": torch.tensor([10.0])})
    thread.join(10)
    assert hub.registry.counters["weight_capped"] == 1
    # (40 * 10 + 10 * 1 + 10 * 1) / 60 = 7, where the uncapped mean would be (10000 + 20) / 1020 = 9.82
    assert torch.allclose(out["state"].tensors["model/x"], torch.full((3,), 7.0))
    assert hub.records.history[-1].algorithm["n"] == 3.0


def test_sums_stay_in_float64():
    sums = RunningSum()
    for w in (1e9, 1.0, 1.0):
        sums.add({"weight": torch.tensor([w], dtype=torch.float32)}, {})
    assert sums.result()["weight"].dtype == torch.float64
    assert float(sums.result()["weight"]) == 1e9 + 2.0  # float32 would have rounded the honest 2 away


class HostileSecAggSilo(Silo):
    """Takes part in secure aggregation with a result it chose: a weight and a delta of its own."""

    def __init__(self, *args, weight=1.0, delta=1.0, **kw):
        super().__init__(*args, **kw)
        self.weight, self.delta = weight, delta

    def run(self):
        original = self.privacy.submit

        def submit(silo_id, run_id, task, result, expected, **privacy):
            forged = SiloResult({"delta/x": torch.full((D,), self.delta), "weight": torch.tensor([self.weight])})
            return original(silo_id, run_id, task, forged, expected, **privacy)

        self.privacy.submit = submit
        super().run()


def _secagg_round(tmp_path, hostile_silo, max_update_norm=None):
    params = SecAggParams(enabled=True, threshold=0.5, stage_deadline_s=2.0)
    hub = make(tmp_path, PrivacySection(secure_aggregation=params), min_silos=5, quorum=0.6,
               max_update_norm=max_update_norm)
    hub.rounds.algorithm = UniformMeanD()
    silos = [Silo(hub, f"s{i}", 0.01) for i in range(4)] + [hostile_silo(hub)]
    for s in silos:
        s.start()
    state = hub.rounds.resume_or_init()

    def run_round():
        try:
            hub.rounds.run_round(state)
        except InterruptedError:  # the test stops the hub while it retries
            pass

    runner = threading.Thread(target=run_round, daemon=True)
    runner.start()
    return hub, runner


@pytest.mark.parametrize("attack, bound, words", [
    ({"weight": -1.9, "delta": 1.0}, None, "whole number of silos"),
    ({"weight": 1.0, "delta": 1.0}, 1.0, "above 1 x the summed weight"),
])
def test_under_secure_aggregation_the_hub_refuses_a_sum_no_honest_silos_could_send(tmp_path, caplog, attack, bound,
                                                                                    words):
    hub, runner = _secagg_round(tmp_path, lambda h: HostileSecAggSilo(h, "s4", 0.0, **attack), bound)
    _wait(lambda: hub.registry.counters.get("rounds_failed", 0) >= 1)
    hub.stop()
    runner.join(10)
    assert hub.records.history == [] and hub.registry.refusals.get("bad_aggregate") == 1
    failure = next(r.getMessage() for r in caplog.records if "attempt 1 failed" in r.getMessage())
    assert "securely aggregated sum of 5 silos was refused" in failure and words in failure


def test_honest_silos_under_secure_aggregation_pass_the_sum_checks(tmp_path):
    hub, runner = _secagg_round(tmp_path, lambda h: Silo(h, "s4", 0.01), max_update_norm=1.0)
    _wait(lambda: hub.records.history)
    hub.stop()
    runner.join(10)
    assert hub.records.history[0].secagg.contributors == 5 and "bad_aggregate" not in hub.registry.refusals


# -------------------------------------------------------------------------------------------- one session each


def test_a_second_certificate_for_a_live_silo_is_refused_and_logged(tmp_path, caplog):
    hub = make_hub(tmp_path)
    hub.join("a", 10, 0, "cpu", serial=0x111)
    refusal = _refused(lambda: hub.join("a", 10**6, 0, "cpu", serial=0x222))
    assert (refusal.code, refusal.reason) == ("ALREADY_EXISTS", "second_certificate")
    assert hub.registry.silos["a"].serial == 0x111 and hub.registry.silos["a"].declared_images == 10
    assert any(r.levelno == logging.WARNING and "second certificate for silo a" in r.getMessage()
               for r in caplog.records)
    # its other calls are refused too, while the first session's go through
    assert _refused(lambda: hub.registry.check_session("a", 0x222)).reason == "second_certificate"
    hub.registry.check_session("a", 0x111)
    # once the first session is gone (a renewed certificate after a restart), the new serial takes over
    hub.registry.silos["a"].last_seen = time.time() - 2 * hub.registry.liveness_s
    hub.join("a", 10, 0, "cpu", serial=0x222)
    assert hub.registry.silos["a"].serial == 0x222
    assert _refused(lambda: hub.registry.check_session("a", 0x111)).reason == "second_certificate"


# ------------------------------------------------------------------------------------------------ stall the run


def _round_of_three_with_a_reported(tmp_path):
    """Silos a, b, c (serials 1-3) in a round that needs 2 reports, a's in; add a serial to `revoked` to revoke."""
    hub = make_hub(tmp_path, min_silos=3, quorum=0.5, deadline_s=600)
    revoked: set[int] = set()
    hub.registry.is_revoked = revoked.__contains__
    for i, s in enumerate(("a", "b", "c")):
        hub.join(s, 10, 0, "cpu", serial=i + 1)
    thread, out = start_round(hub)
    tasks = {s: wait_task(hub, s) for s in ("a", "b", "c")}
    upload(hub, "a", tasks["a"], {"delta/x": torch.full((3,), 1.0), "weight": torch.ones(1)})
    return hub, revoked, thread, out, tasks


def test_a_revoked_silo_leaves_its_round_at_once(tmp_path):
    hub, revoked, thread, out, tasks = _round_of_three_with_a_reported(tmp_path)
    upload(hub, "b", tasks["b"], {"delta/x": torch.full((3,), 3.0), "weight": torch.ones(1)})
    started = time.time()
    revoked.add(3)  # c is busy training (no call the gate could refuse) when its certificate is revoked
    thread.join(30)
    assert not thread.is_alive() and time.time() - started < 10  # not the 600 s deadline
    record = hub.records.history[-1]
    assert (record.silos_sampled, record.silos_reported, record.attempt) == (3, 2, 1)
    assert torch.allclose(out["state"].tensors["model/x"], torch.full((3,), 2.0))
    assert "c" not in hub.registry.live_silos()


def test_an_upload_streaming_when_its_silo_is_revoked_does_not_reach_the_model(tmp_path):
    # The gate checks a certificate when a call opens; an upload already streaming when the CRL lists its silo must
    # not land in the sums after the round loop counted the silo out (it once did, listed as left out).
    hub, revoked, thread, out, tasks = _round_of_three_with_a_reported(tmp_path)  # 1 of the 2 needed
    payload = encode({"delta/x": torch.full((3,), 100.0), "weight": torch.ones(1)})
    counted_out = threading.Event()

    def slow_chunks():
        yield 0, payload[:16]
        revoked.add(3)  # c's certificate is revoked while its upload streams; the round loop counts it out
        _wait(lambda: "c" in hub.rounds.task.gone)
        counted_out.set()
        yield 16, payload[16:]

    header = {"run_id": hub.run_id, "task_id": tasks["c"].task_id, "round": tasks["c"].round,
              "total_bytes": len(payload), "sha256": sha256_hex(payload), "skipped": False, "metrics": {"n": 1.0}}
    assert _refused(lambda: hub.upload("c", header, slow_chunks())).reason == "stale_task"
    assert counted_out.is_set()
    upload(hub, "b", tasks["b"], {"delta/x": torch.full((3,), 3.0), "weight": torch.ones(1)})
    thread.join(30)
    record = hub.records.history[-1]
    assert (record.silos_sampled, record.silos_reported) == (3, 2)
    assert torch.allclose(out["state"].tensors["model/x"], torch.full((3,), 2.0))  # a and b only


class AbortingSilo(Silo):
    """Gives up on the secure-aggregation session at masked_input, with a reason that tries to forge a log line."""

    def run(self):
        original = self.privacy.run_stage

        def run_stage(task):
            if task.secagg_stage == "masked_input":
                self.send_stage(task.task_id, task.round, "abort",
                                b"bye\nFAKE LOG LINE: round 99 done\r\n" + b"x" * 5000)
                return
            original(task)

        self.privacy.run_stage = run_stage
        super().run()


def test_secure_aggregation_survives_an_abort_and_the_abort_reason_cannot_forge_a_log_line(tmp_path, caplog):
    caplog.set_level(logging.INFO)
    hub = make(tmp_path, PrivacySection(secure_aggregation=SecAggParams(enabled=True, stage_deadline_s=30.0)),
               min_silos=4, quorum=0.5, deadline_s=60.0)
    silos = [Silo(hub, f"s{i}", 0.25 * i) for i in range(3)] + [AbortingSilo(hub, "s3", 100.0)]
    for s in silos:
        s.start()
    started = time.time()
    state = hub.run()
    for s in silos:
        s.join(5)
    # 4 sampled survive 1 dropout (k = 3, t = 2), and the stage did not wait out its 30 s for the silo that left
    assert state.round == 1 and time.time() - started < 25
    record = hub.records.history[-1]
    assert record.secagg.contributors == 3 and record.secagg.threshold == 2
    assert torch.allclose(state.tensors["model/x"], torch.full((D,), 0.25), atol=1e-3)  # mean of 0, 0.25, 0.5
    assert (record.silos_reported, record.silos_dropped) == (3, 1)
    gave_up = [r.getMessage() for r in caplog.records if "gave up on session" in r.getMessage()]
    assert len(gave_up) == 1 and "\n" not in gave_up[0] and "\\nFAKE LOG LINE" in gave_up[0]
    assert len(gave_up[0]) < 400  # cut, not 5,000 characters of the silo's choosing
    assert not any(r.getMessage().startswith("FAKE") for r in caplog.records)


def test_refusal_messages_quoting_a_silo_are_escaped_and_cut(tmp_path, caplog):
    hub = make_hub(tmp_path)
    refusal = hub.registry.refuse("a", "INVALID_ARGUMENT", "bad_request", "stage 'x\nFAKE: round 99 done'" + "y" * 1000)
    assert "\n" not in refusal.message and "\\nFAKE" in refusal.message and len(refusal.message) <= 303
    assert all("\n" not in r.getMessage() for r in caplog.records)


def test_the_fewest_silos_a_secure_round_samples_survive_its_dropouts():
    assert SecAggParams(enabled=True).plan(3).survives == 0  # 3 silos: k = 2, t = 2, no dropout survivable
    assert SecAggParams(enabled=True).fewest_silos() == 4  # the default, 1 dropout
    assert SecAggParams(enabled=True, dropouts=2).fewest_silos() == 7
    for n in range(4, 40):
        assert SecAggParams(enabled=True).plan(n).survives >= 1
    with pytest.raises(ValueError, match="no round of up to"):
        SecAggParams(enabled=True, threshold=1.0)


def test_check_prints_the_secure_aggregation_plan_and_each_bound_it_cannot_enforce():
    from security.dp import DPConfig
    from silo_server.rounds.privacy import plan_lines

    secagg = PrivacySection(secure_aggregation=SecAggParams(enabled=True))
    lines = plan_lines(secagg, max_update_norm=5.0)
    assert lines[0].startswith("secure aggregation: rounds sample at least 4 silos to survive 1 dropout(s)")
    assert "3 neighbours, threshold 2, survives 1" in lines[0]
    assert lines[1].startswith("bound not enforced per silo: security.max_update_norm (5)")
    assert "with 10 sampled: 9 neighbours, threshold 6, survives 3" in plan_lines(secagg, None, sampled=10)[0]
    noisy = PrivacySection(secure_aggregation=SecAggParams(enabled=True), dp=DPConfig(enabled=True))
    assert plan_lines(noisy, 5.0)[1].startswith("bound not enforced: security.max_update_norm (5) is not checked")
    assert plan_lines(PrivacySection(), 5.0) == [
        "secure aggregation: off (the hub sees each silo's update and checks each one)"]


def test_a_restarted_hub_keeps_each_silos_first_declared_count(tmp_path):
    hub = make_hub(tmp_path, min_silos=2)
    hub.join("a", 10, 0, "cpu")
    hub.join("b", 10, 0, "cpu")
    thread, out = start_round(hub)
    for s in ("a", "b"):
        _send(hub, s, wait_task(hub, s), {"delta/x": torch.ones(3), "weight": torch.ones(1)})
    thread.join(10)
    restarted = make_hub(tmp_path, min_silos=2)
    assert restarted.rounds.load_state().round == 1
    restarted.join("a", 10**9, 0, "cpu")  # after the restart it claims more
    assert restarted.registry.silos["a"].declared_images == 10


def test_the_hub_knows_when_every_live_silo_has_heard_the_run_is_over(tmp_path):
    hub = make_hub(tmp_path, total_rounds=1, min_silos=2)
    for s in ("a", "b"):
        hub.join(s, 10, 0, "cpu")
    runner = threading.Thread(target=hub.run, daemon=True)
    runner.start()
    for s in ("a", "b"):
        _send(hub, s, wait_task(hub, s), {"delta/x": torch.ones(3), "weight": torch.ones(1)})
    runner.join(10)
    assert hub.rounds.phase == "done" and hub.registry.silos_not_told_done() == ["a", "b"]
    assert hub.next_task("a", hub.run_id, wait_s=5).kind == "DONE"
    assert hub.registry.silos_not_told_done() == ["b"]  # the app lingers only for b now, not for server.linger_s
    hub.next_task("b", hub.run_id, wait_s=5)
    assert hub.registry.silos_not_told_done() == []


def test_refusal_status_comes_from_the_exception_type_not_its_wording():
    from security.secagg.messages import DuplicateMessage, ProtocolError
    from silo_core.tensors import ChunkAssembler, CodecError, TooLarge

    too_long = ChunkAssembler(4, 100)
    too_long.add(0, b"abcd")
    with pytest.raises(TooLarge):  # a stream longer than announced is a size refusal (RESOURCE_EXHAUSTED)
        too_long.add(4, b"e")
    with pytest.raises(TooLarge):
        ChunkAssembler(10**9, 100)
    gap = ChunkAssembler(4, 100)
    with pytest.raises(CodecError) as err:
        gap.add(2, b"ab")
    assert not isinstance(err.value, TooLarge)  # a malformed stream stays INVALID_ARGUMENT
    assert issubclass(DuplicateMessage, ProtocolError)
