"""The hub core, driven directly (no network): sampling, validation, quorum, deadline, checkpoints."""

import dataclasses
import json
import logging
import threading
import time
from types import SimpleNamespace

import pytest
import torch
from prometheus_client import CollectorRegistry

from security import validation
from silo_core.algorithms.base import HubAlgorithm, HubState, RoundPlan
from silo_core.models import ModelSpec
from silo_core.rounds import RoundRecord, Scores, records_from_json
from silo_core.tensors import TensorSpec, encode, iter_chunks, sha256_hex
from silo_server.hub import Refusal
from silo_server.metrics import HubMetrics
from silo_server.state.checkpoint import CheckpointError, load_latest
from tests.silo_server.hubs import build_hub


class MeanOfSilos(HubAlgorithm):
    """A real (if tiny) algorithm: the global vector moves to the weighted mean of the silos' vectors."""

    name = "mean"

    def __init__(self):
        super().__init__(None, ModelSpec(), None, torch.device("cpu"), 0, 3)

    def init_state(self):
        return HubState(0, {"model/x": torch.zeros(3)})

    def begin_round(self, state):
        return RoundPlan(state.round + 1, dict(state.tensors), {"lr": 1.0},
                         {"delta/x": TensorSpec((3,), "float32"), "weight": TensorSpec((1,), "float32")})

    def finish_round(self, state, summed, metrics):
        x = state.tensors["model/x"] + (summed["delta/x"] / summed["weight"]).float()  # sums arrive in float64
        return HubState(state.round + 1, {"model/x": x}), {"n": metrics.get("n", 0.0)}

    def served_model(self, state):
        return torch.nn.Identity()


def make_hub(tmp_path, **kw):
    defaults = dict(state_dir=tmp_path, total_rounds=3, run_description={"algorithm": "mean"}, min_silos=2,
                    quorum=1.0, deadline_s=5.0, liveness_s=60.0)
    return build_hub(MeanOfSilos(), **{**defaults, **kw})


def upload(hub, silo, task, tensors, round_=None, skipped=False, metrics=None):
    payload = encode(tensors) if tensors else b""
    header = {"run_id": hub.run_id, "task_id": task.task_id, "round": task.round if round_ is None else round_,
              "total_bytes": len(payload), "sha256": sha256_hex(payload), "skipped": skipped,
              "metrics": metrics or {"n": 1.0}}
    hub.upload(silo, header, iter_chunks(payload, 16))


def result(value):
    return {"delta/x": torch.full((3,), float(value)), "weight": torch.tensor([1.0])}


def start_round(hub):
    state = hub.rounds.resume_or_init()
    out = {}
    thread = threading.Thread(target=lambda: out.setdefault("state", hub.rounds.run_round(state)), daemon=True)
    thread.start()
    return thread, out


def wait_task(hub, silo):
    task = hub.next_task(silo, hub.run_id, wait_s=5)
    assert task.kind == "TRAIN", task
    return task


def test_a_round_sums_every_sampled_silo_and_checkpoints(tmp_path):
    hub = make_hub(tmp_path)
    for s in ("a", "b"):
        hub.join(s, 10, 0, "cpu")
    thread, out = start_round(hub)
    ta, tb = wait_task(hub, "a"), wait_task(hub, "b")
    assert ta.task_id == tb.task_id and ta.round == 1
    assert hub.download("a", hub.run_id, ta.task_id)
    upload(hub, "a", ta, result(1.0))
    upload(hub, "b", tb, result(3.0))
    thread.join(10)
    state = out["state"]
    assert torch.allclose(state.tensors["model/x"], torch.full((3,), 2.0))
    record = hub.records.history[-1]
    assert record.round == 1 and record.silos_reported == 2 and record.algorithm == {"n": 2.0}
    assert record.evaluation_seconds is None and record.silo_train_seconds is None  # no test set, no such metric
    assert record.scores == Scores() and record.dp is None and record.secagg is None
    assert record.bytes_up > 0 and record.bytes_down > 0
    # Two 3-number uploads: the collection phase's own memory growth is tiny next to the process's peak.
    assert 0 <= record.collecting_rss_growth_bytes < 50e6 < record.hub_peak_rss_bytes
    loaded, info = load_latest(tmp_path)
    assert loaded.round == 1 and torch.allclose(loaded.tensors["model/x"], torch.full((3,), 2.0))
    # history.json and the checkpoint hold the record's flat JSON, and read back to the same record
    assert records_from_json(json.loads((tmp_path / "history.json").read_text())["rounds"]) == [record]
    # ... except the checkpoint's own write time, which the checkpoint cannot hold (history.json has it)
    assert record.checkpoint_seconds is not None
    assert records_from_json(info["history"]) == [dataclasses.replace(record, checkpoint_seconds=None)]


