"""The hub and silo privacy layers driven together without a network: secure aggregation stages through the hub's
task/upload paths, a silo lost mid-protocol, DP epsilon in history and checkpoint, resume, and the budget stop."""

import threading
import time

import pytest
import torch

from security.dp import DPConfig
from security.secagg import QuantizationRule, SecAggParams
from silo.v1 import silo_pb2
from silo_client.errors import SiloError
from silo_client.privacy import SiloPrivacy
from silo_core.algorithms.base import HubAlgorithm, HubState, RoundPlan, SiloResult
from silo_core.models import ModelSpec
from silo_core.tensors import TensorSpec, encode, iter_chunks, sha256_hex
from silo_server.hub import Hub, Refusal
from silo_server.rounds.privacy import HubPrivacy, PrivacySection, check_clip_tensors
from tests.conftest import wait_for
from tests.silo_server.hubs import build_hub

D = 4000


class Mean(HubAlgorithm):
    """x <- x + sum(delta) / sum(weight)."""

    name = "mean"

    def __init__(self, rounds=3):
        super().__init__(None, ModelSpec(), None, torch.device("cpu"), 0, rounds)

    def init_state(self):
        return HubState(0, {"model/x": torch.zeros(D)})

    def begin_round(self, state):
        return RoundPlan(state.round + 1, dict(state.tensors), {},
                         {"delta/x": TensorSpec((D,), "float32"), "weight": TensorSpec((1,), "float32")})

    def finish_round(self, state, summed, metrics):
        x = state.tensors["model/x"] + (summed["delta/x"] / summed["weight"]).float()  # sums arrive in float64
        return HubState(state.round + 1, {"model/x": x}), {}

    def served_model(self, state):
        return torch.nn.Identity()


class Silo(threading.Thread):
    """The client's loop against the hub object: TRAIN -> SiloPrivacy.submit, SECAGG -> SiloPrivacy.run_stage.

    Every instance is ended after its test (tests/silo_server/conftest.py): a stopped hub answers every poll at once,
    and silos left polling one kept more than a core busy for the rest of the suite."""

    started: list["Silo"] = []

    def __init__(self, hub: Hub, silo_id: str, value: float, die_at: str | None = None, weight: int = 1):
        super().__init__(daemon=True)
        self.finished = threading.Event()
        Silo.started.append(self)
        self.hub, self.silo_id, self.value, self.die_at = hub, silo_id, value, die_at
        self.weight = weight  # FedAvg's n_k: it sends weight * value and its weight, declaring max(10, weight) images
        self.privacy = SiloPrivacy(send_result=self.send_result, send_stage=self.send_stage)
        self.refused: list[str] = []
        self.sent: list[str] = []  # "charge" (the ledger's entry written) and each message kind, in order
        self.hold_at: str | None = None  # wait for `release` before answering this stage (a frozen silo)
        self.release = threading.Event()
        hub.join(silo_id, max(10, weight), 0, "cpu")

    def send(self, header, payload):
        header = {"run_id": self.hub.run_id, "total_bytes": len(payload), "sha256": sha256_hex(payload), **header}
        self.hub.upload(self.silo_id, header, iter_chunks(payload, 4096))

    def send_result(self, task, tensors, metrics, skipped, charge=None):
        if charge is not None:  # as the Outbox does, once the policy allows the upload
            charge()
        self.sent.append("upload")
        self.send({"task_id": task.task_id, "round": task.round, "skipped": skipped, "metrics": metrics},
                  encode(tensors) if tensors else b"")
        return 0

    def send_stage(self, task_id, round_, stage, payload, charge=None, tensors=None):
        if charge is not None:
            charge()
        self.sent.append(stage)
        self.send({"task_id": task_id, "round": round_, "secagg_stage": stage}, payload)

    def run(self):
        while not self.finished.is_set():
            try:
                if self.hub.stop_event.is_set():  # a stopped hub answers at once; a test may hand us a new one
                    self.finished.wait(0.05)
                    continue
                view = self.hub.next_task(self.silo_id, self.hub.run_id, wait_s=1.0)
                task = silo_pb2.Task(task_id=view.task_id, round=view.round, privacy=view.privacy,
                                     secagg_stage=view.secagg_stage, secagg_payload=view.secagg_payload)
                if view.kind == "DONE":
                    return
                if view.kind == "TRAIN":
                    result = SiloResult({"delta/x": torch.full((D,), self.value * self.weight),
                                         "weight": torch.full((1,), float(self.weight))})
                    self.privacy.submit(self.silo_id, self.hub.run_id, task, result, view.expected,
                                        charge=lambda: self.sent.append("charge"))
                elif view.kind == "SECAGG":
                    if view.secagg_stage == self.die_at:
                        return  # killed mid-protocol: never heard from again
                    if view.secagg_stage == self.hold_at:
                        self.release.wait()
                        self.hold_at = None
                    self.privacy.run_stage(task)
            except Refusal as r:
                self.refused.append(r.reason)
                if r.reason == "not_joined":  # a restarted hub: join again, as the client does
                    self.hub.join(self.silo_id, 10, 0, "cpu")


