"""A silo whose upload waits in the hub's upload queue keeps its call open while the hub says it still takes the
upload (the task's upload_within_s: the round's time left), over real gRPC, instead of timing out at its own limit
and sending the same bytes again; a hub's word past a day, or a value that is no number, is not taken."""

from __future__ import annotations

import contextlib
import json
import threading
import time

import pytest

from security.audit import AUDIT_FILE
from silo.v1 import silo_pb2
from silo_client import outbox as outbox_module
from silo_client.outbox import MAX_UPLOAD_WAIT_S, UPLOAD_MARGIN_S, UPLOAD_TIMEOUT_S, Outbox
from silo_server.app import HubApp
from silo_server.rounds.aggregate import UploadBudget
from tests.silo_client.test_receive import run_dev_silos, semifl_hub_config

HELD_S = 6.0  # how long the test keeps the hub's whole upload budget


def hub_config(tmp_path):
    return semifl_hub_config(tmp_path, ["dev-1"], rounds={"total": 1})


def test_an_upload_queued_at_the_hub_waits_for_the_round_not_the_silos_own_limit(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(outbox_module, "UPLOAD_TIMEOUT_S", 2.0)  # the silo's own limit, well under HELD_S
    app = HubApp(hub_config(tmp_path), insecure_dev_only=True)
    budget = app.hub.intake.upload_budget
    polled: list[float] = []
    held = threading.Event()

    def hold_the_budget():  # another silo's large upload, in the hub's memory for HELD_S
        with budget.hold(budget.limit):
            held.set()
            time.sleep(HELD_S)

    poll = Outbox.poll

    def polling(self, request, timeout):
        task = poll(self, request, timeout)
        if task.kind == silo_pb2.Task.TRAIN:
            polled.append(task.upload_within_s)
            if not held.is_set():  # from the moment the silo has its task: its upload must queue
                threading.Thread(target=hold_the_budget, daemon=True).start()
                assert held.wait(10)
        return task

    monkeypatch.setattr(Outbox, "poll", polling)
    waited: list[float] = []  # how long the silo's upload waited for room in the hub's budget
    hold = UploadBudget.hold

    @contextlib.contextmanager
    def timed_hold(self, size, still_wanted=lambda: True):
        asked = time.monotonic()
        with hold(self, size, still_wanted):
            if size != self.limit:
                waited.append(time.monotonic() - asked)
            yield

    monkeypatch.setattr(UploadBudget, "hold", timed_hold)
    history = run_dev_silos(app, tmp_path, ["dev-1"])

    assert [r.silos_reported for r in history] == [1]
    assert polled and all(100 < s <= 120 for s in polled)  # the round's 120 s deadline, less what has passed
    # One upload call that waited its turn past the silo's own 2 s: not cut and sent again (each send is its own
    # audit record, and its own wait here).
    assert len(waited) == 1 and waited[0] > 2.0 + 1.0
    records = [json.loads(line) for line in (tmp_path / "state-dev-1" / AUDIT_FILE).read_text().splitlines()]
    assert [r["round"] for r in records if r["kind"] == "upload"] == [1]


class _Stub:
    def __init__(self, within: float):
        self.within = within

    def NextTask(self, request, timeout):  # noqa: N802 (the gRPC method's name)
        return silo_pb2.Task(kind=silo_pb2.Task.TRAIN, task_id="t1", upload_within_s=self.within)


class _Audit:
    def append(self, *args, **kwargs):
        pass


@pytest.mark.parametrize(("within", "timeout"), [
    (0.0, UPLOAD_TIMEOUT_S),  # a hub that does not say: the silo's own limit
    (60.0, UPLOAD_TIMEOUT_S),  # closes sooner than the silo's own limit: that limit stays
    (3_600.0, 3_600.0 + UPLOAD_MARGIN_S),
    (1e12, MAX_UPLOAD_WAIT_S),  # past a day: not taken
    (float("inf"), UPLOAD_TIMEOUT_S), (float("nan"), UPLOAD_TIMEOUT_S), (-5.0, UPLOAD_TIMEOUT_S),
])
def test_the_upload_limit_follows_the_hubs_word_within_bounds(within, timeout) -> None:
    box = Outbox(_Stub(within), _Audit(), None, dict)
    box.poll(silo_pb2.NextTaskRequest(), timeout=1)
    assert box.upload_timeout("t1") == pytest.approx(timeout, abs=1.0)
    assert box.upload_timeout("another task") == UPLOAD_TIMEOUT_S


def test_a_later_task_answer_without_a_time_replaces_the_earlier_one() -> None:
    # A SECAGG stage's answer of 0 (its deadline just passed) must not leave the TRAIN's round-long limit in place.
    stub = _Stub(3_600.0)
    box = Outbox(stub, _Audit(), None, dict)
    box.poll(silo_pb2.NextTaskRequest(), timeout=1)
    assert box.upload_timeout("t1") > 3_600.0
    stub.within = 0.0
    box.poll(silo_pb2.NextTaskRequest(), timeout=1)
    assert box.upload_timeout("t1") == UPLOAD_TIMEOUT_S