def test_bad_uploads_are_refused_and_change_nothing(tmp_path):
    hub = make_hub(tmp_path)
    for s in ("a", "b", "c"):
        hub.join(s, 10, 0, "cpu")
    hub.rounds.sampling = dataclasses.replace(hub.rounds.sampling, count=2)
    thread, out = start_round(hub)
    time.sleep(0.3)
    task = hub.rounds.task
    sampled = sorted(task.sampled)
    outsider = ({"a", "b", "c"} - set(sampled)).pop()
    first = sampled[0]
    view = wait_task(hub, first)
    cases = [
        (outsider, lambda: upload(hub, outsider, view, result(100)), "PERMISSION_DENIED"),
        (first, lambda: upload(hub, first, view, {"delta/x": torch.zeros(4), "weight": torch.ones(1)}),
         "INVALID_ARGUMENT"),
        (first, lambda: upload(hub, first, view, {"delta/x": torch.tensor([0.0, float("nan"), 0.0]),
                                                   "weight": torch.ones(1)}), "INVALID_ARGUMENT"),
        (first, lambda: upload(hub, first, view, result(1), round_=0), "FAILED_PRECONDITION"),
    ]
    for _, call, code in cases:
        with pytest.raises(Refusal) as info:
            call()
        assert info.value.code == code
    assert task.reported == set() and task.sums.tensors == {}
    upload(hub, first, view, result(2.0))
    with pytest.raises(Refusal) as dup:
        upload(hub, first, view, result(50.0))
    assert dup.value.code == "ALREADY_EXISTS"
    upload(hub, sampled[1], wait_task(hub, sampled[1]), result(4.0))
    thread.join(10)
    assert torch.allclose(out["state"].tensors["model/x"], torch.full((3,), 3.0))
    assert hub.registry.refusals == {"not_sampled": 1, "bad_tensors": 1, "non_finite": 1, "wrong_round": 1,
                                     "duplicate": 1}
    with pytest.raises(Refusal) as stale:
        upload(hub, first, view, result(2.0))
    assert stale.value.code == "FAILED_PRECONDITION"


def test_below_quorum_at_the_deadline_retries_the_round_instead_of_half_applying(tmp_path):
    hub = make_hub(tmp_path, deadline_s=1.0, quorum=1.0)
    scrape = HubMetrics(hub, registry=CollectorRegistry()).registry.get_sample_value
    for s in ("a", "b"):
        hub.join(s, 10, 0, "cpu")
    thread, out = start_round(hub)
    first = wait_task(hub, "a")
    upload(hub, "a", first, result(10.0))  # b never reports: attempt 1 misses quorum
    time.sleep(1.5)
    # b dropped out of attempt 1: it is not sampled again until it asks for work again
    assert hub.next_task("a", hub.run_id, wait_s=1.0).kind == "WAIT"
    assert hub.registry.counters["rounds_failed"] == 1 and hub.registry.counters["below_quorum"] == 1
    # Prometheus names the silo the failed attempt waited for (what the below-quorum alert asks to look for)
    assert scrape("silokit_hub_silo_dropouts_total") == 1
    assert scrape("silokit_hub_silo_left_out_total", {"silo": "b"}) == 1
    assert scrape("silokit_hub_silo_left_out_total", {"silo": "a"}) is None
    second_b, second_a = wait_task(hub, "b"), wait_task(hub, "a")
    assert second_a.task_id != first.task_id
    upload(hub, "a", second_a, result(1.0))
    upload(hub, "b", second_b, result(3.0))
    thread.join(10)
    assert torch.allclose(out["state"].tensors["model/x"], torch.full((3,), 2.0))  # attempt 1's 10.0 is gone
    assert hub.records.history[-1].attempt == 2
    # One applied round each: a's update in the failed attempt is in no sum, so it is not counted.
    assert hub.records.contributed == {"a": 1, "b": 1}