def run_with_silos(hub: Hub, values: list[float]) -> list[Silo]:
    """Silos s0, s1, ... sending these values run the hub to its end; returns them, joined."""
    silos = [Silo(hub, f"s{i}", v) for i, v in enumerate(values)]
    for s in silos:
        s.start()
    hub.run()
    for s in silos:
        s.join(5)
    return silos


def make(tmp_path, section, rounds=1, **kw):
    defaults = dict(state_dir=tmp_path, total_rounds=rounds, run_description={"algorithm": "mean"}, min_silos=5,
                    quorum=0.6, deadline_s=20.0, liveness_s=60.0, seed=0)
    return build_hub(Mean(rounds), privacy=HubPrivacy(section, seed=0), **{**defaults, **kw})


SECAGG = SecAggParams(enabled=True, threshold=0.5, stage_deadline_s=1.0,
                      quantization=[QuantizationRule(pattern="*", clip=8.0, bits=20)])


def test_secure_round_survives_a_silo_killed_after_sharing_keys(tmp_path):
    hub = make(tmp_path, PrivacySection(secure_aggregation=SECAGG))
    values = {"s0": 1.0, "s1": 2.0, "s2": 3.0, "s3": 4.0, "s4": 5.0}
    silos = [Silo(hub, s, v, die_at="masked_input" if s == "s3" else None) for s, v in values.items()]
    for s in silos:
        s.start()
    state = hub.run()
    for s in silos:
        s.join(5)
    secagg = hub.records.history[-1].secagg
    # complete graph on 5: k = 4, t = 3; s3 shared its keys then vanished: its pair masks were removed
    assert secagg.degree == 4 and secagg.threshold == 3
    assert secagg.u2 == 5 and secagg.u3 == 4 and secagg.contributors == 4 and secagg.recoveries == 1
    assert set(secagg.stage_seconds) == {"advertise_keys", "share_keys", "masked_input", "consistency", "unmasking"}
    assert all(0 <= seconds < 30 for seconds in secagg.stage_seconds.values())
    mean = (1 + 2 + 3 + 5) / 4
    error = (state.tensors["model/x"] - mean).abs().max()
    # One fixed-point level: each of the 4 sums (values and weights) is off by < 4 levels. Under weighted averaging
    # the round's range is the configured one (8) times the most weight a silo may send (10, the images it declares).
    level = 16 * 10 / (2**20 - 1)
    assert float(error) < (4 * level + mean * 4 * level) / (4 - 4 * level) + 1e-6
    # s3 reported its keys but its masked input is not in the sum: dropped, not reported (sampled = both)
    assert hub.records.history[-1].silos_reported == 4 and hub.records.history[-1].silos_dropped == 1
    assert all(not s.refused for s in silos)
    # s3 trained and advertised its keys, but the sum does not hold its input: neither the record nor the card
    # counts it as a contributor.
    assert hub.records.history[-1].silos_contributed == 4
    assert hub.records.contributed == {s: 1 for s in values if s != "s3"}
    # The ledger charges a silo just before its masked input leaves, the first message derived from its update:
    # s3, gone before that, spent nothing.
    for s in silos:
        assert s.sent[:3] == ["advertise_keys", "share_keys", *(["charge"] if s.silo_id != "s3" else [])], s.sent
        assert s.sent.count("charge") == (0 if s.silo_id == "s3" else 1)
        assert s.silo_id == "s3" or s.sent.index("charge") == s.sent.index("masked_input") - 1


