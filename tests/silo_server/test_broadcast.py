"""A hub algorithm that broadcasts its round's model (FedSEAL's ensemble_every_round), driven directly: silos left
out of the sample get RECEIVE, may download but not upload, are not waited for, and their downloads are counted."""

import dataclasses

import pytest

from silo_server.hub import Hub, Refusal
from tests.silo_server.test_hub import MeanOfSilos, result, start_round, upload, wait_task

# test_hub.make_hub's settings, with a deadline no round here comes near: a round that waited for a silo outside
# its sample would hang the test instead of finishing.
HUB_SETTINGS = dict(total_rounds=3, run_description={"algorithm": "mean"}, min_silos=2, quorum=1.0, deadline_s=120.0,
                    liveness_s=60.0)


class BroadcastingMean(MeanOfSilos):
    def broadcasts_model(self):
        return True


def two_of_four(tmp_path, algorithm):
    hub = Hub(algorithm, **{**HUB_SETTINGS, "state_dir": tmp_path})
    for s in ("a", "b", "c", "d"):
        hub.join(s, 10, 0, "cpu")
    hub.sampling = dataclasses.replace(hub.sampling, count=2)
    return hub


def test_silos_outside_the_sample_receive_the_model_once_and_send_nothing(tmp_path):
    hub = two_of_four(tmp_path, BroadcastingMean())
    thread, out = start_round(hub)
    views = {s: hub.next_task(s, hub.run_id, wait_s=5) for s in "abcd"}
    task = hub.task
    sampled = sorted(task.sampled)
    receiver, idle = sorted(set("abcd") - task.sampled)
    assert {s: v.kind for s, v in views.items()} == {**dict.fromkeys(sampled, "TRAIN"),
                                                     receiver: "RECEIVE", idle: "RECEIVE"}
    got = views[receiver]
    assert got.task_id == task.task_id and got.round == 1 and got.bundle_sha256 == task.bundle_sha256
    assert got.privacy_json == ""

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
    record = hub.history[-1]
    assert (record.silos_sampled, record.silos_reported, record.silos_received) == (2, 2, 1)
    assert record.bytes_down == 3 * len(bundle) and record.bytes_down_received == len(bundle)
    assert hub.refusals == {"not_sampled": 1}


def test_without_broadcast_a_silo_outside_the_sample_waits_and_may_not_download(tmp_path):
    hub = two_of_four(tmp_path, MeanOfSilos())
    thread, out = start_round(hub)
    with hub.cond:
        assert hub.cond.wait_for(lambda: hub.task is not None, timeout=10)
    sampled = sorted(hub.task.sampled)
    outsider = sorted(set("abcd") - set(sampled))[0]
    bundle = hub.task.bundle
    assert hub.next_task(outsider, hub.run_id, wait_s=0.2).kind == "WAIT"
    with pytest.raises(Refusal) as refused:
        hub.download(outsider, hub.run_id, hub.task.task_id)
    assert refused.value.code == "PERMISSION_DENIED" and refused.value.reason == "not_sampled"
    for s in sampled:
        view = wait_task(hub, s)
        hub.download(s, hub.run_id, view.task_id)
        upload(hub, s, view, result(2.0))
    thread.join(30)
    assert out["state"].tensors["model/x"].tolist() == [2.0, 2.0, 2.0]
    record = hub.history[-1]
    assert record.silos_received is None and record.bytes_down_received is None
    assert record.bytes_down == 2 * len(bundle)