def test_a_silo_that_skips_counts_for_quorum_but_not_for_the_sum(tmp_path):
    hub = make_hub(tmp_path)
    for s in ("a", "b"):
        hub.join(s, 10, 0, "cpu")
    thread, out = start_round(hub)
    upload(hub, "a", wait_task(hub, "a"), {}, skipped=True, metrics={"train_seconds": 1.0})
    upload(hub, "b", wait_task(hub, "b"), result(4.0), metrics={"train_seconds": 3.0})
    thread.join(10)
    assert torch.allclose(out["state"].tensors["model/x"], torch.full((3,), 4.0))
    assert hub.records.history[-1].silos_skipped == 1
    # A skipping silo trained too (it found nothing to send only afterwards): its time counts in the mean.
    assert hub.records.history[-1].silo_train_seconds == pytest.approx(2.0)


def test_the_silos_mean_time_and_loss_leave_out_branches_that_keep_their_clear_metrics(tmp_path):
    # A branch whose policy says clear_metrics: false uploads its update with no metrics: it is in the sum, but
    # it must not pull the mean training time or loss towards zero.
    hub = make_hub(tmp_path, min_silos=3)
    for s in ("a", "b", "c"):
        hub.join(s, 10, 0, "cpu")
    thread, out = start_round(hub)
    upload(hub, "a", wait_task(hub, "a"), result(1.0), metrics={"train_seconds": 100.0, "train_loss": 0.8})
    upload(hub, "b", wait_task(hub, "b"), result(2.0), metrics={"train_seconds": 140.0, "train_loss": 0.6})
    upload(hub, "c", wait_task(hub, "c"), result(3.0), metrics={"n": 1.0})  # nothing in the clear but a count
    thread.join(10)
    record = hub.records.history[-1]
    assert record.silos_contributed == 3
    assert record.silo_train_seconds == pytest.approx(120.0) and record.silo_train_loss == pytest.approx(0.7)


def test_restart_resumes_after_the_last_checkpoint_with_the_same_run(tmp_path):
    hub = make_hub(tmp_path)
    for s in ("a", "b"):
        hub.join(s, 10, 0, "cpu")
    thread, _ = start_round(hub)
    for s in ("a", "b"):
        upload(hub, s, wait_task(hub, s), result(1.0))
    thread.join(10)
    again = make_hub(tmp_path)
    assert again.run_id == hub.run_id
    state = again.rounds.resume_or_init()
    assert state.round == 1 and again.records.history == hub.records.history
    with pytest.raises(Refusal) as info:
        again.next_task("a", hub.run_id, 0.1)  # the restarted hub has not seen this silo join yet
    assert info.value.code == "FAILED_PRECONDITION"


def test_a_restarted_hub_goes_on_with_a_breaker_search_and_refuses_checkpoints_of_another_run(tmp_path):
    """A search for a silo that breaks the secure sum can outlive its round: a restarted hub continues it (else its
    first cohort is the one that already failed). A checkpoint whose run is not run.json's is refused, not resumed
    under a new run id."""
    hub = make_hub(tmp_path)
    hub.rounds.hunt.failed(["x", "y", "z"])
    hub.rounds.hunt.passed(["z"])  # x, y and z are still suspects (x and y away now); z is tested
    for s in ("a", "b"):
        hub.join(s, 10, 0, "cpu")
    thread, _ = start_round(hub)
    sampled = []
    while not sampled:  # no suspect is live: the usual sample
        sampled = [s for s in ("a", "b") if hub.next_task(s, hub.run_id, 0.2).kind == "TRAIN"]
    for s in sampled:
        upload(hub, s, wait_task(hub, s), result(1.0))
    thread.join(10)
    again = make_hub(tmp_path)
    assert again.rounds.resume_or_init().round == 1
    assert (again.rounds.hunt.suspects, again.rounds.hunt.cleared, again.rounds.hunt.failed_attempts) == (
        {"x", "y", "z"}, {"z"}, 1) == (hub.rounds.hunt.suspects, hub.rounds.hunt.cleared, 1)
    assert again.records.hunt is again.rounds.hunt

    (tmp_path / "run.json").unlink()  # only the checkpoints were restored from a backup
    with pytest.raises(CheckpointError, match="holds run .* names run .* restore run.json"):
        make_hub(tmp_path).rounds.resume_or_init()