def test_a_silo_silent_after_its_keys_holds_each_stage_only_the_wait_after_the_quorum(tmp_path):
    # Every stage waited for every silo or its stage_deadline_s: a silo that advertised its keys and then went
    # silent added the whole stage deadline to every round it was sampled in.
    section = PrivacySection(secure_aggregation=SECAGG.model_copy(update={"stage_deadline_s": 60.0}))
    hub = make(tmp_path, section, wait_after_quorum_s=1.0, deadline_s=120.0)
    silos = [Silo(hub, f"s{i}", 1.0 + i, die_at="share_keys" if i == 3 else None) for i in range(5)]
    for s in silos:
        s.start()
    hub.run()
    for s in silos:
        s.join(5)
    record = hub.records.history[-1]
    assert record.secagg.contributors == 4 and "s3" not in hub.records.contributed
    # Left out and dropped, in the applied round's record as in a failed attempt's count (it was neither before)
    assert record.silos_left_out == ("s3",) and record.silos_dropped == 1 and record.silos_reported == 4
    assert 1.0 <= record.secagg.stage_seconds["share_keys"] < 30  # the quorum's wait, not the 60 s deadline
    assert all(seconds < 30 for seconds in record.secagg.stage_seconds.values())


def test_a_stage_message_streamed_as_empty_chunks_is_refused_and_frees_its_room_in_the_budget(tmp_path):
    # The stage path read chunks with no check of its own: a stream of empty chunks (each resetting the idle cut)
    # held its room in the upload budget, an Upload slot and a worker thread past its round, for ever.
    hub = make(tmp_path, PrivacySection(secure_aggregation=SECAGG), deadline_s=60.0)
    for i in range(5):
        hub.join(f"s{i}", 10, 0, "cpu")
    thread, _ = round_until_stopped(hub)
    try:
        wait_for(lambda: hub.rounds.task is not None and "s0" in hub.rounds.task.sampled, 30, "a round")
        t = hub.rounds.task
        header = {"run_id": hub.run_id, "task_id": t.task_id, "round": t.round, "secagg_stage": "advertise_keys",
                  "total_bytes": 1000, "sha256": "0" * 64}
        held = []

        def empty_chunks():  # a silo's stream that would never end (one every 59 s beats the idle cut)
            for _ in range(1000):
                held.append(hub.intake.upload_budget.held)
                yield 0, b""

        with pytest.raises(Refusal) as refused:
            hub.upload("s0", header, empty_chunks())
        # refused at the first empty chunk (the old path read all 1,000), and its room given back
        assert (refused.value.reason, held, hub.intake.upload_budget.held) == ("bad_stream", [1000], 0)
        with pytest.raises(Refusal) as refused:  # nor a negative size, which lowered the budget's count
            hub.upload("s1", {**header, "total_bytes": -5}, iter([]))
        assert refused.value.reason == "bad_header" and hub.intake.upload_budget.held == 0
    finally:
        hub.stop()
        thread.join(30)


def test_a_silo_remembers_the_sessions_it_signed_and_calls_running_one_again_a_breach(tmp_path):
    # Signatures over a survivor set bind (run, session, set) only: a hub that ran one session id again could show
    # each group of silos the set another group signed before, and unmask an input. A silo signs once per session.
    hub = make(tmp_path / "hub", PrivacySection(secure_aggregation=SECAGG))
    silos = [Silo(hub, f"s{i}", 1.0) for i in range(5)]
    for s in silos:
        s.privacy = SiloPrivacy(send_result=s.send_result, send_stage=s.send_stage, state_dir=tmp_path / s.silo_id)
        (tmp_path / s.silo_id).mkdir()
        s.start()
    hub.run()
    (session,) = silos[0].privacy.signed_sessions  # the round's one attempt (its task id)
    for s in silos:
        assert s.privacy.signed_sessions == {session}
        again = SiloPrivacy(send_result=s.send_result, send_stage=s.send_stage, state_dir=tmp_path / s.silo_id)
        breach = again.replayed_session(silo_pb2.TaskPrivacy(secagg_session=session))
        assert breach is not None and breach.clause == "secure_aggregation.signed" and "again" in breach.message
        assert again.replayed_session(silo_pb2.TaskPrivacy(secagg_session=session + "x")) is None
    (tmp_path / "s0" / "secagg_signed_sessions.json").write_text("{")
    with pytest.raises(SiloError, match="secagg_signed_sessions.json is damaged"):
        SiloPrivacy(send_result=silos[0].send_result, send_stage=silos[0].send_stage, state_dir=tmp_path / "s0")


