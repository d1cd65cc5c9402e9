"""A hub algorithm that broadcasts its round's model (FedSEAL's ensemble_every_round), driven directly: silos left
out of the sample get RECEIVE, may download but not upload, are not waited for, and their downloads are counted."""

import dataclasses
import threading

import pytest

from silo_server.hub import Refusal
from tests.conftest import wait_for
from tests.silo_server.hubs import build_hub
from tests.silo_server.test_hub import MeanOfSilos, result, start_round, upload, wait_task

# test_hub.make_hub's settings, with a deadline no round here comes near: a round that waited for a silo outside
# its sample would hang the test instead of finishing.
HUB_SETTINGS = dict(total_rounds=3, run_description={"algorithm": "mean"}, min_silos=2, quorum=1.0, deadline_s=120.0,
                    liveness_s=60.0)


class BroadcastingMean(MeanOfSilos):
    def broadcasts_model(self):
        return True


def two_of_four(tmp_path, algorithm):
    hub = build_hub(algorithm, **{**HUB_SETTINGS, "state_dir": tmp_path})
    for s in ("a", "b", "c", "d"):
        hub.join(s, 10, 0, "cpu")
    hub.rounds.sampling = dataclasses.replace(hub.rounds.sampling, count=2)
    return hub


def test_silos_outside_the_sample_receive_the_model_once_and_send_nothing(tmp_path):
    hub = two_of_four(tmp_path, BroadcastingMean())
    thread, out = start_round(hub)
    views = {s: hub.next_task(s, hub.run_id, wait_s=5) for s in "abcd"}
    task = hub.rounds.task
    sampled = sorted(task.sampled)
    receiver, idle = sorted(set("abcd") - task.sampled)
    assert {s: v.kind for s, v in views.items()} == {**dict.fromkeys(sampled, "TRAIN"),
                                                     receiver: "RECEIVE", idle: "RECEIVE"}
    got = views[receiver]
    assert got.task_id == task.task_id and got.round == 1 and got.bundle_sha256 == task.bundle_sha256
    assert got.privacy is None

    bundle = hub.download(receiver, hub.run_id, got.task_id)
    assert bundle == task.bundle
    # Received once a round: asked again, it waits.
    assert hub.next_task(receiver, hub.run_id, wait_s=0.2).kind == "WAIT"
    with pytest.raises(Refusal) as refused:
        upload(hub, receiver, got, result(100.0))
    assert refused.value.code == "PERMISSION_DENIED" and refused.value.reason == "not_sampled"

    # The sampled silos download and report; the round ends without the idle silo ever downloading.
    for s, value in zip(sampled, (1.0, 3.0), strict=True):
        hub.download(s, hub.run_id, views[s].task_id)
        upload(hub, s, views[s], result(value))
    thread.join(30)
    assert not thread.is_alive()
    assert out["state"].tensors["model/x"].tolist() == [2.0, 2.0, 2.0]  # the receiver's 100 is nowhere
    record = hub.records.history[-1]
    assert (record.silos_sampled, record.silos_reported, record.silos_received) == (2, 2, 1)
    assert record.bytes_down == 3 * len(bundle) and record.bytes_down_received == len(bundle)
    assert hub.registry.refusals == {"not_sampled": 1}


def test_without_broadcast_a_silo_outside_the_sample_waits_and_may_not_download(tmp_path):
    hub = two_of_four(tmp_path, MeanOfSilos())
    thread, out = start_round(hub)
    with hub.cond:
        assert hub.cond.wait_for(lambda: hub.rounds.task is not None, timeout=10)
    sampled = sorted(hub.rounds.task.sampled)
    outsider = sorted(set("abcd") - set(sampled))[0]
    bundle = hub.rounds.task.bundle
    assert hub.next_task(outsider, hub.run_id, wait_s=0.2).kind == "WAIT"
    with pytest.raises(Refusal) as refused:
        hub.download(outsider, hub.run_id, hub.rounds.task.task_id)
    assert refused.value.code == "PERMISSION_DENIED" and refused.value.reason == "not_sampled"
    for s in sampled:
        view = wait_task(hub, s)
        hub.download(s, hub.run_id, view.task_id)
        upload(hub, s, view, result(2.0))
    thread.join(30)
    assert out["state"].tensors["model/x"].tolist() == [2.0, 2.0, 2.0]
    record = hub.records.history[-1]
    assert record.silos_received is None and record.bytes_down_received is None
    assert record.bytes_down == 2 * len(bundle)


class HeldAggregation(BroadcastingMean):
    """Broadcasts, and holds finish_round until the test lets it go: the round's aggregation phase, made long."""

    def __init__(self):
        super().__init__()
        self.release = threading.Event()

    def finish_round(self, state, summed, metrics):
        assert self.release.wait(30)
        return super().finish_round(state, summed, metrics)


def test_a_receiver_may_still_download_while_the_round_aggregates_and_is_counted(tmp_path):
    algorithm = HeldAggregation()
    hub = two_of_four(tmp_path, algorithm)
    thread, out = start_round(hub)
    views = {s: hub.next_task(s, hub.run_id, wait_s=5) for s in "abcd"}
    task = hub.rounds.task
    late, never = sorted(set("abcd") - task.sampled)
    for s in sorted(task.sampled):
        upload(hub, s, views[s], result(1.0))
    wait_for(lambda: hub.rounds.phase == "aggregating", 10, "the round to aggregate", poll=0.02)
    assert views[late].kind == "RECEIVE" and hub.download(late, hub.run_id, views[late].task_id) == task.bundle
    with pytest.raises(Refusal) as refused:  # a sampled silo's chance to download ended with the training phase
        hub.download(sorted(task.sampled)[0], hub.run_id, task.task_id)
    assert refused.value.reason == "stale_task"
    algorithm.release.set()
    thread.join(30)
    record = hub.records.history[-1]
    assert record.silos_received == 1 and record.bytes_down_received == len(task.bundle)
    with pytest.raises(Refusal) as refused:  # once the round's record is written, nothing more goes out
        hub.download(never, hub.run_id, views[never].task_id)
    assert refused.value.reason == "stale_task"