def test_the_initial_model_is_scored_before_round_1_and_kept_across_a_restart(tmp_path):
    def score(state):  # the model's first value stands in for its accuracy
        return {"accuracy": float(state.tensors["model/x"][0])}

    hub = make_hub(tmp_path, evaluate=score, validate=score)
    for s in ("a", "b"):
        hub.join(s, 10, 0, "cpu")
    thread, _ = start_round(hub)
    assert hub.records.initial == Scores(test_accuracy=0.0, validation_accuracy=0.0)  # scored before any silo trained
    for s in ("a", "b"):
        upload(hub, s, wait_task(hub, s), result(0.5))
    thread.join(10)
    saved = json.loads((tmp_path / "history.json").read_text())
    assert saved["initial"] == {"validation_accuracy": 0.0, "test_accuracy": 0.0}  # the file's flat layout
    (record,) = records_from_json(saved["rounds"])
    assert (record.round, record.scores) == (1, Scores(test_accuracy=0.5, validation_accuracy=0.5))
    assert 0 <= record.evaluation_seconds <= record.round_seconds
    again = make_hub(tmp_path, evaluate=score, validate=score)
    again.rounds.resume_or_init()
    assert again.records.initial == hub.records.initial  # not re-scored from the resumed model


class TwoGroups(MeanOfSilos):
    """Two independent vectors; a site reports only the one it trained (`<g>/delta/x` = n * delta, `<g>/weight` = n)."""

    def init_state(self):
        return HubState(0, {"model/a": torch.zeros(2), "model/b": torch.zeros(2)})

    def begin_round(self, state):
        expected = {f"{g}/{k}": TensorSpec((2,) if k == "delta/x" else (1,), "float32")
                    for g in ("a", "b") for k in ("delta/x", "weight")}
        return RoundPlan(state.round + 1, dict(state.tensors), {}, expected,
                         groups={"a": ["a/delta/x", "a/weight"], "b": ["b/delta/x", "b/weight"]})

    def finish_round(self, state, summed, metrics):
        tensors = dict(state.tensors)
        for g in ("a", "b"):
            if f"{g}/weight" in summed:
                tensors[f"model/{g}"] = tensors[f"model/{g}"] + (summed[f"{g}/delta/x"] / summed[f"{g}/weight"]).float()
        return HubState(state.round + 1, tensors), {}


def grouped(**groups):
    """{"a": (n, mean delta)} -> the tensors a site sends for those groups."""
    out = {}
    for g, (n, delta) in groups.items():
        out[f"{g}/delta/x"] = torch.full((2,), n * delta)
        out[f"{g}/weight"] = torch.tensor([float(n)])
    return out


def test_grouped_plan_accepts_whole_groups_and_refuses_a_part_of_one(tmp_path):
    hub = build_hub(TwoGroups(), state_dir=tmp_path, total_rounds=1, run_description={"algorithm": "two"}, min_silos=2,
              quorum=1.0, deadline_s=5.0, max_update_norm=10.0)
    for s in ("a", "b"):
        hub.join(s, 10, 0, "cpu")
    thread, out = start_round(hub)
    ta, tb = wait_task(hub, "a"), wait_task(hub, "b")
    cases = [
        ({"a/delta/x": torch.ones(2)}, "group a is incomplete"),  # a group without its weight
        (grouped(a=(11, 1.0)), "exceeds the 10 images"),  # each group's weight is bounded by the declared images
        (grouped(a=(0, 1.0)), "weight must be positive"),
        (grouped(a=(2, 1.0), b=(1, 50.0)), "update norm"),  # each group's norm is checked on its own weight
    ]
    for tensors, message in cases:
        with pytest.raises(Refusal) as refused:
            upload(hub, "a", ta, tensors)
        assert refused.value.code == "INVALID_ARGUMENT" and message in refused.value.message, refused.value.message
    assert hub.rounds.task.sums.tensors == {}
    with pytest.raises(validation.Invalid, match="none of the planned"):  # a result that is not skipped holds one
        validation.check_update({}, hub.rounds.task.plan.expected, groups=hub.rounds.task.plan.groups)
    # Site a trained only model a (3 samples, mean delta 1); site b trained both (1 sample each, delta 5 and 2).
    upload(hub, "a", ta, grouped(a=(3, 1.0)))
    upload(hub, "b", tb, grouped(a=(1, 5.0), b=(1, 2.0)))
    thread.join(10)
    state = out["state"]
    assert torch.allclose(state.tensors["model/a"], torch.full((2,), 2.0))  # (3*1 + 1*5) / 4
    assert torch.allclose(state.tensors["model/b"], torch.full((2,), 2.0))
    assert sum(hub.registry.refusals.values()) == len(cases)