class RepeatsAndRushes(Silo):
    """Sends its share_keys message twice, then an unmask message before that stage opens."""

    def send_stage(self, task_id, round_, stage, payload, charge=None, tensors=None):
        super().send_stage(task_id, round_, stage, payload, charge, tensors)
        if stage == "share_keys":
            for again, what in ((stage, payload), ("unmask", b"{}")):
                try:
                    super().send_stage(task_id, round_, again, what)
                except Refusal as r:
                    self.refused.append(f"{again}: {r.code} {r.reason}")


class SharesLate(Silo):
    """Answers share_keys after a pause, so that the stage is still open when s0 repeats its message (on a busy
    machine the other four once answered first, the stage closed and the repeat was stale, not a duplicate)."""

    def send_stage(self, task_id, round_, stage, payload, charge=None, tensors=None):
        if stage == "share_keys":
            time.sleep(0.3)
        super().send_stage(task_id, round_, stage, payload, charge, tensors)


def test_a_repeated_or_early_stage_message_is_a_duplicate_or_stale_not_a_malformed_one(tmp_path):
    # bad_secagg fires the malformed-update alert: a repeat (a lost reply) or a message for a stage that is not
    # open (a stage deadline missed) is the silo's timing, not a broken message.
    hub = make(tmp_path, PrivacySection(secure_aggregation=SECAGG.model_copy(update={"stage_deadline_s": 3.0})))
    silos = [RepeatsAndRushes(hub, "s0", 1.0), *(SharesLate(hub, f"s{i}", 1.0) for i in range(1, 5))]
    for s in silos:
        s.start()
    hub.run()
    assert silos[0].refused == ["share_keys: ALREADY_EXISTS duplicate", "unmask: FAILED_PRECONDITION stale_task"]
    assert "bad_secagg" not in hub.registry.refusals and hub.registry.refusals["stale_task"] >= 1
    assert hub.records.history[-1].secagg.contributors == 4  # the early message counted s0 out, as before


class OversizedMaskedInput(Silo):
    """Announces a masked input `extra` bytes larger than the round's session allows (0: the most it allows);
    records whether it was read."""

    chunks_read = 0
    extra = 1

    def send_stage(self, task_id, round_, stage, payload, charge=None, tensors=None):
        if stage != "masked_input":
            return super().send_stage(task_id, round_, stage, payload)
        limit = HubPrivacy.stage_bytes(self.hub.rounds.task.privacy, stage)

        def chunks():
            self.chunks_read += 1
            yield 0, payload

        header = {"run_id": self.hub.run_id, "task_id": task_id, "round": round_, "secagg_stage": stage,
                  "total_bytes": limit + self.extra, "sha256": sha256_hex(payload)}
        self.hub.upload(self.silo_id, header, chunks())


def test_a_weighted_secure_round_sums_each_silos_images_times_its_update_unclipped(tmp_path):
    # FedAvg's (and HASSLE's) weights: a silo sends n_k * delta and n_k. The configured ranges (the defaults: weight
    # up to 1024, every other tensor within [-1, 1]) once clipped n_k * delta to 1, and the model moved by about
    # 1 / mean(n_k) of the true mean; the round's ranges now grow with the largest weight a sampled silo may send.
    hub = make(tmp_path, PrivacySection(secure_aggregation=SecAggParams(enabled=True, threshold=0.5,
                                                                        stage_deadline_s=1.0)))
    weights, values = [100, 200, 300, 400, 500], [0.5, -0.25, 0.1, 0.2, -0.1]
    silos = [Silo(hub, f"s{i}", v, weight=w) for i, (w, v) in enumerate(zip(weights, values, strict=True))]
    for s in silos:
        s.start()
    state = hub.run()
    for s in silos:
        s.join(5)
    mean = sum(w * v for w, v in zip(weights, values, strict=True)) / sum(weights)
    assert hub.records.history[-1].secagg.contributors == 5 and all(not s.refused for s in silos)
    assert torch.allclose(state.tensors["model/x"], torch.full((D,), mean), atol=1e-3)


def test_secure_aggregation_messages_wait_for_the_upload_budget_and_cannot_overstate_their_size(tmp_path):
    masked_bytes = 4 * D + 1024  # D ring elements of 4 bytes and a safetensors header: about 17 KB
    hub = make(tmp_path, PrivacySection(secure_aggregation=SECAGG), max_inflight_upload_bytes=masked_bytes)
    values = {"s0": 1.0, "s1": 2.0, "s2": 3.0, "s3": 4.0, "s4": 5.0}
    silos = [(OversizedMaskedInput if s == "s4" else Silo)(hub, s, v) for s, v in values.items()]
    for s in silos:
        s.start()
    state = hub.run()
    for s in silos:
        s.join(5)
    # Four masked inputs passed through the budget one at a time (two would not fit); the fifth was refused on its
    # header, before a byte of it was read, and the round went on without it.
    assert 4 * D < hub.intake.upload_budget.peak <= masked_bytes and hub.intake.upload_budget.held == 0
    assert set(silos[4].refused) == {"oversized"} and silos[4].chunks_read == 0  # it retried until the stage closed
    assert hub.records.history[-1].secagg.u3 == 4 and hub.records.history[-1].secagg.contributors == 4
    assert float((state.tensors["model/x"] - 2.5).abs().max()) < 1e-3


def test_an_operators_smaller_upload_cap_still_bounds_secure_aggregation_messages(tmp_path):
    # wire.max_upload_bytes below the session's bound for a masked input (4 * D ring bytes + 1,288 of header room)
    # but above what an honest masked input takes: the cap, not the looser stage bound, decides.
    cap = 4 * D + 600
    hub = make(tmp_path, PrivacySection(secure_aggregation=SECAGG), max_upload_bytes=cap)
    values = {"s0": 1.0, "s1": 2.0, "s2": 3.0, "s3": 4.0, "s4": 5.0}
    silos = [(OversizedMaskedInput if s == "s4" else Silo)(hub, s, v) for s, v in values.items()]
    silos[4].extra = 0  # within what the session allows, over the operator's cap
    for s in silos:
        s.start()
    state = hub.run()
    for s in silos:
        s.join(5)
    assert set(silos[4].refused) == {"oversized"} and silos[4].chunks_read == 0
    assert all(not s.refused for s in silos[:4])  # honest masked inputs fit under the cap
    assert hub.records.history[-1].secagg.u3 == 4 and hub.records.history[-1].secagg.contributors == 4
    assert float((state.tensors["model/x"] - 2.5).abs().max()) < 1e-3


def test_a_hub_restart_mid_protocol_reruns_the_round_with_fresh_keys(tmp_path):
    section = PrivacySection(secure_aggregation=SECAGG)
    first = make(tmp_path, section)
    silos = [Silo(first, f"s{i}", float(i)) for i in range(5)]
    for s in silos:
        s.hold_at = "masked_input"
        s.start()
    out = {}
    runner = threading.Thread(target=lambda: out.setdefault("state", first.run()), daemon=True)
    runner.start()
    wait = time.time() + 20
    while time.time() < wait and not ((t := first.rounds.task) and t.privacy
                                      and t.privacy.outbox_stage == "masked_input"):
        time.sleep(0.005)
    old_session = first.rounds.task.task_id
    first.stop()  # the hub dies with masked inputs on their way: the session was in memory only
    runner.join(5)
    assert out["state"].round == 0 and first.records.history == []
    second = make(tmp_path, section)
    assert second.run_id == first.run_id
    for s in silos:
        s.hub = second
        s.release.set()
    state = second.run()
    assert state.round == 1 and second.records.history[-1].secagg.contributors == 5
    assert torch.allclose(state.tensors["model/x"], torch.full((D,), 2.0), atol=1e-4)  # mean of 0..4, once
    assert all(s.privacy.pending.get(old_session) is None for s in silos)