def test_half_precision_declares_large_float_tensors_as_float16_and_keeps_counts_exact():
    from silo_server.hub import wire_specs

    specs = {"delta/w": TensorSpec((64, 32), "float32"), "weight": TensorSpec((1,), "float32"),
             "ids": TensorSpec((4096,), "int64")}
    wire = wire_specs(specs, half=True)
    assert wire["delta/w"].dtype == "float16"
    assert wire["weight"].dtype == "float32" and wire["ids"].dtype == "int64"
    assert wire_specs(specs, half=False) == specs


def test_uploads_beyond_the_in_flight_budget_wait_their_turn_and_none_is_lost(tmp_path):
    one_upload = len(encode(result(0.0)))
    hub = make_hub(tmp_path, max_inflight_upload_bytes=one_upload)  # room for exactly one upload at a time
    for s in ("a", "b"):
        hub.join(s, 10, 0, "cpu")
    thread, out = start_round(hub)
    ta, tb = wait_task(hub, "a"), wait_task(hub, "b")
    payload = encode(result(1.0))
    a_is_streaming, let_a_finish = threading.Event(), threading.Event()

    def slow_chunks():  # silo a sends half its bytes, then stalls until the test lets it go on
        yield 0, payload[:16]
        a_is_streaming.set()
        let_a_finish.wait(10)
        yield 16, payload[16:]

    header = {"run_id": hub.run_id, "task_id": ta.task_id, "round": ta.round, "total_bytes": len(payload),
              "sha256": sha256_hex(payload), "skipped": False, "metrics": {"n": 1.0}}
    a = threading.Thread(target=hub.upload, args=("a", header, slow_chunks()))
    b = threading.Thread(target=upload, args=(hub, "b", tb, result(3.0)))
    a.start()
    assert a_is_streaming.wait(5)
    b.start()
    time.sleep(0.5)
    assert b.is_alive() and hub.intake.upload_budget.held == one_upload  # b waits while a holds the whole budget
    let_a_finish.set()
    a.join(5), b.join(5)
    thread.join(10)
    assert hub.intake.upload_budget.peak == one_upload and hub.intake.upload_budget.held == 0
    assert torch.allclose(out["state"].tensors["model/x"], torch.full((3,), 2.0))  # both uploads summed


def test_an_announced_size_beyond_the_planned_tensors_is_refused_before_reading(tmp_path):
    hub = make_hub(tmp_path)
    for s in ("a", "b"):
        hub.join(s, 10, 0, "cpu")
    thread, out = start_round(hub)
    task = wait_task(hub, "a")
    read = []

    def chunks():
        read.append(1)
        yield 0, b"x"

    header = {"run_id": hub.run_id, "task_id": task.task_id, "round": task.round, "total_bytes": 10 << 20,
              "sha256": "0" * 64, "skipped": False, "metrics": {}}
    with pytest.raises(Refusal) as info:
        hub.upload("a", header, chunks())
    assert info.value.code == "RESOURCE_EXHAUSTED" and "planned tensors" in info.value.message
    assert read == [] and hub.intake.upload_budget.held == 0 and hub.registry.refusals == {"oversized": 1}
    upload(hub, "a", task, result(1.0))  # the refusal cost silo a nothing: its real upload still counts
    upload(hub, "b", wait_task(hub, "b"), result(3.0))
    thread.join(10)
    assert torch.allclose(out["state"].tensors["model/x"], torch.full((3,), 2.0))


def test_a_join_that_changes_nothing_is_neither_logged_nor_audited_but_a_new_connection_is(tmp_path, caplog):
    from security.audit import AUDIT_FILE, AuditLog, read_records

    audit = AuditLog(tmp_path / AUDIT_FILE)
    hub = make_hub(tmp_path / "state", audit=audit)
    with caplog.at_level(logging.INFO, logger="silo_server"):
        for _ in range(50):  # a silo repeating Join on its connection
            hub.join("a", 10, 0, "cpu", connection="ipv4:127.0.0.1:5001")
        hub.join("a", 9, 0, "cpu", connection="ipv4:127.0.0.1:5001")  # a lower count: news
        hub.join("a", 9, 0, "cpu", connection="ipv4:127.0.0.1:6002")  # a restarted process: news
    joined = [r.message for r in caplog.records if r.message.startswith("silo a joined")]
    assert len(joined) == 3
    assert [r["num_unlabeled"] for _, r in read_records(audit.path) if r["kind"] == "join"] == [10, 9, 9]