def test_below_threshold_the_round_is_retried_not_applied_and_the_hub_never_gives_up(tmp_path, caplog):
    hub = make(tmp_path, PrivacySection(secure_aggregation=SECAGG), max_attempts=2, min_silos=5, deadline_s=2.0)
    silos = [Silo(hub, f"s{i}", 1.0, die_at="unmask" if i < 2 else None) for i in range(5)]
    for s in silos:
        s.start()
    state = hub.rounds.resume_or_init()
    errors: list[BaseException] = []

    def run():
        try:
            hub.rounds.run_round(state)
        except BaseException as err:  # noqa: BLE001 - the test reads what ended the round loop
            errors.append(err)

    runner = threading.Thread(target=run, daemon=True)
    runner.start()
    deadline = time.time() + 30
    while hub.registry.counters.get("rounds_failed", 0) < 1 and time.time() < deadline:
        time.sleep(0.05)
    time.sleep(1.5)  # past the first retry pause: the hub now waits for silos instead of stopping
    assert hub.registry.counters["rounds_failed"] == 1 and runner.is_alive() and not errors
    assert hub.records.history == []  # nothing half-applied
    # The two silos that died are not sampled again before they poll: 3 live, 4 needed for one dropout, 5 by config
    assert hub.rounds.phase == "waiting_for_silos" and hub.registry.live_silos() == ["s2", "s3", "s4"]
    failure = next(r.getMessage() for r in caplog.records if "attempt 1 failed" in r.getMessage())
    assert "abandoned" in failure and "below quorum" not in failure  # the real cause, not a quorum count
    hub.stop()
    runner.join(10)
    assert isinstance(errors[0], InterruptedError)


def round_until_stopped(hub: Hub) -> tuple[threading.Thread, list[bool]]:
    """The hub's next round in a thread that retries failed attempts until hub.stop(); `stopped` says it ended so."""
    state, stopped = hub.rounds.resume_or_init(), []

    def run():
        try:
            hub.rounds.run_round(state)
        except InterruptedError:
            stopped.append(True)

    runner = threading.Thread(target=run, daemon=True)
    runner.start()
    return runner, stopped


class RevokedAfterReporting(Silo):
    """Reports its update (or, under secure aggregation, advertises its keys), then its certificate is revoked and
    the hub evicts it; the others send theirs only after that (`others_go`)."""

    def __init__(self, *args, others_go: threading.Event, stage: str | None = None, **kw):
        super().__init__(*args, **kw)
        self.others_go, self.stage = others_go, stage

    def revoked(self):
        self.hub.rounds.evict(self.silo_id)
        self.finished.set()
        self.others_go.set()

    def send_result(self, task, tensors, metrics, skipped, charge=None):
        out = super().send_result(task, tensors, metrics, skipped, charge)
        self.revoked()
        return out

    def send_stage(self, task_id, round_, stage, payload, charge=None, tensors=None):
        super().send_stage(task_id, round_, stage, payload, charge, tensors)
        if stage == self.stage:
            self.revoked()


class AfterTheRevocation(Silo):
    def __init__(self, *args, go: threading.Event, **kw):
        super().__init__(*args, **kw)
        self.go = go

    def send_result(self, task, tensors, metrics, skipped, charge=None):
        assert self.go.wait(10)
        return super().send_result(task, tensors, metrics, skipped, charge)

    def send_stage(self, task_id, round_, stage, payload, charge=None, tensors=None):
        if stage == "advertise_keys":
            assert self.go.wait(10)
        super().send_stage(task_id, round_, stage, payload, charge, tensors)


def test_under_central_dp_a_silo_revoked_after_its_update_was_summed_still_counts_as_a_contributor(tmp_path):
    # Central DP without secure aggregation: the update is in the noised sum the moment it arrives, so a later
    # eviction must not make the record (or the card) say it dropped out.
    section = PrivacySection(dp=DPConfig(enabled=True, noise_multiplier=0.5, clip_norm=200.0))
    hub = make(tmp_path, section, quorum=1.0, min_silos=3)
    go = threading.Event()
    silos = [RevokedAfterReporting(hub, "a", 1.0, others_go=go),
             *(AfterTheRevocation(hub, s, 1.0, go=go) for s in ("b", "c"))]
    for s in silos:
        s.start()
    hub.run()
    record = hub.records.history[-1]
    assert "a" not in hub.registry.live_silos()  # evicted
    assert record.silos_contributed == 3 and record.silos_reported == 3 and record.silos_dropped == 0
    assert record.silos_left_out == () and hub.records.contributed == {"a": 1, "b": 1, "c": 1}
    assert record.dp is not None and record.dp.epsilon > 0


def test_a_secure_round_whose_keys_came_from_a_silo_since_revoked_fails_below_quorum(tmp_path, caplog):
    # Four sampled, three needed: s0 advertises its keys and is then revoked, s3 never trains. The round loop's
    # quorum wait does not count s0; the session must not either (no roster naming s0 goes out).
    hub = make(tmp_path, PrivacySection(secure_aggregation=SECAGG), min_silos=4, quorum=0.75, deadline_s=2.0)
    go = threading.Event()
    silos = [RevokedAfterReporting(hub, "s0", 1.0, others_go=go, stage="advertise_keys"),
             *(AfterTheRevocation(hub, s, 1.0, go=go) for s in ("s1", "s2"))]
    hub.join("s3", 10, 0, "cpu")  # joined, then silent
    for s in silos:
        s.start()
    runner, stopped = round_until_stopped(hub)
    def logged_failure():  # the hub counts the failure, then logs it: wait for the log line the test reads
        return next((r.getMessage() for r in caplog.records if "attempt 1 failed" in r.getMessage()), None)

    failure = wait_for(logged_failure, timeout=30, what="the logged failure of attempt 1", poll=0.05)
    assert hub.registry.counters["rounds_failed"] == 1 and hub.registry.counters.get("below_quorum") == 1
    assert "2 of 4 sampled silos finished training, below quorum 3" in failure
    assert all("share_keys" not in s.sent for s in silos)
    hub.stop()
    runner.join(10)
    assert stopped == [True]


def test_a_silo_revoked_during_the_secure_aggregation_stages_leaves_the_session_at_once(tmp_path):
    # Only the training wait checked the CRL: a silo revoked after its keys, silent at share_keys, held the stage
    # to the quorum wait (20 s here), and to the stage deadline where closing without it would abandon the round.
    hub = make(tmp_path, PrivacySection(secure_aggregation=SECAGG.model_copy(update={"stage_deadline_s": 30.0})),
               min_silos=5, quorum=0.6, wait_after_quorum_s=20.0)
    silos = [Silo(hub, f"s{i}", 1.0) for i in range(5)]
    silos[4].hold_at = "share_keys"  # frozen at the stage
    hub.registry.silos["s4"].serial = 44
    revoke = threading.Event()
    hub.registry.is_revoked = lambda serial: serial == 44 and revoke.is_set()
    revoked_at = []

    def revoke_at_share_keys():
        wait_for(lambda: hub.rounds.task is not None and hub.rounds.task.privacy.outbox_stage == "share_keys"
                 and len(hub.rounds.task.privacy.answered) == 4, timeout=30, what="share_keys answered by four")
        revoked_at.append(time.time())
        revoke.set()

    for s in silos:
        s.start()
    threading.Thread(target=revoke_at_share_keys, daemon=True).start()
    state = hub.run()
    live = hub.registry.live_silos()  # before s4 is let go (it would join again, as a restarted silo does)
    silos[4].release.set()
    assert state.round == 1 and revoked_at and time.time() - revoked_at[0] < 10
    record = hub.records.history[-1]
    assert record.secagg.contributors == 4 and "s4" not in live and record.silos_left_out == ("s4",)


def test_central_dp_without_secure_aggregation_noises_at_the_hub(tmp_path):
    section = PrivacySection(dp=DPConfig(enabled=True, noise_multiplier=0.5, clip_norm=200.0))
    hub = make(tmp_path, section, quorum=1.0)
    silos = [Silo(hub, f"s{i}", 0.25 * (i + 1)) for i in range(5)]
    for s in silos:
        s.start()
    state = hub.run()
    assert hub.privacy.dp.mode == "central"
    assert float((state.tensors["model/x"] - 0.75).std()) == pytest.approx(0.5 * 200.0 / 5, rel=0.06)
    assert hub.records.history[0].dp.epsilon > 0 and hub.records.history[0].secagg is None


def test_every_privacy_key_is_documented_and_validated():
    from pathlib import Path

    from pydantic import BaseModel

    from silo_server.config import ConfigError, parse_config

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()

    def keys(model: type[BaseModel], prefix: str):
        for name, f in model.model_fields.items():
            ann = f.annotation
            if isinstance(ann, type) and issubclass(ann, BaseModel):
                yield from keys(ann, f"{prefix}.{name}")
            else:
                yield f"{prefix}.{name}"

    missing = [k for k in keys(PrivacySection, "privacy") if f"`{k}`" not in readme]
    assert not missing, missing
    base = {"data": {"labeled": {"kind": "demo"}}}
    with pytest.raises(ConfigError, match="unknown key 'privacy.dp.epsilon'"):
        parse_config({**base, "privacy": {"dp": {"epsilon": 3}}})
    with pytest.raises(ConfigError, match=r"privacy.secure_aggregation'.*bits \(40\) must be below modulus_bits"):
        parse_config({**base, "privacy": {"secure_aggregation": {"quantization": [{"pattern": "*", "clip": 1,
                                                                                  "bits": 40}]}}})
    cfg = parse_config({**base, "privacy": {"secure_aggregation": {"enabled": True}, "dp": {"enabled": True,
                                                                                          "epsilon_budget": 8}}})
    assert cfg.privacy.enabled and cfg.privacy.dp.epsilon_budget == 8