def test_once_the_quorum_reported_a_silent_or_refused_silo_holds_the_round_only_briefly(tmp_path):
    hub = make_hub(tmp_path, min_silos=3, quorum=0.5, deadline_s=600.0, wait_after_quorum_s=1.0)
    for s in ("a", "b", "c"):
        hub.join(s, 10, 0, "cpu")
    thread, out = start_round(hub)
    tasks = {s: wait_task(hub, s) for s in ("a", "b", "c")}
    started = time.time()
    upload(hub, "a", tasks["a"], result(1.0))
    upload(hub, "b", tasks["b"], result(3.0))
    with pytest.raises(Refusal) as refused:  # c's result is refused (not finite), then it is silent
        upload(hub, "c", tasks["c"], {"delta/x": torch.full((3,), float("nan")), "weight": torch.tensor([1.0])})
    assert refused.value.reason == "non_finite"
    thread.join(30)
    waited = time.time() - started
    assert not thread.is_alive() and 1.0 <= waited < 10  # 1 s past the quorum, not the 600 s deadline
    record = hub.records.history[-1]
    assert record.silos_left_out == ("c",) and 0.9 <= record.quorum_wait_seconds < 5
    assert (record.silos_sampled, record.silos_reported, record.silos_dropped) == (3, 2, 1)
    assert torch.allclose(out["state"].tensors["model/x"], torch.full((3,), 2.0))
    assert RoundRecord.from_json(record.to_json()).silos_left_out == ("c",)


def test_a_quorum_lost_again_does_not_close_the_round_while_others_may_still_report():
    """Under secure aggregation a silo that reported (its keys) can still abort: the round must not close at
    quorum + wait with fewer than the quorum while a sampled silo is still training."""
    from silo_server.rounds.round_loop import SiloCalls
    from silo_server.state.registry import ChangeCondition

    cond = ChangeCondition()
    task = SimpleNamespace(round=1, sampled={"a", "b", "c"}, reported={"a", "b"}, gone=set(), quorum_wait=None,
                           deadline=time.time() + 60)
    loop = SimpleNamespace(cond=cond, stop_event=threading.Event(), round_quorum=lambda t: 2,
                           quorum_reached=lambda t, need: len(t.reported - t.gone) >= need,
                           wait_after_quorum=lambda t: 0.3, check_revocations=lambda: None)

    def later():
        time.sleep(0.1)
        with cond:  # b aborts: the quorum is lost
            task.gone.add("b")
            cond.notify_all()
        time.sleep(1.0)  # more than the wait after the quorum
        with cond:
            task.reported.add("c")
            cond.notify_all()

    silos = threading.Thread(target=later)
    silos.start()
    SiloCalls().collect(loop, task)
    silos.join()
    assert task.reported - task.gone == {"a", "c"} and task.quorum_wait is None  # closed by c, not by the wait


def test_by_default_the_round_waits_twice_its_median_report_time_and_at_least_ten_seconds(tmp_path):
    from silo_server.rounds.round_loop import QUORUM_WAIT_FLOOR_S

    hub = make_hub(tmp_path)
    assert hub.rounds.wait_after_quorum(SimpleNamespace(report_seconds=[])) == QUORUM_WAIT_FLOOR_S == 10.0
    assert hub.rounds.wait_after_quorum(SimpleNamespace(report_seconds=[4.0, 30.0, 8.0])) == 16.0
    assert make_hub(tmp_path / "set", wait_after_quorum_s=3.0).rounds.wait_after_quorum(
        SimpleNamespace(report_seconds=[40.0])) == 3.0


def test_a_hub_stopped_by_an_error_tells_silos_to_wait_not_that_the_run_is_over(tmp_path):
    # DONE makes a silo exit for good (exit 0: systemd does not restart it), while a hub stopped by an error is
    # restarted and resumes from its checkpoint: it would then wait for silos that had all gone home.
    hub = make_hub(tmp_path)
    hub.join("a", 10, 0, "cpu")
    hub.rounds.set_phase("failed")
    view = hub.next_task("a", hub.run_id, wait_s=0.2)
    assert view.kind == "WAIT" and view.retry_after_s == 5.0 and "resumes from its checkpoint" in view.message
    assert "a" in hub.registry.silos_not_told_done()
    hub.rounds.set_phase("done")
    assert hub.next_task("a", hub.run_id, wait_s=0.2).kind == "DONE"
    assert "a" not in hub.registry.silos_not_told_done()