def test_the_hub_refuses_clear_results_in_a_secure_round_and_unclipped_ones_under_central_dp(tmp_path):
    for section, bad, why in [
        # 3 silos survive no dropout: the round runs only when the operator accepts that (dropouts: 0)
        (PrivacySection(secure_aggregation=SECAGG.model_copy(update={"dropouts": 0})), 0.1,
         "never accepted in the clear"),
        (PrivacySection(dp=DPConfig(enabled=True, clip_norm=1.0)), 1.0, "exceeds the round's clip norm"),
    ]:
        hub = make(tmp_path / why[:5], section, min_silos=3)
        silos = [Silo(hub, f"s{i}", 0.0) for i in range(3)]
        thread, stopped = round_until_stopped(hub)
        view = hub.next_task("s0", hub.run_id, wait_s=5)
        assert view.kind == "TRAIN"
        task = silo_pb2.Task(task_id=view.task_id, round=view.round)
        with pytest.raises(Refusal, match=why) as refused:  # norm sqrt(4000) * 1.0 >> 1
            silos[0].send_result(task, {"delta/x": torch.full((D,), bad), "weight": torch.ones(1)}, {}, False)
        # A content refusal (the silo waits for the round to close), not FAILED_PRECONDITION (the client rejoins)
        assert refused.value.code == "INVALID_ARGUMENT" and hub.rounds.task.reported == set()
        assert hub.registry.refusals == {"bad_secagg" if section.secure_aggregation.enabled else "clip_norm": 1}
        hub.stop()
        thread.join(5)
        assert stopped == [True]


def test_client_dp_refuses_clip_tensors_that_name_none_of_the_updates_tensors():
    """HASSLE's update is S/delta/... and U/delta/...: the default clip_tensors [delta/] would clip and noise
    nothing while every round is charged epsilon. Refused before anything is handed out, with the prefixes."""
    hassle = {"S/delta/conv.weight": TensorSpec((4, 1, 3, 3), "float32"),
              "U/delta/conv.weight": TensorSpec((4, 1, 3, 3), "float32"), "S/weight": TensorSpec((1,), "float32")}
    with pytest.raises(ValueError, match=r"clip_tensors \['delta/'\] names none .* set privacy.dp.clip_tensors to "
                                         r"\['S/delta/', 'U/delta/'\]"):
        check_clip_tensors(["delta/"], hassle)
    check_clip_tensors(["S/delta/", "U/delta/"], hassle)
    check_clip_tensors(["delta/"], {"delta/conv.weight": TensorSpec((4, 1, 3, 3), "float32")})


def test_every_task_says_how_long_the_hub_still_takes_its_upload(tmp_path):
    # TRAIN carries the round's time left (deadline_s 20), each SECAGG stage its own (stage_deadline_s 1): what a
    # silo waiting in the hub's upload queue keeps its call open for (silo_client/outbox.py upload_timeout).
    hub = make(tmp_path, PrivacySection(secure_aggregation=SECAGG))
    seen: list[tuple[str, str, float]] = []
    next_task = hub.next_task

    def recording(silo_id, run_id, wait_s):
        view = next_task(silo_id, run_id, wait_s=wait_s)
        if view.kind in ("TRAIN", "SECAGG"):
            seen.append((view.kind, view.secagg_stage, view.upload_within_s))
        return view

    hub.next_task = recording
    run_with_silos(hub, [1.0, 2.0, 3.0, 4.0, 5.0])
    assert hub.records.history[-1].secagg.contributors == 5
    train = [w for kind, _, w in seen if kind == "TRAIN"]
    assert len(train) == 5 and all(15 < w <= 20 for w in train)
    assert {stage for kind, stage, _ in seen if kind == "SECAGG"} == {"share_keys", "masked_input", "consistency",
                                                                       "unmask"}
    assert all(0 < w <= 1.0 for kind, _, w in seen if kind == "SECAGG")
